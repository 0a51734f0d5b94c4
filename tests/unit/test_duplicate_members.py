"""Every member an adapter or the client parser reads is read from an object that names it once: a
second copy of any field it reads is refused with the documented error and the decode leg never runs
(PROTOCOL.md §3, §4.2, §4b.3, §4c.2). Found in review: TensorRT-LLM forwarded the first copy of a
choice's ``disaggregated_params`` while checking the last."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from typing import Any

import pytest

from extproc.adapters.sglang import SglangAdapter
from extproc.adapters.trtllm import RULES as TRTLLM_RULES
from extproc.adapters.trtllm import TrtllmAdapter
from extproc.adapters.vllm_nixl import PROTOCOL_0_33, RULES, VllmNixlAdapter
from extproc.pipeline.processor import Pending
from extproc.protocol.errors import PdError
from extproc.protocol.transport import WorkerReply
from tests.unit.test_processor import (
    CHAT_BODY,
    DECODE,
    HANDOFF,
    background_failures,
    decode_answers_once_aborted,
    error_code,
    head,
    rig,
    start_background,
)
from tests.unit.test_trtllm import CONTEXT, PARAMS
from tests.unit.test_vllm_nixl import HANDOFF as FULL_HANDOFF


@dataclass(frozen=True)
class Twice:
    """An object whose member ``key`` is written a second time, with ``second``, after all the others."""

    members: dict[str, Any]
    key: str
    second: Any


def encode(value: Any) -> str:
    if isinstance(value, Twice):
        pairs = [*value.members.items(), (value.key, value.second)]
        return "{" + ", ".join(f"{json.dumps(k)}: {encode(v)}" for k, v in pairs) + "}"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{json.dumps(k)}: {encode(v)}" for k, v in value.items()) + "}"
    if isinstance(value, list):
        return "[" + ", ".join(encode(v) for v in value) + "]"
    return json.dumps(value)


def reply(value: Any) -> WorkerReply:
    return WorkerReply(200, "application/json", encode(value).encode())


def run_sequential(adapter: Any, prefill_reply: WorkerReply) -> tuple[str, Any]:
    """One request through the processor: the client's error code, and the rig (what each leg got)."""
    async def run() -> tuple[str, Any]:
        r = rig(adapter)
        r.transport.answers.append(prefill_reply)
        request_head = head()
        pending = await r.processor.on_headers(request_head)
        assert isinstance(pending, Pending)
        outcome = await r.processor.on_body(request_head, pending, json.dumps(CHAT_BODY).encode())
        return error_code(outcome.decision), r

    return asyncio.run(run())


def assert_refused_before_decode(r: Any) -> None:
    (call,) = r.transport.calls  # the prefill leg only: no decode body went back to Envoy
    assert call.target != DECODE and r.admission.inflight == 0


# --- vllm_nixl: kv_transfer_params, and each of its fields -----------------------------------------


VLLM_HANDOFF = {**FULL_HANDOFF, "remote_registration_generation": 0}


def test_vllm_a_second_kv_transfer_params_is_refused() -> None:
    evil = {**VLLM_HANDOFF, "remote_host": "evil"}
    code, r = run_sequential(VllmNixlAdapter(PROTOCOL_0_33), reply(
        Twice({"id": "x", "kv_transfer_params": VLLM_HANDOFF}, "kv_transfer_params", evil)))
    assert code == "prefill_response_not_json"
    assert_refused_before_decode(r)


@pytest.mark.parametrize("field", list(RULES[PROTOCOL_0_33].rules))
def test_vllm_a_second_copy_of_any_handoff_field_is_refused(field: str) -> None:
    """The same value twice included: the forwarded bytes hold both, and decode's parser picks one."""
    code, r = run_sequential(VllmNixlAdapter(PROTOCOL_0_33), reply(
        {"id": "x", "kv_transfer_params": Twice(VLLM_HANDOFF, field, VLLM_HANDOFF[field])}))
    assert code == "invalid_prefill_handoff"
    assert_refused_before_decode(r)
    assert r.outcomes() == {"invalid_prefill_handoff": 1.0}


def test_vllm_the_refusal_names_the_object() -> None:
    with pytest.raises(PdError) as caught:
        VllmNixlAdapter().decide(None, reply({"kv_transfer_params": Twice(HANDOFF, "remote_host", "evil")}))  # type: ignore[arg-type]
    assert caught.value.param == "kv_transfer_params has a duplicate field"


# --- trtllm: choices, prompt_token_ids, the choice's finish_reason and params, each params field -----


def trtllm_context(choice: Any = None, params: Any = PARAMS) -> dict[str, Any]:
    return {**CONTEXT, "choices": [choice if choice is not None else {**CONTEXT["choices"][0],
                                                                       "disaggregated_params": params}]}


def test_trtllm_a_second_disaggregated_params_in_the_choice_is_refused() -> None:
    """The review's case: the second copy passes the checks and named another context endpoint."""
    choice = Twice(CONTEXT["choices"][0], "disaggregated_params", {**PARAMS, "ctx_info_endpoint": "evil:1"})
    code, r = run_sequential(TrtllmAdapter(), reply(trtllm_context(choice)))
    assert code == "invalid_prefill_handoff"
    assert_refused_before_decode(r)


