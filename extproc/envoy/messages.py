"""Conversions between Envoy ext_proc protobuf messages and our plain values (the request's head in, the
pipeline's decisions out). Pure; with stream.py and gateway.py the only code that builds or reads them.

Envoy sends header values in ``raw_value`` (bytes) and ignores ``value`` on mutations, so both
directions use ``raw_value`` only.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.type.v3 import http_status_pb2

from extproc.pipeline.decisions import JSON, LocalReply, SendToDecode
from extproc.protocol.errors import Code, error_body
from extproc.protocol.request_head import RequestHead


def head_from_headers(message: pb.HttpHeaders) -> RequestHead:
    headers = []
    path = None
    for header in message.headers.headers:  # one pass: each field read from the message once
        key, raw = header.key.lower(), header.raw_value
        value = raw.decode("latin-1") if raw else header.value
        headers.append((key, value))
        if path is None and key == ":path":
            path = value
    return RequestHead(path=path or "", headers=tuple(headers))


def response_status(message: pb.HttpHeaders) -> int:
    """The :status of a response-headers message (0 if absent or malformed)."""
    for header in message.headers.headers:
        if header.key == ":status":
            text = header.raw_value.decode("latin-1") if header.raw_value else header.value
            return int(text) if text.isdigit() else 0
    return 0


_OVERWRITE = base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD


def _add_header(options: Any, key: str, value: bytes) -> None:
    """Append a set-header to a repeated HeaderValueOption field, built in place."""
    header = options.add(append_action=_OVERWRITE).header
    header.key = key
    header.raw_value = value


# Replies that never vary, built once (0.8 -> 0.04 us a reply). Shared: nothing may change what these
# functions return (tests/unit/test_shared_replies.py); a reply that needs more is built whole by its maker.
_CONTINUE_HEADERS = pb.ProcessingResponse(request_headers=pb.HeadersResponse())
_CONTINUE_RESPONSE_HEADERS = pb.ProcessingResponse(response_headers=pb.HeadersResponse())


def continue_headers() -> pb.ProcessingResponse:
    return _CONTINUE_HEADERS


def continue_response_headers() -> pb.ProcessingResponse:
    return _CONTINUE_RESPONSE_HEADERS


# Our dynamic-metadata namespace: Envoy accepts it (ext_proc metadata_options) and the pd route turns
# its keys into response headers and access-log fields (envoy/bootstrap.py, envoy/parts.py).
METADATA_NAMESPACE = "pd_extproc"


def replace_body(body: bytes, set_headers: Sequence[tuple[str, bytes]] = (),
                 remove_headers: Sequence[str] = (),
                 metadata: Mapping[str, str] | None = None) -> pb.ProcessingResponse:
    """Send ``body`` to decode with these request headers set or removed, and ``metadata`` for Envoy.
    Content-Length must match the new body or Envoy rejects it."""
    response = pb.ProcessingResponse()
    if metadata:
        response.dynamic_metadata.update({METADATA_NAMESPACE: dict(metadata)})
    common = response.request_body.response
    mutation = common.header_mutation
    _add_header(mutation.set_headers, "content-length", b"%d" % len(body))
    for key, value in set_headers:
        _add_header(mutation.set_headers, key, value)
    mutation.remove_headers.extend(remove_headers)
    common.body_mutation.body = body
    return response


def reply(decision: SendToDecode | LocalReply) -> pb.ProcessingResponse:
    """The pipeline's decision as Envoy's reply to the request's body (or headers) message."""
    if isinstance(decision, SendToDecode):
        return replace_body(decision.body, decision.set_headers, decision.remove_headers, decision.metadata)
    return immediate(decision.status, decision.body, decision.details, decision.headers, decision.content_type)


def immediate(status: int, body: bytes, details: str, extra_headers: Sequence[tuple[str, bytes]] = (),
              content_type: bytes = JSON) -> pb.ProcessingResponse:
    """A local reply from Envoy to the client; the request goes no further."""
    response = pb.ProcessingResponse()
    reply = response.immediate_response
    reply.status.code = envoy_status(status)
    _add_header(reply.headers.set_headers, "content-type", content_type)
    for key, value in extra_headers:
        _add_header(reply.headers.set_headers, key, value)
    reply.body = body
    reply.details = details
    return response


def envoy_status(status: int) -> int:
    """Envoy accepts only the statuses its enum defines; others keep their class (4xx->400, else 502)."""
    if status in _DEFINED_STATUSES:
        return status
    return 400 if 400 <= status <= 499 else 502


def error_reply(code: Code, status: int, param: str | None = None,
                extra_headers: Sequence[tuple[str, bytes]] = ()) -> pb.ProcessingResponse:
    # details become %RESPONSE_CODE_DETAILS%; the "pd_" prefix keeps Envoy's local_reply_config
    # mappers (which shape Envoy's own errors) away from our replies.
    return immediate(status, error_body(code, param), "pd_" + code.value, extra_headers)


_DEFINED_STATUSES = frozenset(number for name, number in http_status_pb2.StatusCode.items() if number >= 200)
