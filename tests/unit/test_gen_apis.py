"""P/D on vLLM's Messages, Responses and generate APIs: the request checks, each API's derived prefill
request, the decode body, and through the processor: which legs ran, errors in the API's own shape,
counts by API."""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path
from typing import Any

import pytest

from extproc.adapters import vllm_apis
from extproc.adapters.base import PlanInput
from extproc.adapters.sglang import SglangAdapter, check_prefill_reply
from extproc.adapters.vllm_nixl import VllmNixlAdapter, decode_body, prefill_body
from extproc.config import load_settings
from extproc.envoy import gateway
from extproc.envoy.bootstrap import render
from extproc.pipeline.processor import PdProcessor, Pending
from extproc.protocol.errors import Code, PdError
from extproc.protocol.openai_request import Endpoint, parse_client_request
from extproc.protocol.prefill_target import parse_prefill_target
from extproc.protocol.transport import WorkerReply
from tests.unit.test_envoy_config import _hcm
from tests.unit.test_processor import DECODE, HANDOFF, head, ok, rig

PRODUCER = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
            "remote_block_ids": None, "remote_host": None, "remote_port": None}
VLLM_ENDPOINTS = frozenset(VllmNixlAdapter.endpoints)
MESSAGES = {"model": "m", "max_tokens": 64, "system": "be brief", "stream": True,
            "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
            "thinking": {"type": "enabled", "budget_tokens": 32}}
RESPONSES = {"model": "m", "input": "hi", "instructions": "be brief", "max_output_tokens": 64, "stream": True,
             "tools": [{"type": "function", "name": "f", "parameters": {}}]}
GENERATE = {"model": "m", "token_ids": [1, 2, 3], "stream": True, "stream_options": {"include_usage": True},
            "sampling_params": {"temperature": 0, "max_tokens": 64, "min_tokens": 8}}


def request(path: str, body: dict[str, Any] | bytes) -> Any:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    return parse_client_request(path, "application/json", raw, 1 << 20, served=VLLM_ENDPOINTS)


def refused(path: str, body: dict[str, Any] | bytes) -> PdError:
    with pytest.raises(PdError) as caught:
        request(path, body)
    return caught.value


# --- the derived prefill requests -----------------------------------------------------------------

def test_messages_prefill_caps_max_tokens_only_and_keeps_the_thinking_budget() -> None:
    body = json.loads(prefill_body(request("/v1/messages", MESSAGES)))
    assert body == {**MESSAGES, "max_tokens": 1, "stream": False, "kv_transfer_params": PRODUCER}
    assert "max_completion_tokens" not in body  # not a field of AnthropicMessagesRequest


def test_responses_prefill_stores_nothing_and_caps_max_output_tokens() -> None:
    client = {**RESPONSES, "store": True, "background": False}
    body = json.loads(prefill_body(request("/v1/responses", client)))
    expected = {**RESPONSES, "max_output_tokens": 1, "stream": False, "store": False,
                "kv_transfer_params": PRODUCER}
    assert body == expected
    assert "max_tokens" not in body and "background" not in body


def test_responses_prefill_says_store_false_when_the_client_left_the_default() -> None:
    body = json.loads(prefill_body(request("/v1/responses", {"input": "hi"})))
    assert body["store"] is False and body["max_output_tokens"] == 1 and body["stream"] is False


def test_generate_prefill_caps_inside_sampling_params_and_keeps_its_other_bytes() -> None:
    raw = (b'{"token_ids": [1, 2, 3], "stream": true, "stream_options": {"include_usage": true},'
           b' "sampling_params": {"temperature": 0.0, "seed": 123456789012345678901, "min_tokens": 8,'
           b' "max_tokens": 64}}')
    out = prefill_body(request("/inference/v1/generate", raw))
    assert out == (b'{"token_ids": [1, 2, 3],"stream":false,"sampling_params":{"temperature": 0.0,'
                   b'"seed": 123456789012345678901,"max_tokens":1},"kv_transfer_params":'
                   + json.dumps(PRODUCER, separators=(",", ":")).encode() + b"}")


