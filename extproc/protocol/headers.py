"""Which of the client's headers the prefill leg carries. Pure.

Kept: end-to-end headers, including authorization, x-request-id (so both legs share one id),
W3C trace context and any routing header the engines read. Dropped: pseudo-headers, hop-by-hop
headers (RFC 9110 §7.6.1) and any header the client's Connection header names, framing headers the
client computed for its own body, Envoy-internal headers, the endpoint picker's routing headers
(llm-d-router ``pkg/common/routing/common.go``: they name workers for the router, not for an engine),
and the data-parallel rank headers (``x-data-parallel-rank``, read by vLLM's API server,
``_get_data_parallel_rank``, and by SGLang's ``serving_base.py``; SGLang's ``x-override-routed-dp-rank``):
they pin a rank of the decode worker's engine; the prefill worker's rank is its port (one endpoint
per rank port), and another engine's rank number there would be out of range or wrong.
"""

from __future__ import annotations

from collections.abc import Iterable

from extproc.protocol.prefill_target import HEADER as PREFILL_TARGET_HEADER

HOP_BY_HOP = frozenset({
    "connection", "keep-alive", "proxy-connection", "te", "trailer", "transfer-encoding", "upgrade",
    "proxy-authorization", "proxy-authenticate",
})
_RECOMPUTED = frozenset({"host", "content-length", "content-type", "expect", "accept-encoding"})
# The endpoint picker's headers (llm-d-router v0.10.0, pkg/common/routing/common.go). Envoy removes
# them before decode too (envoy/bootstrap.py, envoy/parts.py); we do not run encode stages or P2P KV pulls.
PICKER_HEADERS = frozenset({PREFILL_TARGET_HEADER, "x-encoder-hosts-ports", "x-kv-cache-source-host-port"})
DATA_PARALLEL_RANKS = frozenset({"x-data-parallel-rank", "x-override-routed-dp-rank"})
_ROUTING_ONLY = PICKER_HEADERS | DATA_PARALLEL_RANKS


def prefill_headers(client_headers: Iterable[tuple[str, str]],
                    reserved: frozenset[str] = frozenset()) -> list[tuple[str, str]]:
    """The headers for the derived prefill request, in the client's order, names lower-case, without
    the headers the adapter reserves (it sets its own where it needs them)."""
    headers = [(name.lower(), value) for name, value in client_headers]
    named_by_connection = {
        token.strip().lower()
        for name, value in headers if name == "connection"
        for token in value.split(",")
    }
    kept = [
        (name, value) for name, value in headers
        if not name.startswith(":")
        and not name.startswith("x-envoy-")
        and name not in HOP_BY_HOP
        and name not in _RECOMPUTED
        and name not in _ROUTING_ONLY
        and name not in named_by_connection
        and name not in reserved
    ]
    kept.append(("content-type", "application/json"))
    kept.append(("accept-encoding", "identity"))  # the size cap applies to what we read, unexpanded
    return kept
