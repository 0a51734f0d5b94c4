"""Property-based: the header parser, the request validator and the handoff validator return a valid
result or a documented PdError for any input, never another exception, and never put input into a
message."""

from __future__ import annotations

import json
import string
from typing import Any

from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from extproc.adapters.vllm_nixl import PROTOCOLS, RULES, VllmNixlAdapter, handoff_from_reply, validate_handoff
from extproc.protocol.errors import SPEC, Code, PdError, error_body
from extproc.protocol.fields import refuse_reserved
from extproc.protocol.openai_request import ClientRequest, parse_client_request
from extproc.protocol.prefill_target import parse_prefill_target
from extproc.protocol.transport import WorkerAddress, WorkerReply

MARKER = "zqmarker"
json_leaf = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=12)
json_values = st.recursive(json_leaf, lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=8), c,
                                                                                            max_size=4), max_leaves=15)
REQUEST_CODES = {Code.UNSUPPORTED_ENDPOINT, Code.REQUEST_TOO_LARGE, Code.UNSUPPORTED_MEDIA_TYPE,
                 Code.INVALID_REQUEST_BODY, Code.INVALID_REQUEST_FIELD, Code.UNSUPPORTED_PD_VARIANT,
                 Code.RESERVED_REQUEST_FIELD}
HANDOFF_CODES = {Code.INVALID_PREFILL_HANDOFF, Code.PREFILL_RESPONSE_NOT_JSON, Code.PREFILL_RESPONSE_TRUNCATED,
                 Code.PREFILL_RESPONSE_STREAMED, Code.PREFILL_UPSTREAM_ERROR}


REQUEST_PARAMS = {None, "stream", "max_tokens", "max_completion_tokens", "n", "kv_transfer_params", "messages",
                  "prompt"}
HANDOFF_FIELDS = {name for protocol in PROTOCOLS for name in RULES[protocol].rules}
HANDOFF_PARAMS = {None, "kv_transfer_params is missing", "kv_transfer_params is not an object"} | {
    f"kv_transfer_params.{name} is {state}" for name in HANDOFF_FIELDS for state in ("missing", "invalid")}


def assert_documented(error: PdError, allowed: set[Code], params: set[str | None]) -> None:
    """The error is one of ``allowed`` and its only variable part is a param from a fixed list, so the
    body cannot contain input."""
    assert error.code in allowed
    assert error.param in params
    body = error_body(error.code, error.param).decode()
    assert set(json.loads(body)["error"]) == {"message", "type", "param", "code"}
    assert MARKER not in body


@settings(max_examples=500, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.text(max_size=40), max_size=3))
def test_prefill_header_parser_total(values: list[str]) -> None:
    try:
        target = parse_prefill_target(values)
    except PdError as error:
        assert_documented(error, {Code.INVALID_PREFILL_TARGET}, {None})
        return
    assert isinstance(target, WorkerAddress)
    assert 1 <= target.port <= 65535
    assert len(values) == 1 and "," not in values[0] and "@" not in values[0] and " " not in values[0]


@settings(max_examples=300)
@given(st.text(alphabet="[]:.-a10f%@/ 9z", max_size=24))
def test_prefill_header_parser_on_address_like_text(value: str) -> None:
    try:
        target = parse_prefill_target([value])
    except PdError as error:
        assert error.code is Code.INVALID_PREFILL_TARGET
        return
    assert target.authority.rsplit(":", 1)[1] == value.rsplit(":", 1)[1]


@settings(max_examples=400, suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from(["/v1/chat/completions", "/v1/completions", "/v1/completions?x=1", "/v2/x"]),
       st.sampled_from(["application/json", "application/json; charset=utf-8", "text/plain", None]),
       st.one_of(st.binary(max_size=64), json_values.map(lambda v: json.dumps(v).encode()),
                 st.dictionaries(st.sampled_from(["messages", "prompt", "n", "stream", "max_tokens",
                                                  "kv_transfer_params", "max_completion_tokens", MARKER]),
                                 json_values).map(lambda v: json.dumps(v).encode())))
def test_request_validator_total(path: str, content_type: str | None, raw: bytes) -> None:
    """The request validator and the reserved-field check, as the processor runs them for vLLM."""
    try:
        request = parse_client_request(path, content_type, raw, 1 << 20)
        refuse_reserved(request.body, VllmNixlAdapter.reserved_fields)
    except PdError as error:
        assert_documented(error, REQUEST_CODES, REQUEST_PARAMS)
        return
    assert isinstance(request, ClientRequest)
    assert request.body.get("n") in (None, 1)
    assert request.body.get("kv_transfer_params") in (None, {})


VALID = {"do_remote_prefill": True, "do_remote_decode": False, "remote_block_ids": [[1, 2]],
         "remote_engine_id": "e", "remote_request_id": "r", "remote_host": "h", "remote_port": 5600, "tp_size": 1}


@settings(max_examples=500, suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from(PROTOCOLS),
       st.dictionaries(st.sampled_from([*VALID, "pp_size", "dcp_size", "transfer_mode", "remote_num_tokens",
                                        "remote_blocks_expiry_time", MARKER]), json_values),
       st.booleans())
def test_handoff_validator_total(protocol: str, overrides: dict[str, Any], start_valid: bool) -> None:
    params: Any = {**VALID, **overrides} if start_valid else overrides
    try:
        validate_handoff(params, protocol)
    except PdError as error:
        assert_documented(error, {Code.INVALID_PREFILL_HANDOFF}, HANDOFF_PARAMS - {None})
        return
    assert params["do_remote_prefill"] is True and params["remote_block_ids"]


@settings(max_examples=300, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(100, 599), st.sampled_from([None, "application/json", "text/event-stream"]),
       st.one_of(st.binary(max_size=64), json_values.map(lambda v: json.dumps({"kv_transfer_params": v}).encode())))
def test_prefill_reply_reader_total(status: int, content_type: str | None, body: bytes) -> None:
    assume(MARKER.encode() not in body)
    try:
        raw = handoff_from_reply(WorkerReply(status, content_type, body), PROTOCOLS[0])
    except PdError as error:
        assert_documented(error, HANDOFF_CODES, HANDOFF_PARAMS)
        return
    assert json.loads(raw) == json.loads(body)["kv_transfer_params"]


def test_every_message_is_a_fixed_phrase_with_at_most_a_param() -> None:
    for code, spec in SPEC.items():
        fields = {name for _, name, _, _ in string.Formatter().parse(spec.message) if name is not None}
        assert fields <= {"param"}, code
        body = json.loads(error_body(code, "field"))
        assert body["error"]["code"] == code.value
        assert body["error"]["type"] == spec.type