def test_generate_prefill_adds_the_cap_when_sampling_params_has_none() -> None:
    body = json.loads(prefill_body(request("/inference/v1/generate", {"token_ids": [5], "sampling_params": {}})))
    assert body["sampling_params"] == {"max_tokens": 1} and "max_tokens" not in body


@pytest.mark.parametrize(("path", "client"), [("/v1/messages", MESSAGES), ("/v1/responses", RESPONSES),
                                              ("/inference/v1/generate", GENERATE)])
def test_decode_body_is_the_client_bytes_plus_the_handoff(path: str, client: dict[str, Any]) -> None:
    raw = json.dumps(client, separators=(",", ":")).encode()
    out = decode_body(request(path, raw), b'{"remote_port":5600}')
    assert out == raw[:-1] + b',"kv_transfer_params":{"remote_port":5600}}'


# --- checks before any leg ------------------------------------------------------------------------

@pytest.mark.parametrize(("path", "body", "field"), [
    ("/v1/messages", {"messages": [{"role": "user", "content": "x"}]}, "max_tokens"),
    ("/v1/messages", {"messages": [], "max_tokens": 4}, "messages"),
    ("/v1/messages", {"messages": [{"role": "user", "content": "x"}], "max_tokens": 0}, "max_tokens"),
    ("/v1/responses", {"input": 3}, "input"),
    ("/v1/responses", {"input": "x", "max_output_tokens": True}, "max_output_tokens"),
    ("/v1/responses", {"input": "x", "store": "no"}, "store"),
    ("/inference/v1/generate", {"token_ids": [], "sampling_params": {}}, "token_ids"),
    ("/inference/v1/generate", {"token_ids": [1, -2], "sampling_params": {}}, "token_ids"),
    ("/inference/v1/generate", {"token_ids": [1, True], "sampling_params": {}}, "token_ids"),
    ("/inference/v1/generate", {"token_ids": [1]}, "sampling_params"),
    ("/inference/v1/generate", {"token_ids": [1], "sampling_params": {"max_tokens": 0}},
     "sampling_params.max_tokens"),
])
def test_a_field_of_the_wrong_type_is_refused_before_any_leg(path: str, body: dict[str, Any], field: str) -> None:
    error = refused(path, body)
    assert (error.code, error.field) == (Code.INVALID_REQUEST_FIELD, field)


@pytest.mark.parametrize(("path", "body", "field"), [
    ("/v1/responses", {"input": "x", "previous_response_id": "resp_1"}, "previous_response_id"),
    ("/v1/responses", {"input": "x", "conversation": "conv_1"}, "conversation"),
    ("/v1/responses", {"input": "x", "background": True}, "background"),
    ("/v1/responses", {"input": "x", "tools": [{"type": "web_search_preview"}]}, "tools"),
    ("/v1/responses", {"input": "x", "tools": [{"type": "mcp", "server_label": "python"}]}, "tools"),
    ("/inference/v1/generate", {"token_ids": [1], "sampling_params": {"n": 2}}, "sampling_params.n"),
])
def test_state_on_a_worker_and_several_answers_are_unsupported_variants(path: str, body: dict[str, Any],
                                                                         field: str) -> None:
    error = refused(path, body)
    assert (error.code, error.field) == (Code.UNSUPPORTED_PD_VARIANT, field)


def test_a_duplicate_key_inside_sampling_params_is_refused_not_guessed() -> None:
    """Refused with the body's checks, before any leg (in a worker process for a large body)."""
    error = refused("/inference/v1/generate", b'{"token_ids": [1], "sampling_params": {"max_tokens": 4, '
                                              b'"max_tokens": 9}}')
    assert error.code is Code.INVALID_REQUEST_BODY


