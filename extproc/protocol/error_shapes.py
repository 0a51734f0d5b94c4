"""Errors in the shape of the client's API. Pure.

Every API we serve P/D answers errors in OpenAI's envelope (protocol/errors.py error_body) except the Anthropic
Messages API, whose clients read ``{"type": "error", "error": {"type", "message"}}`` (vLLM
anthropic/protocol.py AnthropicErrorResponse, built by anthropic/api_router.py translate_error_response).
The message is the same fixed phrase; the Anthropic ``type`` follows the status as Anthropic's API
documents its error types.
"""

from __future__ import annotations

import orjson

from extproc.protocol.errors import SPEC, Code, error_body
from extproc.protocol.relayed_error import RelayedError

_ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                    404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error",
                    503: "overloaded_error", 504: "timeout_error"}


def anthropic_type(status: int) -> str:
    if status in _ANTHROPIC_TYPES:
        return _ANTHROPIC_TYPES[status]
    return "invalid_request_error" if 400 <= status <= 499 else "api_error"


def anthropic_body(error_type: str, message: str) -> bytes:
    return orjson.dumps({"type": "error", "error": {"type": error_type, "message": message}})


def our_error_body(code: Code, status: int, param: str | None, anthropic: bool) -> bytes:
    """Our own error: OpenAI's envelope, or Anthropic's with the same message."""
    if not anthropic:
        return error_body(code, param)
    spec = SPEC[code]
    message = spec.message.format(param=param) if "{param}" in spec.message else spec.message
    return anthropic_body(anthropic_type(status), message)


def relayed_body(relayed: RelayedError, anthropic: bool) -> bytes:
    """The prefill engine's own error about the request: in its shape, or for a Messages client in
    Anthropic's (vLLM already answers /v1/messages so; its ``type`` is kept when it has one)."""
    if not anthropic:
        return relayed.body()
    return anthropic_body(relayed.type or anthropic_type(relayed.status), relayed.message)
