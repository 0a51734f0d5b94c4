"""Which paths the P/D route takes: the endpoints the configured adapter serves P/D (openai_request.Endpoint),
one source for the sidecar's route (bootstrap.py), the gateway's decision (gateway.py) and the manifests."""

from __future__ import annotations

import re

from extproc.adapters import KILL_SWITCH, engines
from extproc.core.openai_request import OPENAI_ENDPOINTS, Endpoint


def served(adapter: str) -> frozenset[Endpoint]:
    """The endpoints the adapter serves P/D (chat and completions for the kill switch, whose route
    refuses them all)."""
    if adapter == KILL_SWITCH or adapter not in engines():
        return OPENAI_ENDPOINTS
    return engines()[adapter].endpoints


def path_regex(endpoints: frozenset[Endpoint]) -> str:
    """An RE2 pattern that fully matches exactly these paths (Envoy's route ``safe_regex`` matches the path
    without its query)."""
    return "|".join(re.escape(path) for path in sorted(endpoint.value for endpoint in endpoints))
