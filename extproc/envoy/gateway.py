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
over 16 KiB: pipeline/inspector.py), because the client guard is skipped for
tagged requests only when they are P/D. A P/D request is one the sidecar's pd route would match
(protocol/pd_request.py): POST to a path the adapter serves P/D (adapters.served) carrying
x-prefiller-host-port. Its body reply drops the picker's headers too (the sidecar's pd route drops them;
the gateway's route may not): the processor removes them as it builds that reply (app.py passes them),
since a reply may be shared and is never changed after it was built.

Envoy honours ``mode_override`` only with ``allow_mode_override`` in the filter, only on a headers
reply, and only when the filter's configured body modes are not FULL_DUPLEX_STREAMED
(envoyproxy/envoy source/extensions/filters/http/ext_proc/ext_proc.cc, ``Filter::onReceiveMessage``;
header modes left DEFAULT keep the filter's, body modes are always taken: ``effectiveModeOverride``).
The filter's ``allowed_override_modes`` lists exactly ``PASSTHROUGH_MODE`` (envoy/parts.py), so no
other override is ever applied.
"""

from __future__ import annotations

import json

import orjson
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from extproc.envoy import messages as msg
from extproc.protocol.errors import PdError
from extproc.protocol.headers import PICKER_HEADERS
from extproc.protocol.inspection import Refusal
from extproc.protocol.pd_request import OPENAI_PATHS, PREFILL_TARGET_HEADER, is_pd
from extproc.protocol.request_head import RequestHead
from extproc.protocol.steering import STEERING_FIELDS, refuse_steering

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


def is_pd_request(head: RequestHead, paths: frozenset[str] = OPENAI_PATHS) -> bool:
    """A request the sidecar's pd route would take (protocol/pd_request.py: the one rule); ``paths`` are the
    adapter's P/D paths (PdProcessor.pd_paths)."""
    return is_pd(head.first(":method"), head.path, is_tagged(head), paths)


# A JSON key spells a steering member's last name either literally or with a \u escape (the names are
# ASCII letters and "_", which no other escape yields), unless the body is UTF-16 or UTF-32, which CPython's
# json.loads detects (json.detect_encoding: a BOM, or a NUL among the first four bytes): a body with none
# of these is not parsed at all.
_LAST_NAMES = tuple(sorted({field.path[-1].encode() for field in STEERING_FIELDS}))
_WIDE_BOMS = (b"\xfe\xff", b"\xff\xfe")


def _may_steer(body: bytes) -> bool:
    head = body[:4]
    return (b"\0" in head or head.startswith(_WIDE_BOMS) or b"\\u" in body
            or any(name in body for name in _LAST_NAMES))


def _read_as_engines_do(body: bytes) -> object:
    """The body as an engine's JSON reader sees it: orjson (SGLang) or CPython's json.loads (FastAPI's, so
    vLLM's and TensorRT-LLM's), which also reads what orjson refuses (NaN, a BOM, UTF-16/32). None for a
    body neither reads."""
    try:
        return orjson.loads(body)
    except orjson.JSONDecodeError:
        pass
    try:
        return json.loads(body)
    except (ValueError, RecursionError):
        return None


def steering_refusal(body: bytes) -> Refusal | None:
    """A tagged request that is not P/D (another method or path): its body, which the engine may read as
    JSON whatever the path, is checked for steering members as on the P/D route (the same 400
    reserved_request_field). A body that no engine reads as a JSON object carries no member to check here
    (the client guard in front judges other kinds). Picklable, for the inspection pool."""
    parsed = _read_as_engines_do(body) if _may_steer(body) else None
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