def test_the_generate_prefill_body_reuses_the_spans_the_inspection_found(monkeypatch: pytest.MonkeyPatch) -> None:
    """sampling_params is scanned once, with the body's checks (off the event loop for a large body): a
    stop list of a million strings scanned again while the prefill body is built stalled every stream."""
    client = request("/inference/v1/generate", {"token_ids": [1], "sampling_params": {"stop": ["x"] * 1000,
                                                                                      "max_tokens": 9}})
    assert [m.name for m in client.nested["sampling_params"]] == ["stop", "max_tokens"]

    def no_second_scan(raw: bytes) -> None:
        raise AssertionError("sampling_params scanned again on the event loop")

    monkeypatch.setattr(vllm_apis.jsonspan, "unique_members", no_second_scan)
    body = json.loads(prefill_body(client))
    assert body["sampling_params"] == {"stop": ["x"] * 1000, "max_tokens": 1}


def test_the_new_paths_are_not_served_unless_the_adapter_lists_them() -> None:
    for path in ("/v1/messages", "/v1/responses", "/inference/v1/generate", "/generate", "/v1/messages/count_tokens"):
        with pytest.raises(PdError) as caught:
            parse_client_request(path, "application/json", b'{"messages": [{}], "max_tokens": 1}', 1 << 20)
        assert caught.value.code is Code.UNSUPPORTED_ENDPOINT
    assert Endpoint.MESSAGES not in SglangAdapter.endpoints and Endpoint.SGLANG_GENERATE not in VLLM_ENDPOINTS


# --- through the processor --------------------------------------------------------------------------

def run(adapter: Any, path: str, body: dict[str, Any], *answers: WorkerReply) -> Any:
    r = rig(adapter)
    r.transport.answers.extend(answers)
    request_head = head(path)

    async def both_phases() -> Any:
        pending = await r.processor.on_headers(request_head)
        assert isinstance(pending, Pending)
        return await r.processor.on_body(request_head, pending, json.dumps(body).encode())

    return r, asyncio.run(both_phases()).decision


def api_counts(r: Any) -> dict[tuple[str, str], float]:
    return {(s.labels["api"], s.labels["outcome"]): s.value for m in r.metrics.registry.collect()
            if m.name == "pd_extproc_api_requests" for s in m.samples if s.name.endswith("_total")}


@pytest.mark.parametrize(("path", "client", "reply", "api"), [
    ("/v1/messages", MESSAGES, {"id": "msg_1", "type": "message", "content": [], "kv_transfer_params": HANDOFF},
     "messages"),
    ("/v1/responses", RESPONSES, {"id": "resp_1", "object": "response", "output": [], "kv_transfer_params": HANDOFF},
     "responses"),
    ("/inference/v1/generate", GENERATE, {"request_id": "r", "choices": [], "kv_transfer_params": HANDOFF},
     "generate"),
])
def test_one_prefill_leg_on_the_clients_own_api_then_decode_with_the_handoff(
        path: str, client: dict[str, Any], reply: dict[str, Any], api: str) -> None:
    r, response = run(VllmNixlAdapter(), path, client, ok(reply))
    (call,) = r.transport.calls
    assert call.path == path and json.loads(call.body or b"")["kv_transfer_params"] == PRODUCER
    assert not r.transport.posts_to(DECODE)  # decode is Envoy's leg, with the body we hand back
    decode = json.loads(response.body)
    assert decode == {**client, "kv_transfer_params": HANDOFF}
    assert api_counts(r) == {(api, "ok"): 1.0}


def test_an_error_on_the_messages_api_is_anthropic_shaped_and_no_leg_runs() -> None:
    r, response = run(VllmNixlAdapter(), "/v1/messages", {**MESSAGES, "kv_transfer_params": {"x": 1}})
    assert r.transport.calls == []
    assert response.status == 400
    body = json.loads(response.body)
    assert body == {"type": "error", "error": {
        "type": "invalid_request_error",
        "message": "The field kv_transfer_params is set by disaggregated serving and must not be supplied by the "
                   "client."}}
    assert api_counts(r) == {("messages", "reserved_request_field"): 1.0}


