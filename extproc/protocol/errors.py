"""The error taxonomy: one closed table, code -> HTTP status -> fixed message.

Every error a client can see from this service is a row here. Messages are fixed phrases; the
only interpolation is ``{param}``. An error carries structure, not prose: a code, the field it is
about (a name from a fixed list in our own code, never caller input) and, for a field whose value is
wrong, the problem. The OpenAI ``param``, the message and the metric label are all rendered from
that structure. PROTOCOL.md's taxonomy table is checked against ``SPEC`` by a test.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from enum import Enum, StrEnum
from typing import TYPE_CHECKING

import orjson

if TYPE_CHECKING:
    from extproc.protocol.relayed_error import RelayedError


class Code(StrEnum):
    # The client's request (4xx, neither leg ran).
    INVALID_REQUEST_BODY = "invalid_request_body"
    INVALID_REQUEST_FIELD = "invalid_request_field"
    UNSUPPORTED_MEDIA_TYPE = "unsupported_media_type"
    UNSUPPORTED_ENDPOINT = "unsupported_endpoint"
    UNSUPPORTED_PD_VARIANT = "unsupported_pd_variant"
    RESERVED_REQUEST_FIELD = "reserved_request_field"
    UNINSPECTABLE_REQUEST_BODY = "uninspectable_request_body"
    REQUEST_TOO_LARGE = "request_too_large"
    INVALID_PREFILL_TARGET = "invalid_prefill_target"
    PREFILL_TARGET_FORBIDDEN = "prefill_target_forbidden"
    # This service (5xx, neither leg ran).
    PD_ADAPTER_UNAVAILABLE = "pd_adapter_unavailable"
    PD_OVERLOADED = "pd_overloaded"
    PD_SHUTTING_DOWN = "pd_shutting_down"
    INTERNAL_ERROR = "internal_error"
    # The prefill leg (decode never ran).
    PREFILL_UPSTREAM_UNAVAILABLE = "prefill_upstream_unavailable"
    PREFILL_UPSTREAM_TIMEOUT = "prefill_upstream_timeout"
    PREFILL_UPSTREAM_ERROR = "prefill_upstream_error"
    PREFILL_RESPONSE_TOO_LARGE = "prefill_response_too_large"
    PREFILL_RESPONSE_NOT_JSON = "prefill_response_not_json"
    PREFILL_RESPONSE_TRUNCATED = "prefill_response_truncated"
    PREFILL_RESPONSE_STREAMED = "prefill_response_streamed"
    INVALID_PREFILL_HANDOFF = "invalid_prefill_handoff"
    # Envoy's own local replies, shaped by local_reply_config (envoy/bootstrap.py).
    REQUEST_TIMEOUT = "request_timeout"
    PD_EXTPROC_UNAVAILABLE = "pd_extproc_unavailable"
    PD_EXTPROC_TIMEOUT = "pd_extproc_timeout"
    DECODE_UPSTREAM_UNAVAILABLE = "decode_upstream_unavailable"
    DECODE_UPSTREAM_TIMEOUT = "decode_upstream_timeout"
    GATEWAY_ERROR = "gateway_error"


@dataclass(frozen=True, slots=True)
class ErrorSpec:
    status: int
    type: str
    message: str


_REQ = "invalid_request_error"
_SRV = "server_error"
_UP = "upstream_error"

SPEC: Mapping[Code, ErrorSpec] = {
    Code.INVALID_REQUEST_BODY: ErrorSpec(400, _REQ, "The request body must be a JSON object."),
    Code.INVALID_REQUEST_FIELD: ErrorSpec(400, _REQ, "The field {param} has an invalid value or type."),
    Code.UNSUPPORTED_MEDIA_TYPE: ErrorSpec(415, _REQ, "The request content-type must be application/json."),
    Code.UNSUPPORTED_ENDPOINT: ErrorSpec(
        404, _REQ, "Disaggregated serving does not support this endpoint with this engine."
    ),
    Code.UNSUPPORTED_PD_VARIANT: ErrorSpec(
        400, _REQ, "The field {param} selects a request variant that disaggregated serving does not support."
    ),
    Code.RESERVED_REQUEST_FIELD: ErrorSpec(
        400, _REQ, "The field {param} is set by disaggregated serving and must not be supplied by the client."
    ),
    Code.UNINSPECTABLE_REQUEST_BODY: ErrorSpec(
        415, _REQ, "The request cannot be inspected before it reaches the engine ({param}): send it uncompressed, "
        "as UTF-8 JSON, or as a form without fields the engine decodes as JSON."
    ),
    Code.REQUEST_TOO_LARGE: ErrorSpec(413, _REQ, "The request body exceeds the configured size limit."),
    Code.INVALID_PREFILL_TARGET: ErrorSpec(
        400, _REQ, "The x-prefiller-host-port header must hold exactly one host:port value."
    ),
    Code.PREFILL_TARGET_FORBIDDEN: ErrorSpec(
        403, _REQ, "The selected prefill worker is not an allowed prefill target."
    ),
    Code.PD_ADAPTER_UNAVAILABLE: ErrorSpec(
        501, _SRV, "Disaggregated prefill/decode is disabled on this decode worker."
    ),
    Code.PD_OVERLOADED: ErrorSpec(
        503, _SRV, "Too many disaggregated requests are in flight; retry later."
    ),
    Code.PD_SHUTTING_DOWN: ErrorSpec(503, _SRV, "This decode worker is shutting down; retry elsewhere."),
    Code.INTERNAL_ERROR: ErrorSpec(500, _SRV, "Internal error in the prefill/decode processor."),
    Code.PREFILL_UPSTREAM_UNAVAILABLE: ErrorSpec(502, _UP, "The prefill worker could not be reached."),
    Code.PREFILL_UPSTREAM_TIMEOUT: ErrorSpec(504, _UP, "The prefill worker did not answer in time."),
    Code.PREFILL_UPSTREAM_ERROR: ErrorSpec(502, _UP, "The prefill worker rejected the request."),
    Code.PREFILL_RESPONSE_TOO_LARGE: ErrorSpec(
        502, _UP, "The prefill response exceeds the configured size limit."
    ),
    Code.PREFILL_RESPONSE_NOT_JSON: ErrorSpec(502, _UP, "The prefill response is not a JSON object."),
    Code.PREFILL_RESPONSE_TRUNCATED: ErrorSpec(502, _UP, "The prefill response ended before it was complete."),
    Code.PREFILL_RESPONSE_STREAMED: ErrorSpec(
        502, _UP, "The prefill worker answered with a stream instead of one JSON response."
    ),
    Code.INVALID_PREFILL_HANDOFF: ErrorSpec(
        502, _UP, "The prefill worker returned an invalid KV handoff: {param}."
    ),
    Code.REQUEST_TIMEOUT: ErrorSpec(408, _REQ, "The request was not received in time."),
    Code.PD_EXTPROC_UNAVAILABLE: ErrorSpec(503, _SRV, "The prefill/decode processor is unavailable."),
    Code.PD_EXTPROC_TIMEOUT: ErrorSpec(504, _SRV, "The prefill/decode processor did not answer in time."),
    Code.DECODE_UPSTREAM_UNAVAILABLE: ErrorSpec(503, _UP, "The decode worker could not be reached."),
    Code.DECODE_UPSTREAM_TIMEOUT: ErrorSpec(504, _UP, "The decode worker did not answer in time."),
    Code.GATEWAY_ERROR: ErrorSpec(502, _SRV, "The gateway could not complete the request."),
}


class Problem(Enum):
    """What is wrong with a field: the phrase in ``param`` and the word in metric labels."""

    MISSING = ("is missing", "missing")
    INVALID = ("is invalid", "invalid")
    NOT_AN_OBJECT = ("is not an object", "not_an_object")
    DUPLICATE_FIELD = ("has a duplicate field", "has_a_duplicate_field")
    ABORTED = ("is abort", "abort")

    def __init__(self, phrase: str, label: str) -> None:
        self.phrase = phrase
        self.label = label


# Unusable prefill replies: counted as handoff failures (with an invalid handoff) in the metrics.
HANDOFF_CODES = frozenset({
    Code.INVALID_PREFILL_HANDOFF, Code.PREFILL_RESPONSE_NOT_JSON, Code.PREFILL_RESPONSE_TRUNCATED,
    Code.PREFILL_RESPONSE_STREAMED, Code.PREFILL_RESPONSE_TOO_LARGE,
})


# Prefill failures that say nothing about the request itself: with PD_EXTPROC_PREFILL_FALLBACK=aggregated
# the local decode worker serves the request whole instead (a 5xx prefill_upstream_error included).
FALLBACK_CODES = frozenset({Code.PREFILL_UPSTREAM_UNAVAILABLE, Code.PREFILL_UPSTREAM_TIMEOUT,
                            Code.PREFILL_UPSTREAM_ERROR})


class PdError(Exception):
    """An outcome that becomes a JSON error response. The only exception our pure code raises.

    ``field`` must come from a fixed list in our code (``kv_transfer_params.tp_size``); ``problem`` says
    what is wrong with it; ``status`` overrides the table only for ``prefill_upstream_error``, which
    keeps the prefill worker's own status.
    """

    def __init__(self, code: Code, *, field: str | None = None, problem: Problem | None = None,
                 status: int | None = None, upstream_status: int | None = None,
                 relayed: RelayedError | None = None) -> None:
        self.code = code
        self.field = field
        self.problem = problem
        self.status = status if status is not None else SPEC[code].status
        self.upstream_status = upstream_status  # what the prefill worker answered, when it answered
        # prefill_upstream_error only: the engine's own error about the request, relayed as it put it
        self.relayed = relayed
        super().__init__(code.value if self.param is None else f"{code.value}: {self.param}")

    @property
    def param(self) -> str | None:
        """The OpenAI ``param``: the field, and what is wrong with it when that is known."""
        if self.field is None or self.problem is None:
            return self.field
        return f"{self.field} {self.problem.phrase}"

    @property
    def allows_fallback(self) -> bool:
        """A failure of the prefill worker, not of the request: unreachable, too slow, or a 5xx."""
        if self.code is Code.PREFILL_UPSTREAM_ERROR:  # a 3xx is 502 to the client, yet no outage
            return self.upstream_status is not None and 500 <= self.upstream_status <= 599
        return self.code in FALLBACK_CODES

    @property
    def handoff_reason(self) -> str | None:
        """The ``reason`` label of a handoff failure (``remote_port_invalid``), None for other errors."""
        if self.code not in HANDOFF_CODES:
            return None
        if self.field is None or self.problem is None:
            return self.code.value
        return f"{self.field.rsplit('.', 1)[-1]}_{self.problem.label}"


def error_body(code: Code, param: str | None = None) -> bytes:
    """The OpenAI error envelope for a code, as JSON bytes."""
    spec = SPEC[code]
    message = spec.message.format(param=param) if "{param}" in spec.message else spec.message
    return orjson.dumps(
        {"error": {"message": message, "type": spec.type, "param": param, "code": code.value}}
    )