@pytest.mark.parametrize("field", ["finish_reason", "disaggregated_params"])
def test_trtllm_a_second_copy_of_a_choice_field_is_refused(field: str) -> None:
    choice = CONTEXT["choices"][0]
    code, r = run_sequential(TrtllmAdapter(), reply(trtllm_context(Twice(choice, field, choice[field]))))
    assert code == "invalid_prefill_handoff"
    assert_refused_before_decode(r)


@pytest.mark.parametrize("field", list(TRTLLM_RULES.rules))
def test_trtllm_a_second_copy_of_any_params_field_is_refused(field: str) -> None:
    code, r = run_sequential(TrtllmAdapter(), reply(trtllm_context(params=Twice(PARAMS, field, PARAMS[field]))))
    assert code == "invalid_prefill_handoff"
    assert_refused_before_decode(r)


@pytest.mark.parametrize("field", ["choices", "prompt_token_ids"])
def test_trtllm_a_second_copy_of_a_top_level_field_is_refused(field: str) -> None:
    code, r = run_sequential(TrtllmAdapter(), reply(Twice(CONTEXT, field, CONTEXT[field])))
    assert code == "prefill_response_not_json"
    assert_refused_before_decode(r)


def test_trtllm_the_refusal_names_the_object() -> None:
    choice = Twice(CONTEXT["choices"][0], "disaggregated_params", {**PARAMS, "ctx_info_endpoint": "evil:1"})
    with pytest.raises(PdError) as caught:
        TrtllmAdapter().decide(None, reply(trtllm_context(choice)))  # type: ignore[arg-type]
    assert caught.value.param == "choices has a duplicate field"


# --- sglang: the drained reply's choices[0].finish_reason, and /server_info's keys ------------------


SGLANG_CHOICE = {"index": 0, "finish_reason": "length"}


@pytest.mark.parametrize("answer", [
    {"id": "x", "choices": [Twice(SGLANG_CHOICE, "finish_reason", "abort")]},
    {"id": "x", "choices": [Twice({"index": 0, "finish_reason": "abort"}, "finish_reason", "length")]},
    Twice({"id": "x", "choices": [SGLANG_CHOICE]}, "choices", [SGLANG_CHOICE]),
], ids=["finish_reason-abort-last", "finish_reason-abort-first", "choices"])
def test_sglang_a_second_copy_of_a_read_field_fails_the_prefill_and_aborts_decode(answer: Any) -> None:
    async def run() -> None:
        r = rig(SglangAdapter())
        r.transport.answers.append(reply(answer))
        handle = await start_background(r)
        abort_ends_decode = decode_answers_once_aborted(r, handle)

        r.transport.answers.append(abort_ends_decode)
        await handle.task
        expected = "prefill_response_not_json" if isinstance(answer, Twice) else "invalid_prefill_handoff"
        assert error_code(await r.processor.on_decode_answer(handle, 500)) == expected
        assert [call.path for call in r.transport.posts_to(DECODE)] == ["/abort_request"]
        assert background_failures(r) == {expected: 1.0} and r.admission.inflight == 0

    asyncio.run(run())


@pytest.mark.parametrize("field", ["disaggregation_mode", "disaggregation_bootstrap_port"])
def test_sglang_server_info_naming_a_key_twice_stops_before_either_leg(field: str) -> None:
    info = {"disaggregation_mode": "prefill", "disaggregation_bootstrap_port": 8998}
    second = {"disaggregation_mode": "decode", "disaggregation_bootstrap_port": 1}[field]

    async def run() -> None:
        r = rig(SglangAdapter(bootstrap_port=None))
        r.transport.answers.append(reply(Twice(info, field, second)))
        request_head = head()
        pending = await r.processor.on_headers(request_head)
        assert isinstance(pending, Pending)
        outcome = await r.processor.on_body(request_head, pending, json.dumps(CHAT_BODY).encode())
        assert outcome.background is None and error_code(outcome.decision) == "prefill_response_not_json"
        assert [call.method for call in r.transport.calls] == ["GET"] and r.admission.inflight == 0

    asyncio.run(run())


# --- the client's request: each field the parser reads ----------------------------------------------


@pytest.mark.parametrize("field,first,second", [
    ("stream", False, True), ("max_tokens", 4, 8), ("max_completion_tokens", 4, 8), ("n", 1, 2),
    ("messages", [{"role": "user", "content": "a"}], [{"role": "user", "content": "b"}]),
])
def test_a_client_field_sent_twice_is_refused_before_any_leg(field: str, first: Any, second: Any) -> None:
    async def run() -> None:
        r = rig(VllmNixlAdapter())
        request_head = head()
        pending = await r.processor.on_headers(request_head)
        assert isinstance(pending, Pending)
        body = encode(Twice({**CHAT_BODY, field: first}, field, second)).encode()
        outcome = await r.processor.on_body(request_head, pending, body)
        assert error_code(outcome.decision) == "invalid_request_body"
        assert r.transport.calls == []

    asyncio.run(run())