def test_the_prefill_engines_own_error_on_the_messages_api_stays_anthropic_shaped() -> None:
    engine_error = {"type": "error", "error": {"type": "BadRequestError", "message": "bad thinking"}}
    reply = WorkerReply(400, "application/json", json.dumps(engine_error).encode())
    r, response = run(VllmNixlAdapter(), "/v1/messages", MESSAGES, reply)
    assert len(r.transport.calls) == 1
    assert json.loads(response.body) == engine_error


def test_an_error_on_the_responses_api_keeps_the_openai_envelope() -> None:
    r, response = run(VllmNixlAdapter(), "/v1/responses", {"input": "x", "previous_response_id": "resp_1"})
    assert r.transport.calls == []
    error = json.loads(response.body)["error"]
    assert (error["code"], error["param"]) == ("unsupported_pd_variant", "previous_response_id")


def test_an_adapter_without_the_new_apis_refuses_them_before_any_leg() -> None:
    r, response = run(SglangAdapter(), "/v1/messages", MESSAGES)
    assert r.transport.calls == []
    assert json.loads(response.body)["error"]["type"] == "not_found_error"


# --- the routes -------------------------------------------------------------------------------------

def _pd_regex(adapter: str) -> str:
    routes = _hcm(render(load_settings({"PD_EXTPROC_ADAPTER": adapter}, {})))["route_config"]["virtual_hosts"][0]
    (pd,) = [route for route in routes["routes"] if route["name"] == "pd"]
    regex: str = pd["match"]["safe_regex"]["regex"]
    return regex


@pytest.mark.parametrize(("adapter", "served"), [
    ("vllm_nixl", {"/v1/chat/completions", "/v1/completions", "/v1/messages", "/v1/responses",
                   "/inference/v1/generate"}),
    ("sglang", {"/v1/chat/completions", "/v1/completions", "/generate"}),
])
def test_the_pd_route_and_the_gateway_take_exactly_the_paths_the_adapter_serves(adapter: str,
                                                                                  served: set[str]) -> None:
    regex = re.compile(_pd_regex(adapter))  # Envoy's safe_regex is a full match on the path without its query
    candidates = served | {"/v1/messages/count_tokens", "/v1/responses/resp_1", "/generate", "/v1/embeddings",
                           "/v1/messages", "/inference/v1/generate"}
    assert {path for path in candidates if regex.fullmatch(path)} == served
    gateway_paths = rig(VllmNixlAdapter() if adapter == "vllm_nixl" else SglangAdapter()).processor.pd_paths
    posted = {path: head(path, **{":method": "POST"}) for path in candidates}
    assert {path for path, posted_head in posted.items() if gateway.is_pd_request(posted_head, gateway_paths)} == served


# --- SGLang's native /generate ------------------------------------------------------------------------

def sglang_request(body: dict[str, Any]) -> Any:
    return parse_client_request("/generate", "application/json", json.dumps(body).encode(), 1 << 20,
                                served=SglangAdapter.endpoints)


@pytest.mark.parametrize(("body", "code", "field"), [
    ({"text": ["a", "b"]}, Code.UNSUPPORTED_PD_VARIANT, "text"),
    ({"input_ids": [[1, 2], [3]]}, Code.UNSUPPORTED_PD_VARIANT, "input_ids"),
    ({"text": "a", "sampling_params": [{}, {}]}, Code.UNSUPPORTED_PD_VARIANT, "sampling_params"),
    ({"text": "a", "sampling_params": {"n": 2}}, Code.UNSUPPORTED_PD_VARIANT, "sampling_params.n"),
    ({"input_embeds": [[0.1]]}, Code.UNSUPPORTED_PD_VARIANT, "input_embeds"),
    ({"text": 3}, Code.INVALID_REQUEST_FIELD, "text"),
    ({"text": "a", "input_ids": [1]}, Code.INVALID_REQUEST_FIELD, "text"),
    ({}, Code.INVALID_REQUEST_FIELD, "input_ids"),
    ({"input_ids": [1, "x"]}, Code.INVALID_REQUEST_FIELD, "input_ids"),
    ({"text": "a", "sampling_params": "x"}, Code.INVALID_REQUEST_FIELD, "sampling_params"),
])
def test_sglang_generate_is_one_prompt_one_answer(body: dict[str, Any], code: Code, field: str) -> None:
    with pytest.raises(PdError) as caught:
        sglang_request(body)
    assert (caught.value.code, caught.value.field) == (code, field)


