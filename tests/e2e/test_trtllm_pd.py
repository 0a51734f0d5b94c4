"""TensorRT-LLM disaggregated serving through a real Envoy, our server and emulated trtllm-serve
context and generation workers.

Mirrors the reference native-serving test: a non-empty multi-token completion served by distinct
context and generation workers (each reports its worker id; both roles must have taken part),
streaming and non-streaming; then the failure cases: context worker down, bad metadata (refused by
us, or by the generation worker when it is well-formed but not what the context issued), a client
that goes away, and a request whose first token already finished it.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from extproc.adapters.trtllm import AUTH_HEADER, PROTOCOL_RC23
from pd_extproc_lab.emulator import text
from tests.harness import Stack, WorkerSpec, engine_workers, running_stack
from tests.helpers import (
    CHAT,
    COMPLETIONS,
    assert_distinct_workers,
    assert_error,
    assert_event_stream,
    assert_no_leg_ran,
    assert_served_by_decode,
    both_endpoints,
    chat_body,
    completion_body,
    only,
    post,
    sse_events,
    stream,
)

pytestmark = pytest.mark.dataplane



def workers(key_file: str | None) -> tuple[WorkerSpec, ...]:
    return engine_workers("trtllm", ("--auth-key-file", key_file) if key_file else ())


def key_file(directory: Path, name: str, key: str) -> str:
    path = directory / name
    path.write_text(key + "\n")
    return str(path)


@pytest.fixture(scope="module")
def keys(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    directory = tmp_path_factory.mktemp("trtllm-keys")
    return {"workers": key_file(directory, "workers.key", "the-shared-internal-key"),
            "other": key_file(directory, "other.key", "not-the-workers-key")}


@pytest.fixture(scope="module")
def trtllm_stack(keys: dict[str, str]) -> Iterator[Stack]:
    """The default (signing) pin, our server and both workers holding the same internal key."""
    with running_stack({"PD_EXTPROC_ADAPTER": "trtllm", "PD_EXTPROC_TRTLLM_AUTH_KEY_FILE": keys["workers"]},
                       workers(keys["workers"])) as stack:
        yield stack


@pytest.fixture
def trt(trtllm_stack: Stack) -> Stack:
    return trtllm_stack.reset()


def prompt_of(path: str, body: dict[str, Any]) -> str:
    return text.chat_prompt(body["messages"]) if path == CHAT else text.completion_prompt(body["prompt"])



def assert_both_roles_took_part(stack: Stack) -> tuple[dict[str, Any], dict[str, Any]]:
    context, generation = only(stack.prefill.requests()), only(stack.decode.requests())
    assert dict(generation["headers"])[AUTH_HEADER].startswith("sha256="), "a signed generation request"
    issued = context["notes"]["disaggregated_params"]
    assert generation["json"]["disaggregated_params"] == {**issued, "request_type": "generation_only"}
    assert generation["notes"]["kv"] == "ok" and generation["notes"]["context_worker"] == "prefill"
    assert_distinct_workers(stack, "trtllm")
    return context, generation


# --- the reference matrix ----------------------------------------------------------------------------


@both_endpoints(max_tokens=6)
def test_non_streaming_completion_is_served_by_distinct_context_and_generation_workers(
        trt: Stack, path: str, body: dict[str, Any]) -> None:
    response = post(trt, path, body)
    assert_served_by_decode(response)
    context, generation = assert_both_roles_took_part(trt)
    choice = response.json()["choices"][0]
    content = choice["message"]["content"] if path == CHAT else choice["text"]
    expected = text.generate(prompt_of(path, body), 6)
    assert content == "".join(expected) and len(expected) > 1 and response.json()["usage"]["completion_tokens"] == 6
    params = context["json"]["disaggregated_params"]
    assert params["request_type"] == "context_only" and 2**40 <= params["disagg_request_id"] < 2**63
    assert {k: v for k, v in context["json"].items() if k != "disaggregated_params"} == {
        **body, "max_tokens": 1, "stream": False}
    prompt_key = "prompt_token_ids" if path == CHAT else "prompt"
    rest = {k: v for k, v in generation["json"].items() if k not in ("disaggregated_params", prompt_key)}
    assert rest == {k: v for k, v in body.items() if k != prompt_key}, "the client's request, verbatim"
    assert generation["json"][prompt_key] == context["notes"]["prompt_token_ids"], "the context's token ids"


@pytest.mark.parametrize("path,body", [(CHAT, chat_body(max_tokens=5, stream=True,
                                                        stream_options={"include_usage": True})),
                                       (COMPLETIONS, completion_body(max_tokens=5, stream=True))],
                         ids=["chat", "completions"])
def test_streaming_completion_is_served_by_distinct_context_and_generation_workers(
        trt: Stack, path: str, body: dict[str, Any]) -> None:
    response, raw = stream(trt, path, body)
    assert_event_stream(response)
    events = sse_events(raw.decode())
    assert events[-1] == "[DONE]"
    chunks = [json.loads(event) for event in events[:-1]]
    pieces = [(c["choices"][0]["delta"].get("content") or "") if path == CHAT else c["choices"][0]["text"]
              for c in chunks if c["choices"]]
    assert "".join(pieces) == "".join(text.generate(prompt_of(path, body), 5))
    context, generation = assert_both_roles_took_part(trt)
    assert context["json"]["stream"] is False and "stream_options" not in context["json"]
    assert generation["json"]["stream"] is True
    if "stream_options" in body:
        assert chunks[-1]["usage"]["completion_tokens"] == 5


# --- the context phase already finished the request -----------------------------------------------


def test_first_token_eos_is_answered_by_the_context_worker_without_a_generation_leg(trt: Stack) -> None:
    trt.prefill.script({"first_token_eos": True})
    response = post(trt, COMPLETIONS, completion_body(max_tokens=20))
    assert response.status_code == 200, response.text
    choice = only(response.json()["choices"])
    assert choice["finish_reason"] == "stop" and "disaggregated_params" not in choice
    assert response.json()["usage"]["completion_tokens"] == 1
    assert trt.decode.requests() == [], "the generation leg must not run"


def test_first_token_eos_for_a_streaming_client_is_a_complete_event_stream(trt: Stack) -> None:
    trt.prefill.script({"first_token_eos": True})
    body = chat_body(stream=True, stream_options={"include_usage": True})
    response, raw = stream(trt, CHAT, body)
    assert_event_stream(response)
    events = sse_events(raw.decode())
    assert events[-1] == "[DONE]"
    first, usage = (json.loads(event) for event in events[:-1])
    assert first["object"] == "chat.completion.chunk" and first["choices"][0]["finish_reason"] == "stop"
    assert first["choices"][0]["delta"]["role"] == "assistant"
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 1
    assert trt.decode.requests() == []


# --- failures ----------------------------------------------------------------------------------------


def test_context_worker_down_is_502_and_generation_never_runs(trt: Stack) -> None:
    assert_error(post(trt, CHAT, chat_body(), **{"x-prefiller-host-port": "127.0.0.2:9"}), 502,
                 "prefill_upstream_unavailable")
    assert trt.decode.requests() == []


def test_context_worker_error_status_is_kept_and_generation_never_runs(trt: Stack) -> None:
    """trtllm-serve's own 400 (create_error_response: a top-level ErrorResponse) reaches the client as
    trtllm-serve put it; a 401 is ours."""
    trt.prefill.script({"status": 400})
    response = post(trt, CHAT, chat_body())
    assert response.status_code == 400
    assert response.json() == {"object": "error", "message": "emulated failure", "type": "BadRequestError",
                               "param": None, "code": 400}
    trt.prefill.script({"status": 401})
    assert_error(post(trt, CHAT, chat_body()), 401, "prefill_upstream_error")
    assert trt.decode.requests() == []


@pytest.mark.parametrize("behaviour,param", [
    ({"params_remove": ["ctx_request_id"]}, "disaggregated_params.ctx_request_id is missing"),
    ({"params_set": {"ctx_request_id": "77"}}, "disaggregated_params.ctx_request_id is invalid"),
    ({"params_set": {"first_gen_tokens": []}}, "disaggregated_params.first_gen_tokens is invalid"),
    ({"params_set": {"encoded_opaque_state": "%%%"}}, "disaggregated_params.encoded_opaque_state is invalid"),
    ({"params_set": {"request_type": "generation_only"}}, "disaggregated_params.request_type is invalid"),
    ({"params_null": True}, "disaggregated_params is missing"),
    ({"omit_prompt_token_ids": True}, "prompt_token_ids is missing"),
])
def test_bad_context_metadata_is_refused_and_generation_never_runs(
        trt: Stack, behaviour: dict[str, Any], param: str) -> None:
    trt.prefill.script(behaviour)
    error = assert_error(post(trt, COMPLETIONS, completion_body()), 502, "invalid_prefill_handoff")
    assert error["param"] == param
    assert trt.decode.requests() == []


@pytest.mark.parametrize("forged", [{"ctx_request_id": 12345}, {"encoded_opaque_state": "AAAA"},
                                    {"first_gen_tokens": [7]}])
def test_well_formed_params_the_context_did_not_issue_are_refused_by_the_generation_worker(
        trt: Stack, forged: dict[str, Any]) -> None:
    """They pass our checks; the generation worker cannot pull a KV that was never issued and fails
    like trtllm-serve (400 BadRequestError, relayed as decode's own answer)."""
    trt.prefill.script({"params_set": forged})
    response = post(trt, COMPLETIONS, completion_body(max_tokens=4))
    assert response.status_code == 400
    assert response.json()["type"] == "BadRequestError" and response.json()["object"] == "error"
    generation = only(trt.decode.requests())
    assert generation["notes"]["kv"] != "ok"
    assert generation["json"]["disaggregated_params"] | forged == generation["json"]["disaggregated_params"]


def test_client_supplied_disaggregated_params_are_refused_before_any_leg(trt: Stack) -> None:
    body = chat_body(disaggregated_params={"request_type": "generation_only", "ctx_request_id": 1})
    assert assert_error(post(trt, CHAT, body), 400, "reserved_request_field")["param"] == "disaggregated_params"
    assert_no_leg_ran(trt)


def test_client_gone_while_the_context_phase_runs_cancels_it_and_never_generates(trt: Stack) -> None:
    trt.prefill.script({"hang": True})

    async def abandon() -> None:
        async with httpx.AsyncClient(base_url=trt.url, timeout=60) as client:
            request = asyncio.ensure_future(client.post(CHAT, content=json.dumps(chat_body()),
                                                        headers=trt.pd_headers()))
            assert await asyncio.to_thread(lambda: trt.prefill.wait("pending"))
            request.cancel()
            with pytest.raises(asyncio.CancelledError):
                await request

    asyncio.run(abandon())
    assert trt.prefill.wait("disconnected"), "the context request must be cancelled"
    assert trt.decode.requests() == [], "the generation leg must not run"


# --- token limits: one name for one field (ChatCompletionRequest, extra="forbid") ---------------------


@pytest.mark.parametrize("limit", ["max_tokens", "max_completion_tokens"])
def test_chat_with_either_token_limit_name_is_served(trt: Stack, limit: str) -> None:
    """Current OpenAI SDKs send max_completion_tokens; the context request must carry that one name only."""
    body = {"model": "emulated", "messages": [{"role": "user", "content": "What is a KV cache?"}], limit: 5}
    response = post(trt, CHAT, body)
    assert response.status_code == 200, response.text
    context, generation = assert_both_roles_took_part(trt)
    assert {k for k in ("max_tokens", "max_completion_tokens") if k in context["json"]} == {limit}
    assert context["json"][limit] == 1 and generation["json"][limit] == 5
    assert response.json()["usage"]["completion_tokens"] == 5


def test_the_context_worker_refuses_a_body_with_both_names_as_trtllm_serve_does(trt: Stack) -> None:
    """Sent straight to the emulated context worker: 400 {"error": "...extra_forbidden..."}."""
    body = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 1, "max_completion_tokens": 1,
            "disaggregated_params": {"request_type": "context_only", "disagg_request_id": 2**40}}
    with httpx.Client(base_url=trt.prefill.url, timeout=30) as client:
        response = client.post(CHAT, json=body)
    assert response.status_code == 400
    assert "extra_forbidden" in response.json()["error"] and "max_completion_tokens" in response.json()["error"]


