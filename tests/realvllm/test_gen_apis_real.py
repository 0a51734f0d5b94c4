"""P/D on vLLM's Messages, Responses and token-in generate APIs against real vLLM workers joined by NIXL.

Each API through Envoy, streamed and not: one prefill-only request and one decode request on the
workers, exactly one NIXL transfer counted by decode, and greedy output equal to the same request served
whole by one worker. The workers run with VLLM_ENABLE_RESPONSES_API_STORE=1 (engine.py), so a Responses
request is stored where it runs: the client's on decode, none on prefill.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

import pytest

from tests.realvllm import engine
from tests.realvllm.stage import RealPd, Reply
from tests.realvllm.wire import MAX_TOKENS

pytestmark = pytest.mark.realvllm

MESSAGES, RESPONSES, GENERATE = "/v1/messages", "/v1/responses", "/inference/v1/generate"
APIS = [MESSAGES, RESPONSES, GENERATE]
API_IDS = ["messages", "responses", "generate"]


def body_for(path: str, model: str, prompt: str) -> dict[str, Any]:
    """A greedy request of MAX_TOKENS tokens in the API's own fields."""
    if path == MESSAGES:
        return {"model": model, "max_tokens": MAX_TOKENS, "temperature": 0,
                "messages": [{"role": "user", "content": prompt}]}
    if path == RESPONSES:
        return {"model": model, "input": prompt, "max_output_tokens": MAX_TOKENS, "temperature": 0,
                "ignore_eos": True}
    token_ids = [3 + (ord(c) % 200) for c in prompt]  # the tiny model's vocabulary is small
    return {"model": model, "token_ids": token_ids,
            "sampling_params": {"temperature": 0, "max_tokens": MAX_TOKENS, "ignore_eos": True}}


def _events(raw: bytes) -> list[tuple[str | None, str]]:
    """(event name, data) of each SSE frame."""
    frames = []
    for frame in raw.decode().split("\n\n"):
        if not frame.strip():
            continue
        event, data = None, ""
        for line in frame.split("\n"):
            if line.startswith("event: "):
                event = line[len("event: "):]
            elif line.startswith("data: "):
                data = line[len("data: "):]
        frames.append((event, data))
    return frames


def output_of(path: str, reply: Reply, stream: bool) -> Any:
    """The generated text (token ids on generate) of a successful answer, full or streamed."""
    assert reply.status == 200, reply.body[:500]
    if not stream:
        assert reply.media_type == "application/json"
        answer = reply.json()
        if path == MESSAGES:
            return "".join(block["text"] for block in answer["content"] if block["type"] == "text")
        if path == RESPONSES:
            return "".join(part["text"] for item in answer["output"] if item["type"] == "message"
                           for part in item["content"] if part["type"] == "output_text")
        return answer["choices"][0]["token_ids"]
    assert reply.media_type == "text/event-stream"
    events = _events(reply.body)
    if path == MESSAGES:
        deltas = [json.loads(data)["delta"] for event, data in events if event == "content_block_delta"]
        assert events[-1][0] == "message_stop"
        return "".join(delta.get("text", "") for delta in deltas)
    if path == RESPONSES:
        assert events[-1][0] == "response.completed"
        return "".join(json.loads(data)["delta"] for event, data in events if event == "response.output_text.delta")
    assert events[-1][1] == "[DONE]"
    chunks = [json.loads(data) for _, data in events[:-1]]
    return [token for chunk in chunks for choice in chunk["choices"] for token in choice.get("token_ids") or []]


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
@pytest.mark.parametrize("path", APIS, ids=API_IDS)
def test_each_api_as_pd_runs_one_prefill_one_transfer_and_answers_as_aggregated(
        real_pd: RealPd, path: str, stream: bool) -> None:
    body = body_for(path, real_pd.model, f"API {path} through P/D, stream={stream}, the cache moves")
    client_body = {**body, "stream": True} if stream else body
    prefill_before, decode_before = engine.finished_requests(real_pd.prefill), engine.finished_requests(real_pd.decode)
    before = real_pd.counters()
    got = output_of(path, real_pd.pd(path, client_body), stream)
    delta = real_pd.counters().since(before)
    assert delta.transfers == 1, f"decode must pull the prompt's KV exactly once, counted {delta.transfers}"
    assert delta.failed_on_decode == 0
    assert engine.finished_requests(real_pd.prefill) == prefill_before + 1, "one prefill-only request"
    assert engine.finished_requests(real_pd.decode) == decode_before + 1, "one decode request"
    reference = real_pd.aggregated(real_pd.prefill, path, {**body, **({"store": False} if path == RESPONSES else {})})
    assert got == output_of(path, reference, False), "P/D output equals the aggregated answer"
    assert got, "the answer has output"


def test_the_responses_prefill_leg_leaves_no_stored_response(real_pd: RealPd) -> None:
    """The client asked to store (the default): decode keeps the response, the prefill worker none."""
    request_id = f"resp_pd_{uuid.uuid4().hex}"
    body = {**body_for(RESPONSES, real_pd.model, "a stored response through P/D"), "request_id": request_id}
    reply = real_pd.pd(RESPONSES, body)
    assert reply.status == 200, reply.body[:500]
    assert reply.json()["id"] == request_id
    on_decode = real_pd.decode.http.get(f"{RESPONSES}/{request_id}")
    on_prefill = real_pd.prefill.http.get(f"{RESPONSES}/{request_id}")
    assert on_decode.status_code == 200 and on_decode.json()["id"] == request_id
    assert on_prefill.status_code == 404, "the prefill leg stored nothing"
