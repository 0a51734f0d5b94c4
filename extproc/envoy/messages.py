"""Conversions between Envoy ext_proc protobuf messages and our plain values (the request's head in, the
pipeline's decisions out). Pure; with stream.py and gateway.py the only code that builds or reads them.

Envoy sends header values in ``raw_value`` (bytes) and ignores ``value`` on mutations, so both
directions use ``raw_value`` only.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeAlias

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


_ONE_BYTE = [bytes((value,)) for value in range(0x80)]


def _varint(value: int) -> bytes:
    if value < 0x80:
        return _ONE_BYTE[value]
    out = bytearray()
    while value > 0x7F:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _field(tag: bytes, length: int) -> bytes:
    """A length-delimited field's tag and length; its ``length`` bytes follow."""
    return tag + _varint(length)


# Field tags (field number << 3 | wire type) on the way to the body, from
# envoy/service/ext_proc/v3/external_processor.proto and envoy/config/core/v3/base.proto:
# ProcessingResponse.request_body = 3, BodyResponse.response = 1, CommonResponse.header_mutation = 2 and
# .body_mutation = 3, BodyMutation.body = 1; HeaderMutation.set_headers = 1 and .remove_headers = 2;
# HeaderValueOption.header = 1 and .append_action = 3; HeaderValue.key = 1 and .raw_value = 3.
_REQUEST_BODY = _BODY_MUTATION = _RAW_VALUE = b"\x1a"
_RESPONSE = _BODY = _SET_HEADER = _OPTION_HEADER = _HEADER_KEY = b"\x0a"
_HEADER_MUTATION = _REMOVE_HEADER = b"\x12"
_APPEND_OVERWRITE = b"\x18" + _varint(_OVERWRITE)


def _set_header(key: str, value: bytes) -> bytes:
    """One HeaderValueOption of ``_add_header`` (proto3: an empty raw_value is not written)."""
    name = key.encode()
    header = _field(_HEADER_KEY, len(name)) + name + (_field(_RAW_VALUE, len(value)) + value if value else b"")
    option = _field(_OPTION_HEADER, len(header)) + header + _APPEND_OVERWRITE
    return _field(_SET_HEADER, len(option)) + option


@functools.lru_cache(maxsize=64)
def _removals(names: tuple[str, ...]) -> bytes:
    """The remove_headers fields: the same few lists on every request (one per adapter and override)."""
    return b"".join([_field(_REMOVE_HEADER, len(encoded)) + encoded for encoded in map(str.encode, names)])


@dataclass(frozen=True, slots=True)
class EncodedResponse:
    """A ProcessingResponse already in its wire form, in pieces (the body one of them, never copied into
    a whole): the server sends ``parts`` as they are (``wire_parts``)."""

    parts: tuple[bytes, ...]

    @property
    def wire(self) -> bytes:
        return b"".join(self.parts)

    def SerializeToString(self) -> bytes:  # protobuf's name: the benches call it
        return self.wire

    def message(self) -> pb.ProcessingResponse:
        return pb.ProcessingResponse.FromString(self.wire)


Response: TypeAlias = pb.ProcessingResponse | EncodedResponse


def wire_parts(response: Response) -> tuple[bytes, ...]:
    """A response's wire form, in the pieces the server sends one after another."""
    if isinstance(response, EncodedResponse):
        return response.parts
    wire: bytes = response.SerializeToString()
    return (wire,)


def encode_body_reply(body: bytes, set_headers: Sequence[tuple[str, bytes]] = (),
                      remove_headers: Sequence[str] = (),
                      metadata: Mapping[str, str] | None = None) -> EncodedResponse:
    """A body reply, byte for byte as protobuf writes it (tests/unit/test_reply_bytes.py), with
    the body never copied: protobuf copies it into the message and again into the wire, and on this VM
    its writer costs about 1.6 ms a MiB (docs/decisions.md); the server writes the pieces as they are."""
    headers = b"".join([_set_header("content-length", b"%d" % len(body)),
                        *[_set_header(key, value) for key, value in set_headers], _removals(tuple(remove_headers))])
    body_field = _field(_BODY, len(body))
    mutation_field = _field(_BODY_MUTATION, len(body_field) + len(body))
    headers_field = _field(_HEADER_MUTATION, len(headers))
    common_length = len(headers_field) + len(headers) + len(mutation_field) + len(body_field) + len(body)
    common_field = _field(_RESPONSE, common_length)
    tail = b""
    if metadata:
        tail = pb.ProcessingResponse(dynamic_metadata={METADATA_NAMESPACE: dict(metadata)}).SerializeToString()
    head = b"".join((_field(_REQUEST_BODY, len(common_field) + common_length), common_field, headers_field, headers,
                     mutation_field, body_field))
    return EncodedResponse((head, body, tail) if tail else (head, body))


def reply(decision: SendToDecode | LocalReply) -> Response:
    """The pipeline's decision as Envoy's reply to the request's body (or headers) message: decode's body
    with its request headers set or removed and ``metadata`` for Envoy (content-length set to the new
    body's, or Envoy rejects it), or a local reply."""
    if isinstance(decision, SendToDecode):
        return encode_body_reply(decision.body, decision.set_headers, decision.remove_headers, decision.metadata)
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