def test_sglang_generate_legs_carry_the_bootstrap_fields_top_level() -> None:
    client = {"text": "The KV cache is", "sampling_params": {"max_new_tokens": 8}, "stream": True}
    plan = SglangAdapter(bootstrap_port=8998).plan(sglang_request(client), PlanInput(
        parse_prefill_target(["10.0.0.7:30000"]), nonce=5))
    prefill, decode = json.loads(plan.prefill_body), json.loads(plan.decode.body)
    bootstrap = {"bootstrap_host": "10.0.0.7", "bootstrap_port": 8998, "bootstrap_room": 6,
                 "rid": "pd-0000000000000005"}
    assert prefill == {**client, "stream": False, **bootstrap}
    assert decode == {**client, **bootstrap}


@pytest.mark.parametrize(("reply", "field"), [
    ({"text": "", "meta_info": {"finish_reason": {"type": "abort", "message": "x"}}}, "meta_info.finish_reason"),
    ({"text": "", "meta_info": 3}, "meta_info"),
])
def test_an_aborted_sglang_generate_prefill_is_a_failure(reply: dict[str, Any], field: str) -> None:
    with pytest.raises(PdError) as caught:
        check_prefill_reply(WorkerReply(200, "application/json", json.dumps(reply).encode()))
    assert (caught.value.code, caught.value.field) == (Code.INVALID_PREFILL_HANDOFF, field)


def test_a_finished_sglang_generate_prefill_passes_and_a_repeated_type_is_refused() -> None:
    check_prefill_reply(WorkerReply(200, "application/json",
                                    b'{"text": "x", "meta_info": {"finish_reason": {"type": "length", "length": 1}}}'))
    with pytest.raises(PdError) as caught:
        check_prefill_reply(WorkerReply(200, "application/json", b'{"text": "x", "meta_info": {"finish_reason": '
                                                                 b'{"type": "length", "type": "abort"}}}'))
    assert caught.value.field == "meta_info.finish_reason"


def test_a_responses_variant_kept_on_one_worker_is_served_whole_with_the_setting() -> None:
    """PD_EXTPROC_UNSUPPORTED_VARIANTS=aggregated: a previous_response_id request goes to decode exactly as
    sent (the worker that stored the earlier response is the one that serves it), no prefill leg."""
    r = rig(VllmNixlAdapter())
    processor = PdProcessor(VllmNixlAdapter(), r.transport, decode_control=r.transport, clock=r.clock,
                            max_request_bytes=1 << 20,
                            admission=r.admission,
                            metrics=r.metrics, background=r.background, decode=DECODE, serve_unsupported=True)
    raw = b'{"input": "x", "previous_response_id": "resp_1",  "store": true}'
    request_head = head("/v1/responses")

    async def both_phases() -> Any:
        pending = await processor.on_headers(request_head)
        assert isinstance(pending, Pending)
        return await processor.on_body(request_head, pending, raw)

    response = asyncio.run(both_phases()).decision
    assert r.transport.calls == []
    assert response.body == raw
    assert api_counts(r) == {("responses", "prefill_fallback"): 1.0}


@pytest.mark.parametrize("marker", ["vllm-messages", "vllm-responses", "vllm-generate"])
def test_the_protocol_examples_are_what_the_adapter_derives(marker: str) -> None:
    """PROTOCOL.md §4.4's examples: the prefill leg body is exactly prefill_body(client body)."""
    doc = (Path(__file__).parents[2] / "PROTOCOL.md").read_text()
    block = doc.split(f"<!-- example: {marker} -->\n", 1)[1]
    path = block.split("`", 2)[1]
    client, derived = re.findall(r"```json\n(.*?)\n```", block, re.S)[:2]
    assert prefill_body(request(path, client.encode())).decode() == derived
