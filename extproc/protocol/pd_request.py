"""Which request is a P/D request: one rule for every place that decides it. Pure.

The sidecar's pd route (envoy/bootstrap.py), the gateway-mode server (envoy/gateway.py ``is_pd_request``)
and the gateway parts' guard matcher (envoy/parts.py) all read a request as P/D exactly when its method
is POST, its path (without the query) is one the adapter serves P/D (adapters.served), and it carries
the picker's x-prefiller-host-port. The guard may be skipped only where our server reads the body, so the
three must never disagree (tests/unit/test_pd_request.py runs one table through each).
"""

from __future__ import annotations

import re

from extproc.protocol.openai_request import OPENAI_ENDPOINTS, Endpoint, paths_of
from extproc.protocol.prefill_target import HEADER as PREFILL_TARGET_HEADER

PD_METHOD = "POST"
# The paths every adapter serves P/D (the default where no adapter is named).
OPENAI_PATHS = paths_of(OPENAI_ENDPOINTS)

__all__ = ["OPENAI_PATHS", "PD_METHOD", "PREFILL_TARGET_HEADER", "full_path_regex", "is_pd", "path_regex"]


def path_regex(endpoints: frozenset[Endpoint]) -> str:
    """An RE2 pattern that fully matches exactly these paths (Envoy's route ``safe_regex`` matches the path
    without its query)."""
    return "|".join(re.escape(path) for path in sorted(endpoint.value for endpoint in endpoints))


def full_path_regex(endpoints: frozenset[Endpoint]) -> str:
    """The rule on the whole :path, query included: what a header matcher on :path sees (Envoy's route
    ``safe_regex``, path_regex, is matched against the path without its query). RE2 and Python's
    re agree on this pattern ("." stops at a newline in both; a header value has none)."""
    return f"({path_regex(endpoints)})(\\?.*)?"


def is_pd(method: str | None, path: str, tagged: bool, paths: frozenset[str] = OPENAI_PATHS) -> bool:
    """``tagged``: the request carries x-prefiller-host-port (any value: a bad one is refused later with
    invalid_prefill_target); ``paths``: the adapter's P/D paths."""
    return method == PD_METHOD and tagged and path.split("?", 1)[0] in paths
