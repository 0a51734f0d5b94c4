"""The trtllm adapter as pure functions: the context-only request, the params check, the generation
request and its signature, and the answer for a request the context phase already finished."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from extproc.adapters import adapter_flow, build_adapter
from extproc.adapters.base import AnswerDirectly, DecodeWith, Flow, PlanInput
from extproc.adapters.trtllm import (
    AUTH_HEADER,
    DISAGG_ID_LIMIT,
    DISAGG_ID_MIN,
    PROTOCOL_RC23,
    PROTOCOL_RC24,
    TrtllmAdapter,
    disagg_request_id,
    needs_signature,
    signature,
)
from extproc.config import ConfigError, load_settings
from extproc.protocol.errors import Code, PdError
from extproc.protocol.fields import refuse_reserved
from extproc.protocol.prefill_target import parse_prefill_target
from extproc.protocol.settings_spec import SecretFileError
from extproc.protocol.transport import WorkerReply
from tests.helpers import client_request

TARGET = parse_prefill_target(["10.0.0.7:8000"])
CHAT = {"model": "m", "messages": [{"role": "user", "content": "x"}], "max_tokens": 9}
PARAMS = {"request_type": "context_only", "first_gen_tokens": [791], "ctx_request_id": 77,
          "encoded_opaque_state": "AAEC", "draft_tokens": None, "disagg_request_id": 1099511627800,
          "ctx_dp_rank": 0, "ctx_info_endpoint": "tcp://10.0.0.7:5555", "schedule_style": None}
# A context worker's answer in the pinned shape (trtllm-serve CompletionResponse, context_only).
CONTEXT = {"id": "cmpl-00000000000000000000000000000001", "object": "text_completion", "created": 1796000000,
           "model": "m", "choices": [{"index": 0, "text": " the", "token_ids": None, "logprobs": None,
                                      "context_logits": None, "finish_reason": "length", "stop_reason": None,
                                      "disaggregated_params": PARAMS, "avg_decoded_tokens_per_iter": None}],
           "usage": {"prompt_tokens": 3, "total_tokens": 4, "completion_tokens": 1, "prompt_tokens_details": None},
           "prompt_token_ids": [101, 102, 103]}


request = client_request


def context_body(body: dict[str, Any], path: str = "/v1/chat/completions", nonce: int = 5) -> Any:
    return json.loads(TrtllmAdapter().prefill_body(request(path, body), PlanInput(TARGET, nonce)))


def decide(body: dict[str, Any] | bytes, context: dict[str, Any] | bytes, path: str = "/v1/completions",
           adapter: TrtllmAdapter | None = None) -> Any:
    raw = context if isinstance(context, bytes) else json.dumps(context).encode()
    return (adapter or TrtllmAdapter()).decide(request(path, body), WorkerReply(200, "application/json", raw))


def test_context_request_is_context_only_one_token_and_not_streamed() -> None:
    body = context_body({**CHAT, "stream": True, "stream_options": {"include_usage": True}, "min_tokens": 3})
    assert body == {**CHAT, "max_tokens": 1, "stream": False, "min_tokens": 3,
                    "disaggregated_params": {"request_type": "context_only", "disagg_request_id": DISAGG_ID_MIN + 5}}


MESSAGES = [{"role": "user", "content": "x"}]


@pytest.mark.parametrize("path,body,expected", [
    # ChatCompletionRequest.max_completion_tokens has validation_alias max_tokens: one name or the other.
    ("/v1/chat/completions", {"messages": MESSAGES, "max_completion_tokens": 40}, {"max_completion_tokens": 1}),
    ("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 40}, {"max_tokens": 1}),
    ("/v1/chat/completions", {"messages": MESSAGES}, {"max_tokens": 1}),
    ("/v1/completions", {"prompt": "p", "max_tokens": 40}, {"max_tokens": 1}),
    ("/v1/completions", {"prompt": "p"}, {"max_tokens": 1}),
    # Both names: the models refuse the client's own body, so the context worker refuses ours too.
    ("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 3, "max_completion_tokens": 4},
     {"max_tokens": 1, "max_completion_tokens": 1}),
], ids=["chat-max_completion_tokens", "chat-max_tokens", "chat-neither", "completions-max_tokens",
        "completions-neither", "chat-both"])
def test_context_request_carries_exactly_the_token_limit_key_the_client_used(
        path: str, body: dict[str, Any], expected: dict[str, int]) -> None:
    context = context_body(body, path)
    assert {key: context[key] for key in ("max_tokens", "max_completion_tokens") if key in context} == expected


def test_generation_request_keeps_the_clients_own_token_limit() -> None:
    body = {**CHAT, "max_tokens": None, "max_completion_tokens": 30}
    del body["max_tokens"]
    generation = json.loads(decide(body, {**CONTEXT, "object": "chat.completion"}, "/v1/chat/completions").body)
    assert generation["max_completion_tokens"] == 30 and "max_tokens" not in generation


@given(st.integers(min_value=0, max_value=(1 << 63) - 1))
def test_disagg_request_ids_are_global_ids(nonce: int) -> None:
    assert DISAGG_ID_MIN <= disagg_request_id(nonce) < DISAGG_ID_LIMIT


def test_client_supplied_disaggregated_params_are_refused_and_null_is_tolerated() -> None:
    with pytest.raises(PdError) as caught:
        refuse_reserved({**CHAT, "disaggregated_params": {"request_type": "generation_only"}},
                        TrtllmAdapter.reserved_fields)
    assert caught.value.code is Code.RESERVED_REQUEST_FIELD and caught.value.param == "disaggregated_params"
    refuse_reserved({**CHAT, "disaggregated_params": None}, TrtllmAdapter.reserved_fields)
    body = context_body({**CHAT, "disaggregated_params": None})
    assert body["disaggregated_params"]["request_type"] == "context_only"


def test_completions_generation_request_carries_the_params_verbatim_and_the_prompt_token_ids() -> None:
    raw = b'{"prompt": "The KV",  "max_tokens": 7, "seed": 123456789012345678901234567890, "stream": true}'
    context = json.dumps(CONTEXT).encode().replace(b'"draft_tokens": null', b'"draft_tokens": null, "x": 1.50')
    decision = decide(raw, context)
    assert isinstance(decision, DecodeWith)
    assert decision.body.startswith(b'{"prompt":[101, 102, 103],"max_tokens": 7,'
                                    b'"seed": 123456789012345678901234567890,"stream": true,'
                                    b'"disaggregated_params":{"request_type":"generation_only",')
    assert b'"x": 1.50,' in decision.body  # the context's own bytes: 1.50 stays 1.50
    assert json.loads(decision.body)["disaggregated_params"] == {**PARAMS, "x": 1.5, "request_type": "generation_only"}


def test_chat_generation_request_keeps_the_messages_and_adds_prompt_token_ids() -> None:
    decision = decide({**CHAT, "stream": True}, {**CONTEXT, "object": "chat.completion"}, "/v1/chat/completions")
    body = json.loads(decision.body)
    assert body == {**CHAT, "stream": True, "prompt_token_ids": [101, 102, 103],
                    "disaggregated_params": {**PARAMS, "request_type": "generation_only"}}


def test_unknown_params_of_newer_builds_are_forwarded() -> None:
    params = {**PARAMS, "ctx_usage": {"prompt_tokens": 3}, "first_gen_log_probs": None}
    context = {**CONTEXT, "choices": [{**CONTEXT["choices"][0], "disaggregated_params": params}]}
    assert json.loads(decide({"prompt": "p"}, context).body)["disaggregated_params"]["ctx_usage"] == {
        "prompt_tokens": 3}


def with_params(**changes: Any) -> dict[str, Any]:
    params = {key: value for key, value in {**PARAMS, **changes}.items() if value != "REMOVE"}
    return {**CONTEXT, "choices": [{**CONTEXT["choices"][0], "disaggregated_params": params}]}


@pytest.mark.parametrize("context,param", [
    ({**CONTEXT, "choices": [{**CONTEXT["choices"][0], "disaggregated_params": None}]},
     "disaggregated_params is missing"),
    ({**CONTEXT, "choices": [{**CONTEXT["choices"][0], "disaggregated_params": [1]}]},
     "disaggregated_params is not an object"),
    (with_params(request_type="generation_only"), "disaggregated_params.request_type is invalid"),
    (with_params(request_type="REMOVE"), "disaggregated_params.request_type is missing"),
    (with_params(ctx_request_id="REMOVE"), "disaggregated_params.ctx_request_id is missing"),
    (with_params(ctx_request_id=None), "disaggregated_params.ctx_request_id is missing"),
    (with_params(ctx_request_id="77"), "disaggregated_params.ctx_request_id is invalid"),
    (with_params(ctx_request_id=77.0), "disaggregated_params.ctx_request_id is invalid"),
    (with_params(ctx_request_id=True), "disaggregated_params.ctx_request_id is invalid"),
    (with_params(ctx_request_id=-1), "disaggregated_params.ctx_request_id is invalid"),
    (with_params(disagg_request_id=None), "disaggregated_params.disagg_request_id is missing"),
    (with_params(first_gen_tokens=[]), "disaggregated_params.first_gen_tokens is invalid"),
    (with_params(first_gen_tokens=["a"]), "disaggregated_params.first_gen_tokens is invalid"),
    (with_params(first_gen_tokens="REMOVE"), "disaggregated_params.first_gen_tokens is missing"),
    (with_params(encoded_opaque_state="not base64!"), "disaggregated_params.encoded_opaque_state is invalid"),
    (with_params(encoded_opaque_state=5), "disaggregated_params.encoded_opaque_state is invalid"),
    (with_params(draft_tokens=[1.5]), "disaggregated_params.draft_tokens is invalid"),
    (with_params(ctx_dp_rank=-2), "disaggregated_params.ctx_dp_rank is invalid"),
    (with_params(ctx_info_endpoint=""), "disaggregated_params.ctx_info_endpoint is invalid"),
    (with_params(schedule_style=2), "disaggregated_params.schedule_style is invalid"),
    ({key: value for key, value in CONTEXT.items() if key != "prompt_token_ids"}, "prompt_token_ids is missing"),
    ({**CONTEXT, "prompt_token_ids": []}, "prompt_token_ids is invalid"),
    ({**CONTEXT, "prompt_token_ids": [[1], [2]]}, "prompt_token_ids is invalid"),
    ({**CONTEXT, "choices": [CONTEXT["choices"][0], CONTEXT["choices"][0]]}, "choices is invalid"),
    ({**CONTEXT, "choices": []}, "choices is invalid"),
])
def test_invalid_context_answers_never_reach_the_generation_worker(context: dict[str, Any], param: str) -> None:
    with pytest.raises(PdError) as caught:
        decide({"prompt": "p"}, context)
    assert caught.value.code is Code.INVALID_PREFILL_HANDOFF and caught.value.param == param


def test_optional_params_may_be_null_and_a_batch_of_one_prompt_is_accepted() -> None:
    context = {**with_params(encoded_opaque_state=None, ctx_dp_rank=None, ctx_info_endpoint=None, schedule_style=1),
               "prompt_token_ids": [[5, 6]]}
    assert json.loads(decide({"prompt": "p"}, context).body)["prompt"] == [[5, 6]]


def test_duplicate_param_keys_are_refused() -> None:
    raw = json.dumps(CONTEXT).encode().replace(b'"ctx_request_id": 77', b'"ctx_request_id": 77, "ctx_request_id": 78')
    with pytest.raises(PdError) as caught:
        decide({"prompt": "p"}, raw)
    assert caught.value.param == "disaggregated_params has a duplicate field"


def test_not_finished_context_still_needs_generation() -> None:
    context = {**CONTEXT, "choices": [{**CONTEXT["choices"][0], "finish_reason": "not_finished"}]}
    assert isinstance(decide({"prompt": "p"}, context), DecodeWith)


EOS = {**CONTEXT, "choices": [{**CONTEXT["choices"][0], "text": "", "finish_reason": "stop",
                               "disaggregated_params": {**PARAMS, "first_gen_tokens": [2]}}]}


def test_a_request_finished_by_its_first_token_is_answered_from_the_context_worker() -> None:
    decision = decide({"prompt": "p", "max_tokens": 20}, EOS)
    assert isinstance(decision, AnswerDirectly) and decision.status == 200
    assert decision.content_type == "application/json"
    answer = json.loads(decision.body)
    expected_choice = {k: v for k, v in EOS["choices"][0].items() if k != "disaggregated_params"}
    assert answer == {**EOS, "choices": [expected_choice]}


def test_a_finished_context_needs_no_valid_params() -> None:
    context = {**EOS, "choices": [{**EOS["choices"][0], "disaggregated_params": None}]}
    assert isinstance(decide({"prompt": "p"}, context), AnswerDirectly)


@pytest.mark.parametrize("path,usage", [("/v1/completions", False), ("/v1/chat/completions", True)])
def test_a_streaming_client_gets_a_complete_event_stream(path: str, usage: bool) -> None:
    chat = path.endswith("chat/completions")
    context = EOS if not chat else {**EOS, "object": "chat.completion", "choices": [{
        "index": 0, "message": {"role": "assistant", "content": ""}, "finish_reason": "stop",
        "stop_reason": None, "disaggregated_params": PARAMS}]}
    body: dict[str, Any] = {**CHAT, "stream": True} if chat else {"prompt": "p", "stream": True}
    if usage:
        body["stream_options"] = {"include_usage": True}
    decision = decide(body, context, path)
    assert isinstance(decision, AnswerDirectly) and decision.content_type == "text/event-stream"
    events = decision.body.split(b"\n\n")
    assert events[-2:] == [b"data: [DONE]", b""]
    chunks = [json.loads(event[len(b"data: "):]) for event in events[:-2]]
    assert chunks[0]["object"] == ("chat.completion.chunk" if chat else "text_completion")
    assert chunks[0]["choices"][0]["finish_reason"] == "stop"
    assert ("delta" in chunks[0]["choices"][0]) is chat
    assert len(chunks) == (2 if usage else 1)
    if usage:
        assert chunks[1]["choices"] == [] and chunks[1]["usage"]["completion_tokens"] == 1


def test_context_errors_are_the_prefill_legs_errors() -> None:
    with pytest.raises(PdError) as caught:
        TrtllmAdapter().decide(request("/v1/completions", {"prompt": "p"}),
                               WorkerReply(400, "application/json", b'{"object":"error"}'))
    assert caught.value.code is Code.PREFILL_UPSTREAM_ERROR and caught.value.status == 400


# --- the generation request's signature (disagg_auth.py, PR #16002) ---------------------------------

# Vectors computed with the algorithm of TensorRT-LLM's tensorrt_llm/serve/disagg_auth.py (PROTOCOL.md §4c):
# key "secret", payload {"ctx_info_endpoint", "encoded_opaque_state"} as sorted compact JSON.
@pytest.mark.parametrize("params,expected", [
    ({"ctx_info_endpoint": None, "encoded_opaque_state": "b3BhcXVl"},
     "sha256=dd0226a7360fb1d422781ed05d4db132774395583e9f79091e0113371cae3257"),
    ({"ctx_info_endpoint": "tcp://10.0.0.1:5000", "encoded_opaque_state": "b3BhcXVl", "ctx_request_id": 9},
     "sha256=2c855337a244b082618df980f3ca112bdd1d90f76609d813aef90813a9cf64b9"),
    ({"ctx_info_endpoint": ["tcp://10.0.0.1:5000", "tcp://x"], "encoded_opaque_state": "b3BhcXVl"},
     "sha256=2c855337a244b082618df980f3ca112bdd1d90f76609d813aef90813a9cf64b9"),
], ids=["no-endpoint", "endpoint", "endpoint-list"])
def test_signature_is_disagg_auths_hmac_over_the_two_protected_fields(params: dict[str, Any], expected: str) -> None:
    assert signature(b"secret", params) == expected


def test_only_params_with_a_protected_field_need_a_signature() -> None:
    assert needs_signature(PARAMS)
    assert not needs_signature({**PARAMS, "encoded_opaque_state": None, "ctx_info_endpoint": None})


def test_a_signing_adapter_signs_the_generation_request_it_builds() -> None:
    adapter = TrtllmAdapter(PROTOCOL_RC24, b"k3y")
    decision = decide({"prompt": "p"}, CONTEXT, adapter=adapter)
    sent = json.loads(decision.body)["disaggregated_params"]
    assert decision.headers == ((AUTH_HEADER, signature(b"k3y", sent).encode()),)
    assert TrtllmAdapter.reserved_headers == frozenset({AUTH_HEADER})


def test_an_unsigned_pin_adds_no_header_and_takes_no_key() -> None:
    assert decide({"prompt": "p"}, CONTEXT, adapter=TrtllmAdapter(PROTOCOL_RC23)).headers == ()
    with pytest.raises(ValueError):
        TrtllmAdapter(PROTOCOL_RC24)
    with pytest.raises(ValueError):
        TrtllmAdapter(PROTOCOL_RC23, b"k")


def test_a_signing_pin_refuses_to_start_without_a_key(tmp_path: Any) -> None:
    with pytest.raises(ConfigError, match="PD_EXTPROC_TRTLLM_AUTH_KEY_FILE"):
        load_settings({"PD_EXTPROC_ADAPTER": "trtllm"}, {})
    with pytest.raises(ConfigError, match="does not sign"):
        load_settings({"PD_EXTPROC_ADAPTER": "trtllm", "PD_EXTPROC_PROTOCOL": PROTOCOL_RC23,
                       "PD_EXTPROC_TRTLLM_AUTH_KEY_FILE": __file__}, {})
    empty = tmp_path / "empty.key"
    empty.write_text("\n")
    with pytest.raises(SecretFileError, match="is empty"):
        build_adapter("trtllm", PROTOCOL_RC24, {"trtllm_auth_key_file": str(empty)})


def test_the_key_is_read_from_its_file_and_never_shown(tmp_path: Any) -> None:
    key_file = tmp_path / "auth.key"
    key_file.write_text("s3cr3t-k3y\n")
    settings = load_settings({"PD_EXTPROC_ADAPTER": "trtllm", "PD_EXTPROC_TRTLLM_AUTH_KEY_FILE": str(key_file)}, {})
    assert "s3cr3t" not in json.dumps(settings.describe())
    adapter = build_adapter("trtllm", "", settings.engine_options)
    assert isinstance(adapter, TrtllmAdapter)
    decision = decide({"prompt": "p"}, CONTEXT, adapter=adapter)
    assert decision.headers[0][1] == signature(b"s3cr3t-k3y", PARAMS).encode()


def test_registry() -> None:
    assert adapter_flow("trtllm") is Flow.SEQUENTIAL
    adapter = build_adapter("trtllm", PROTOCOL_RC23, {})
    assert isinstance(adapter, TrtllmAdapter) and adapter.protocol == PROTOCOL_RC23
