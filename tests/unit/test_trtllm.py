"""The trtllm adapter as pure functions: the context-only request, the params check, the generation
request, and the answer for a request the context phase already finished."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from extproc.adapters import adapter_flow, build_adapter
from extproc.adapters.base import AnswerDirectly, DecodeWith, Flow, PrefillReply
from extproc.adapters.trtllm import DISAGG_ID_LIMIT, DISAGG_ID_MIN, PROTOCOL_1_3, TrtllmAdapter, disagg_request_id
from extproc.errors import Code, PdError
from extproc.openai_request import parse_client_request
from extproc.prefill_target import parse_prefill_target

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


def request(path: str, body: dict[str, Any] | bytes) -> Any:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    return parse_client_request(path, "application/json", raw, 1 << 20)


def context_body(body: dict[str, Any], path: str = "/v1/chat/completions", nonce: int = 5) -> Any:
    return json.loads(TrtllmAdapter().plan(request(path, body), TARGET, nonce, None).prefill_body)


def decide(body: dict[str, Any] | bytes, context: dict[str, Any] | bytes, path: str = "/v1/completions") -> Any:
    raw = context if isinstance(context, bytes) else json.dumps(context).encode()
    return TrtllmAdapter().decide(request(path, body), PrefillReply(200, "application/json", raw))


def test_context_request_is_context_only_one_token_and_not_streamed() -> None:
    body = context_body({**CHAT, "stream": True, "stream_options": {"include_usage": True}, "min_tokens": 3})
    assert body == {**CHAT, "max_tokens": 1, "stream": False, "min_tokens": 3,
                    "disaggregated_params": {"request_type": "context_only", "disagg_request_id": DISAGG_ID_MIN + 5}}


def test_context_request_sets_max_completion_tokens_only_when_present() -> None:
    body = context_body({"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 40})
    assert body["max_completion_tokens"] == 1 and body["max_tokens"] == 1
    assert "max_completion_tokens" not in context_body({"prompt": "p"}, "/v1/completions")


@given(st.integers(min_value=0, max_value=(1 << 63) - 1))
def test_disagg_request_ids_are_global_ids(nonce: int) -> None:
    assert DISAGG_ID_MIN <= disagg_request_id(nonce) < DISAGG_ID_LIMIT


def test_client_supplied_disaggregated_params_are_refused_and_null_is_tolerated() -> None:
    with pytest.raises(PdError) as caught:
        context_body({**CHAT, "disaggregated_params": {"request_type": "generation_only"}})
    assert caught.value.code is Code.INVALID_REQUEST_FIELD and caught.value.param == "disaggregated_params"
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
                               PrefillReply(400, "application/json", b'{"object":"error"}'))
    assert caught.value.code is Code.PREFILL_UPSTREAM_ERROR and caught.value.status == 400


def test_registry() -> None:
    assert adapter_flow("trtllm") is Flow.SEQUENTIAL
    adapter = build_adapter("trtllm", "")
    assert isinstance(adapter, TrtllmAdapter) and adapter.protocol == PROTOCOL_1_3
