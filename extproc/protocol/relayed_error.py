"""A prefill worker's own error about the client's request, relayed to the client as the engine put it. Pure.

Relayed: a 400, 404, 413 or 422 whose JSON body is one of the engines' error shapes
  nested   {"error": {"message", "type", "param", "code"}}         vLLM: entrypoints/serve/engine/protocol.py
           ErrorResponse/ErrorInfo, built by serve/exception_handling/error_response.py create_error_response
  flat     {"object": "error", "message", "type", "param", "code"}  SGLang: srt/entrypoints/openai/serving_base.py
           create_error_response (ErrorResponse); trtllm-serve: tensorrt_llm/serve/openai_server.py
           create_error_response
  string   {"error": "<text>"}                                      trtllm-serve: openai_server.py
           validation_exception_handler ({"error": str(exc)})
rebuilt in the same shape from its fields only (never the engine's bytes): strings cut to a bound,
control characters removed, ``code`` an integer or a bounded string. Anything else (another status, an
unknown shape, a body too large) is None and the client gets our generic ``prefill_upstream_error``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import Enum

import orjson

RELAYED_STATUSES = frozenset({400, 404, 413, 422})
MAX_BODY_BYTES = 64 << 10  # an error body larger than this is not an engine's error about the request
MAX_MESSAGE_CHARS = 1024
MAX_LOGGED_CHARS = 256
MAX_SHORT_CHARS = 128  # type, param, a string code
# C0 and C1 controls, DEL, and the Unicode line and paragraph separators: never in a relayed string.
_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029]")


class Shape(Enum):
    NESTED = "nested"
    FLAT = "flat"
    STRING = "string"


@dataclass(frozen=True, slots=True)
class RelayedError:
    status: int
    shape: Shape
    message: str
    type: str | None = None
    param: str | None = None
    code: int | str | None = None

    def body(self) -> bytes:
        if self.shape is Shape.STRING:
            return orjson.dumps({"error": self.message})
        fields = {"message": self.message, "type": self.type, "param": self.param, "code": self.code}
        if self.shape is Shape.FLAT:
            return orjson.dumps({"object": "error", **fields})
        return orjson.dumps({"error": fields})

    @property
    def reason(self) -> str:
        """The engine's message, shorter, for our log line."""
        return self.message[:MAX_LOGGED_CHARS]


def _clean(value: object, limit: int) -> str | None:
    if not isinstance(value, str):
        return None
    return _CONTROL.sub("", value)[:limit]


def _code(value: object) -> int | str | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, int) and -(2**53) < value < 2**53:
        return value
    return _clean(value, MAX_SHORT_CHARS)


def _from_object(status: int, shape: Shape, error: dict[str, object]) -> RelayedError | None:
    message = _clean(error.get("message"), MAX_MESSAGE_CHARS)
    if message is None:
        return None
    return RelayedError(status, shape, message, _clean(error.get("type"), MAX_SHORT_CHARS),
                        _clean(error.get("param"), MAX_SHORT_CHARS), _code(error.get("code")))


def relayable_error(status: int, content_type: str | None, body: bytes) -> RelayedError | None:
    """The engine's own error about the request, or None when it is not one we relay."""
    if status not in RELAYED_STATUSES or len(body) > MAX_BODY_BYTES:
        return None
    if (content_type or "").split(";", 1)[0].strip().lower() != "application/json":
        return None
    try:
        parsed = orjson.loads(body)
    except orjson.JSONDecodeError:
        return None
    if not isinstance(parsed, dict):
        return None
    error = parsed.get("error")
    if isinstance(error, dict):
        return _from_object(status, Shape.NESTED, error)
    if isinstance(error, str) and len(parsed) == 1:
        message = _clean(error, MAX_MESSAGE_CHARS)
        return None if message is None else RelayedError(status, Shape.STRING, message)
    if parsed.get("object") == "error":
        return _from_object(status, Shape.FLAT, parsed)
    return None
