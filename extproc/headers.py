"""Which of the client's headers the prefill leg carries. Pure.

Kept: end-to-end headers, including authorization, x-request-id (so both legs share one id),
W3C trace context and any routing header the engines read. Dropped: pseudo-headers, hop-by-hop
headers (RFC 9110 §7.6.1) and any header the client's Connection header names, framing headers the
client computed for its own body, Envoy-internal headers, and the P/D routing header itself.
"""

from __future__ import annotations

from collections.abc import Iterable

from extproc.prefill_target import HEADER as PREFILL_TARGET_HEADER

HOP_BY_HOP = frozenset({
    "connection", "keep-alive", "proxy-connection", "te", "trailer", "transfer-encoding", "upgrade",
    "proxy-authorization", "proxy-authenticate",
})
_RECOMPUTED = frozenset({"host", "content-length", "content-type", "expect", "accept-encoding"})
_ROUTING_ONLY = frozenset({PREFILL_TARGET_HEADER})


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
