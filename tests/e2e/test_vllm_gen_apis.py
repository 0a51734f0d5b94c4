"""P/D on vLLM's Messages, Responses and token-in generate APIs through a real Envoy, our server and the
emulated vLLM workers: what each leg received, which legs did not run, each API's own answer and error
shapes, and the Responses API's stored state. (tests/realvllm runs the same against a real vLLM.)"""

from __future__ import annotations

import json
from typing import Any

import pytest

from pd_extproc_lab.emulator import text, vllm_apis
from tests.harness import Stack
from tests.helpers import (
    assert_error,
    assert_event_stream,
    assert_no_leg_ran,
    assert_served_by_decode,
    only,
    post,
    stream,
)

pytestmark = pytest.mark.dataplane

MESSAGES, RESPONSES, GENERATE = "/v1/messages", "/v1/responses", "/inference/v1/generate"
PRODUCER = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
            "remote_block_ids": None, "remote_host": None, "remote_port": None}
BODIES: dict[str, dict[str, Any]] = {
    MESSAGES: {"model": "emulated", "max_tokens": 5, "system": "be brief",
               "messages": [{"role": "user", "content": "tell me about the cache"}]},
    RESPONSES: {"model": "emulated", "input": "tell me about the cache", "instructions": "be brief",
                "max_output_tokens": 5},
    GENERATE: {"model": "emulated", "token_ids": [11, 12, 13, 14], "sampling_params": {"temperature": 0,
                                                                                       "max_tokens": 5}},
}
# What each API's prefill request differs in (the rest is the client's body).
PREFILL_CHANGES: dict[str, dict[str, Any]] = {
    MESSAGES: {"max_tokens": 1, "stream": False},
    RESPONSES: {"max_output_tokens": 1, "stream": False, "store": False},
    GENERATE: {"stream": False, "sampling_params": {"temperature": 0, "max_tokens": 1}},
}


def expected_tokens(path: str) -> list[str]:
    """The emulated greedy answer to the prompt that API renders (what the aggregated engine answers)."""
    api = vllm_apis.APIS[path]
    return text.generate(api.prompt(BODIES[path]), 5)


def answer_text(path: str, payload: dict[str, Any]) -> Any:
    if path == MESSAGES:
        return payload["content"][0]["text"]
    if path == RESPONSES:
        return payload["output"][0]["content"][0]["text"]
    return payload["choices"][0]["token_ids"]


def aggregated(path: str) -> Any:
    tokens = expected_tokens(path)
    return [vllm_apis.token_id(token) for token in tokens] if path == GENERATE else "".join(tokens)


def served_whole(stack: Stack, path: str) -> Any:
    """The same request without x-prefiller-host-port: the decode worker alone answers it (passthrough)."""
    with stack.client() as client:
        response = client.post(path, content=json.dumps(BODIES[path]), headers={"content-type": "application/json"})
    assert response.status_code == 200
    return answer_text(path, response.json())


@pytest.mark.parametrize("path", [MESSAGES, RESPONSES, GENERATE], ids=["messages", "responses", "generate"])
def test_one_prefill_leg_in_the_clients_api_then_decode_with_the_handoff(stack: Stack, path: str) -> None:
    transfers = stack.decode.metric("vllm:nixl_xfer_time_seconds_count")
    response = post(stack, path, BODIES[path])
    assert_served_by_decode(response)
    prefill, decode = only(stack.prefill.requests()), only(stack.decode.requests())
    assert prefill["target"] == decode["target"] == path, "both legs on the client's own API"
    assert prefill["json"] == {**BODIES[path], **PREFILL_CHANGES[path], "kv_transfer_params": PRODUCER}
    assert decode["json"] == {**BODIES[path], "kv_transfer_params": prefill["notes"]["kv_transfer_params"]}
    assert decode["notes"]["load"] == "ok"
    assert stack.decode.metric("vllm:nixl_xfer_time_seconds_count") == transfers + 1
    assert answer_text(path, response.json()) == aggregated(path) == served_whole(stack, path)


@pytest.mark.parametrize("path", [MESSAGES, RESPONSES, GENERATE], ids=["messages", "responses", "generate"])
def test_a_stream_is_decodes_stream_in_the_apis_own_events(stack: Stack, path: str) -> None:
    response, raw = stream(stack, path, {**BODIES[path], "stream": True})
    assert_event_stream(response)
    frames = [frame for frame in raw.decode().split("\n\n") if frame]
    data = [frame.split("data: ", 1)[1] for frame in frames]
    if path == GENERATE:
        assert data[-1] == "[DONE]"
        tokens = [json.loads(d)["choices"][0]["token_ids"][0] for d in data[:-1]]
        assert tokens == aggregated(path)
    else:
        delta_event = "content_block_delta" if path == MESSAGES else "response.output_text.delta"
        deltas = [json.loads(d) for f, d in zip(frames, data, strict=True) if f.startswith(f"event: {delta_event}\n")]
        pieces = [d["delta"]["text"] if path == MESSAGES else d["delta"] for d in deltas]
        assert "".join(pieces) == aggregated(path)
    assert only(stack.prefill.requests())["json"]["stream"] is False
    assert only(stack.decode.requests())["json"]["stream"] is True


def test_the_prefill_leg_of_a_stored_response_stores_nothing(stack: Stack) -> None:
    """store defaults to true: the decode worker keeps the client's response, the prefill worker none."""
    stored = stack.prefill.metric("emulator_stored_responses"), stack.decode.metric("emulator_stored_responses")
    response = post(stack, RESPONSES, BODIES[RESPONSES])
    assert response.status_code == 200
    assert stack.prefill.metric("emulator_stored_responses") == stored[0]
    assert stack.decode.metric("emulator_stored_responses") == stored[1] + 1
    with stack.client() as client:  # what the client retrieves is decode's (passthrough GET)
        kept = client.get(f"{RESPONSES}/{response.json()['id']}")
    assert kept.status_code == 200 and kept.json()["output"] == response.json()["output"]


def test_an_error_on_the_messages_api_is_anthropic_shaped_and_no_leg_runs(stack: Stack) -> None:
    response = post(stack, MESSAGES, {**BODIES[MESSAGES], "kv_transfer_params": {"do_remote_decode": True}})
    assert response.status_code == 400 and response.headers["content-type"] == "application/json"
    assert response.json() == {"type": "error", "error": {
        "type": "invalid_request_error",
        "message": "The field kv_transfer_params is set by disaggregated serving and must not be supplied by the "
                   "client."}}
    assert_no_leg_ran(stack)


@pytest.mark.parametrize("body,field", [
    ({**BODIES[RESPONSES], "previous_response_id": "resp_0"}, "previous_response_id"),
    ({**BODIES[RESPONSES], "background": True}, "background"),
], ids=["previous_response_id", "background"])
def test_responses_state_kept_on_a_worker_is_refused_before_any_leg(stack: Stack, body: dict[str, Any],
                                                                     field: str) -> None:
    error = assert_error(post(stack, RESPONSES, body), 400, "unsupported_pd_variant")
    assert error["param"] == field
    assert_no_leg_ran(stack)


def test_passthrough_on_the_new_apis_still_refuses_a_steering_body(stack: Stack) -> None:
    """Without x-prefiller-host-port the client guard covers /v1/messages too."""
    with stack.client() as client:
        response = client.post(MESSAGES, content=json.dumps({**BODIES[MESSAGES], "kv_transfer_params": {
            "do_remote_decode": True}}), headers={"content-type": "application/json"})
    assert_error(response, 400, "reserved_request_field")
    assert_no_leg_ran(stack)