# --- signing (x-trtllm-disagg-auth) ------------------------------------------------------------------


def test_a_clients_own_auth_header_never_reaches_either_leg(trt: Stack) -> None:
    response = post(trt, COMPLETIONS, completion_body(max_tokens=3), **{AUTH_HEADER: "sha256=" + "0" * 64})
    assert response.status_code == 200, response.text
    assert AUTH_HEADER not in dict(only(trt.prefill.requests())["headers"])
    assert dict(only(trt.decode.requests())["headers"])[AUTH_HEADER] != "sha256=" + "0" * 64


@pytest.mark.parametrize("server_env", [
    {"PD_EXTPROC_PROTOCOL": PROTOCOL_RC23},  # unsigned: a build before PR #16002
    "wrong-key",  # signed with a key the workers do not hold
], ids=["unsigned", "wrongly-signed"])
def test_a_generation_worker_with_a_key_refuses_unsigned_and_wrongly_signed_requests(
        keys: dict[str, str], server_env: dict[str, str] | str) -> None:
    """trtllm-serve's create_error_response: 400 BadRequestError, decode's own answer; the context leg ran."""
    env = {"PD_EXTPROC_ADAPTER": "trtllm"}
    env.update(server_env if isinstance(server_env, dict) else {"PD_EXTPROC_TRTLLM_AUTH_KEY_FILE": keys["other"]})
    with running_stack(env, workers(keys["workers"])) as stack:
        response = post(stack, COMPLETIONS, completion_body(max_tokens=3))
        assert response.status_code == 400, response.text
        assert response.json() == {"object": "error", "type": "BadRequestError", "param": None, "code": 400,
                                   "message": "Invalid internal disaggregated request authentication"}
        assert only(stack.prefill.requests())["status"] == 200, "the context leg ran"
        generation = only(stack.decode.requests())
        assert "kv" not in generation["notes"], "no KV was pulled for an unauthenticated request"
