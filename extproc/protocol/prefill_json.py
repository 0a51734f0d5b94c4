"""Reading a prefill worker's non-streaming JSON reply: the checks every adapter shares."""

from __future__ import annotations

from typing import Any

import orjson

from extproc.protocol import jsonspan
from extproc.protocol.errors import Code, PdError
from extproc.protocol.relayed_error import relayable_error
from extproc.protocol.transport import WorkerReply

_SSE_PREFIXES = (b"data:", b"event:", b"id:", b"retry:", b":")


def upstream_status_error(status: int, content_type: str | None = None, body: bytes = b"") -> PdError:
    """A non-200 prefill answer. The client's status: 4xx and 5xx keep their exact value (so the class
    is preserved); anything else (1xx, 2xx other than 200, 3xx) is a 502. The engine's own error about
    the request (protocol/relayed_error.py) is relayed."""
    return PdError(Code.PREFILL_UPSTREAM_ERROR, status=status if 400 <= status <= 599 else 502,
                   upstream_status=status, relayed=relayable_error(status, content_type, body))


def parse_prefill_object(reply: WorkerReply) -> tuple[dict[str, Any], list[jsonspan.Member]]:
    """The reply's JSON object and its top-level member spans. Never relays the reply's bytes."""
    parsed = _parse_object(reply)
    try:
        return parsed, jsonspan.unique_members(reply.body)
    except jsonspan.RepeatedKey:
        raise PdError(Code.PREFILL_RESPONSE_NOT_JSON) from None


def parse_prefill_member(reply: WorkerReply, name: str) -> tuple[dict[str, Any], bytes | None]:
    """The reply's JSON object and the raw bytes of its top-level member ``name`` (None if absent): the
    checks of ``parse_prefill_object`` (a repeated key refused the same way), without the spans."""
    parsed = _parse_object(reply)
    try:
        return parsed, jsonspan.unique_value(reply.body, name, parsed)
    except jsonspan.RepeatedKey:
        raise PdError(Code.PREFILL_RESPONSE_NOT_JSON) from None


def _parse_object(reply: WorkerReply) -> dict[str, Any]:
    if reply.status != 200:
        raise upstream_status_error(reply.status, reply.content_type, reply.body)
    media = (reply.content_type or "").split(";", 1)[0].strip().lower()
    if media == "text/event-stream" or reply.body.lstrip().startswith(_SSE_PREFIXES):
        raise PdError(Code.PREFILL_RESPONSE_STREAMED)
    try:
        parsed = orjson.loads(reply.body)
    except orjson.JSONDecodeError as exc:
        if reply.body and exc.msg == "unexpected end of data":
            raise PdError(Code.PREFILL_RESPONSE_TRUNCATED) from None
        raise PdError(Code.PREFILL_RESPONSE_NOT_JSON) from None
    if not isinstance(parsed, dict):
        raise PdError(Code.PREFILL_RESPONSE_NOT_JSON)
    return parsed
