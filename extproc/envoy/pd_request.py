"""Which request is a P/D request: one rule for every place that decides it. Pure.

The sidecar's pd route (envoy/bootstrap.py), the gateway-mode server (envoy/gateway.py ``is_pd_request``)
and the gateway parts' guard matcher (envoy/parts.py) all read a request as P/D exactly when its method
is POST, its path (without the query) is one of the P/D paths, and it carries the picker's
x-prefiller-host-port. The guard may be skipped only where our server reads the body, so the three must
never disagree (tests/unit/test_pd_request.py runs one table through each).
"""

from __future__ import annotations

import re

from extproc.core.prefill_target import HEADER as PREFILL_TARGET_HEADER

PD_METHOD = "POST"
# Envoy's route safe_regex is matched whole against :path once the query is removed.
PD_PATH_REGEX = "/v1/(chat/)?completions"
# The same rule on the whole :path, query included: what a header matcher on :path sees. RE2 and Python's
# re agree on this pattern ("." stops at a newline in both; a header value has none).
PD_FULL_PATH_REGEX = PD_PATH_REGEX + r"(\?.*)?"
_FULL_PATH = re.compile(PD_FULL_PATH_REGEX)

__all__ = ["PD_FULL_PATH_REGEX", "PD_METHOD", "PD_PATH_REGEX", "PREFILL_TARGET_HEADER", "is_pd"]


def is_pd(method: str | None, path: str, tagged: bool) -> bool:
    """``tagged``: the request carries x-prefiller-host-port (any value: a bad one is refused later with
    invalid_prefill_target)."""
    return method == PD_METHOD and tagged and _FULL_PATH.fullmatch(path) is not None
