"""Gateway mode's one decision: is this request ours, or does it pass through untouched? Pure.

In gateway mode our ext_proc filter runs on the whole inference route of the gateway's Envoy, right
after the endpoint picker's (docs/gateway.md). It cannot be enabled per route by a match on
x-prefiller-host-port: the picker adds that header mid-chain, after Envoy has fixed the filter chain
for the request, so such a route never enables the filter and every P/D request would reach decode
without a handoff (envoyproxy/gateway#9444, envoyproxy/envoy#44739). The rendered filter is wrapped in a
matcher that skips it when the header is absent (envoy/parts.py), so the server sees requests with
the header. Where a gateway runs the filter without the matcher, a request without the header is let
through after its headers message: the reply turns off the rest of the stream (``mode_override``: no
body, no response headers), and Envoy closes the stream after it. A request with the header that is not
P/D (another method or path: the picker may tag any request of the route) is never let through unseen:
its body is checked for steering members (``steering_refusal``, in a worker process when the body is
over 16 KiB: core/inspector.py), because the client guard is skipped for
tagged requests only when they are P/D. A P/D request is one the sidecar's pd route would match
(envoy/pd_request.py): POST to /v1/chat/completions or /v1/completions carrying x-prefiller-host-port.

Envoy honours ``mode_override`` only with ``allow_mode_override`` in the filter, only on a headers
reply, and only when the filter's configured body modes are not FULL_DUPLEX_STREAMED
(envoyproxy/envoy source/extensions/filters/http/ext_proc/ext_proc.cc, ``Filter::onReceiveMessage``;
header modes left DEFAULT keep the filter's, body modes are always taken: ``effectiveModeOverride``).
The filter's ``allowed_override_modes`` lists exactly ``PASSTHROUGH_MODE`` (envoy/parts.py), so no
other override is ever applied.
"""

from __future__ import annotations

import orjson
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from extproc.core.headers import PICKER_HEADERS
from extproc.core.inspection import Refusal
from extproc.core.steering import STEERING_FIELDS, refuse_steering
from extproc.envoy import messages as msg
from extproc.envoy.messages import RequestHead
from extproc.envoy.pd_request import PREFILL_TARGET_HEADER, is_pd
from extproc.errors import PdError

_Mode = processing_mode_pb2.ProcessingMode
PASSTHROUGH_MODE = _Mode(
    request_header_mode=_Mode.SEND,  # ignored by Envoy here (the headers were sent), required by the allow-list match
    request_body_mode=_Mode.NONE,
    request_trailer_mode=_Mode.SKIP,
    response_header_mode=_Mode.SKIP,
    response_body_mode=_Mode.NONE,
    response_trailer_mode=_Mode.SKIP,
)


def is_tagged(head: RequestHead) -> bool:
    """The picker set x-prefiller-host-port (the client's own copy is removed before any filter runs)."""
    return PREFILL_TARGET_HEADER in (name for name, _ in head.headers)


def is_pd_request(head: RequestHead) -> bool:
    """A request the sidecar's pd route would take (envoy/pd_request.py: the one rule)."""
    return is_pd(head.first(":method"), head.path, is_tagged(head))


# A JSON key spells a steering member's last name either literally or with a \u escape (the names are
# ASCII letters and "_", which no other escape yields): a body with neither is not parsed at all.
_LAST_NAMES = tuple(sorted({field.path[-1].encode() for field in STEERING_FIELDS}))


def _may_steer(body: bytes) -> bool:
    return b"\\u" in body or any(name in body for name in _LAST_NAMES)


def steering_refusal(body: bytes) -> Refusal | None:
    """A tagged request that is not P/D (another method or path): its body, which the engine may read as
    JSON whatever the path, is checked for steering members as on the P/D route (the same 400
    reserved_request_field). A body that is not a JSON object carries no member to check here (the
    client guard in front judges other kinds). Picklable, for the inspection pool."""
    try:
        parsed = orjson.loads(body) if _may_steer(body) else None
    except orjson.JSONDecodeError:
        parsed = None
    if isinstance(parsed, dict):
        try:
            refuse_steering(parsed)
        except PdError as exc:
            return Refusal(exc.code, exc.field, exc.problem)
    return None


def tagged_reply(refusal: Refusal | None) -> pb.ProcessingResponse:
    """The refusal, or the body continued unchanged but for the picker's headers."""
    if refusal is not None:
        error = refusal.error()
        return msg.error_reply(error.code, error.status, error.field)
    response = pb.ProcessingResponse(request_body=pb.BodyResponse())
    response.request_body.response.header_mutation.remove_headers.extend(sorted(PICKER_HEADERS))
    return response


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
