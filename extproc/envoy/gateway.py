"""Gateway mode's one decision: is this request ours, or does it pass through untouched? Pure.

In gateway mode our ext_proc filter runs on the whole inference route of the gateway's Envoy, right
after the endpoint picker's (docs/gateway.md). It cannot be enabled per route by a match on
x-prefiller-host-port: the picker adds that header mid-chain, after Envoy has fixed the filter chain
for the request, so such a route never enables the filter and every P/D request would reach decode
without a handoff (envoyproxy/gateway#9444, envoyproxy/envoy#44739). The rendered filter is wrapped in a
matcher that skips it when the header is absent (envoy/parts.py), so the server sees requests with
the header; it lets through, after their headers message, those that are not P/D (and, where a
gateway runs the filter without the matcher, every request without the header): the reply to the
headers turns off the rest of the stream (``mode_override``: no body, no response headers), and Envoy
closes the stream after it. A P/D request is one the sidecar's pd route would match: POST to
a path the adapter serves P/D (envoy/pd_paths.py) carrying the picker's x-prefiller-host-port.

Envoy honours ``mode_override`` only with ``allow_mode_override`` in the filter, only on a headers
reply, and only when the filter's configured body modes are not FULL_DUPLEX_STREAMED
(envoyproxy/envoy source/extensions/filters/http/ext_proc/ext_proc.cc, ``Filter::onReceiveMessage``;
header modes left DEFAULT keep the filter's, body modes are always taken: ``effectiveModeOverride``).
The filter's ``allowed_override_modes`` lists exactly ``PASSTHROUGH_MODE`` (envoy/parts.py), so no
other override is ever applied.
"""

from __future__ import annotations

from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from extproc.core.headers import PICKER_HEADERS
from extproc.core.openai_request import OPENAI_ENDPOINTS
from extproc.core.prefill_target import HEADER as PREFILL_TARGET_HEADER
from extproc.envoy.messages import RequestHead

# The sidecar's pd route matches the same paths (envoy/pd_paths.py, a full match on the path without its
# query); the processor passes the adapter's (PdProcessor.pd_paths).
OPENAI_PATHS = frozenset(endpoint.value for endpoint in OPENAI_ENDPOINTS)

_Mode = processing_mode_pb2.ProcessingMode
PASSTHROUGH_MODE = _Mode(
    request_header_mode=_Mode.SEND,  # ignored by Envoy here (the headers were sent), required by the allow-list match
    request_body_mode=_Mode.NONE,
    request_trailer_mode=_Mode.SKIP,
    response_header_mode=_Mode.SKIP,
    response_body_mode=_Mode.NONE,
    response_trailer_mode=_Mode.SKIP,
)


def is_pd_request(head: RequestHead, paths: frozenset[str] = OPENAI_PATHS) -> bool:
    """A request the sidecar's pd route would take: POST, a P/D path, the picker's prefill header (any
    value: a bad one is refused later with invalid_prefill_target, exactly as in sidecar mode)."""
    path = head.path.split("?", 1)[0]
    return (head.first(":method") == "POST" and path in paths
            and PREFILL_TARGET_HEADER in (name for name, _ in head.headers))


def passthrough() -> pb.ProcessingResponse:
    """Continue the request untouched but for the picker's P/D headers (the sidecar's routes drop them
    too), and ask Envoy for nothing more on this stream."""
    response = pb.ProcessingResponse(request_headers=pb.HeadersResponse())
    response.request_headers.response.header_mutation.remove_headers.extend(sorted(PICKER_HEADERS))
    response.mode_override.CopyFrom(PASSTHROUGH_MODE)
    return response


def without_picker_headers(response: pb.ProcessingResponse) -> pb.ProcessingResponse:
    """A P/D body reply that also drops the picker's P/D headers before decode (the sidecar's pd route
    drops them; here the gateway's route may not)."""
    if response.WhichOneof("response") == "request_body":
        mutation = response.request_body.response.header_mutation
        present = set(mutation.remove_headers)
        mutation.remove_headers.extend(name for name in sorted(PICKER_HEADERS) if name not in present)
    return response
