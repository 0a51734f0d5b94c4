"""C01-C15 and bad input: the vLLM NIXL P/D contract through a real Envoy, our server and emulated workers.

Each test asserts what each leg received and which legs did not run. What these tests do not prove:
that a real NIXL connector accepts the handoff or that KV bytes moved (tests/realvllm does that).
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import pytest

from pd_extproc_lab.emulator import text
from tests.harness import Stack, WorkerSpec, running_stack
from tests.helpers import (
    CHAT,
    COMPLETIONS,
    assert_error,
    assert_event_stream,
    assert_no_leg_ran,
    assert_served_by_decode,
    chat_body,
    completion_body,
    ext_proc_streams,
    only,
    post,
    stream,
)

pytestmark = pytest.mark.dataplane

PRODUCER = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
            "remote_block_ids": None, "remote_host": None, "remote_port": None}


# --- C01-C03: the three paths -------------------------------------------------------------------


def test_c01_no_prefill_header_passes_through_byte_for_byte_without_calling_us(stack: Stack) -> None:
    """C01: without x-prefiller-host-port, decode gets the client's exact bytes and our server is not called
    (a steering field is refused there: test_contract.py; the {} some SDKs send is not one)."""
    raw = b'{"model": "emulated",  "prompt": "hi", "max_tokens": 3, "kv_transfer_params": {}}'
    streams_before = ext_proc_streams(stack)
    with stack.client() as client:
        response = client.post(COMPLETIONS, content=raw, headers={"content-type": "application/json"})
        models = client.get("/v1/models", headers={"x-prefiller-host-port": stack.prefill.address})
    assert response.status_code == 200
    assert models.status_code == 200
    assert "x-prefiller-host-port" not in dict(stack.decode.requests()[1]["headers"])
    received = stack.decode.requests()
    assert [r["target"] for r in received] == [COMPLETIONS, "/v1/models"]
    assert stack.decode.raw_body(received[0]["seq"]) == raw
    assert stack.prefill.requests() == [], "the prefill leg must not run"
    assert ext_proc_streams(stack) == streams_before, "our server must not be called"


@pytest.mark.parametrize("path,body", [(CHAT, chat_body(max_tokens=5, temperature=0)),
                                       (COMPLETIONS, completion_body(max_tokens=5))], ids=["chat", "completions"])
def test_c02_non_streaming_success_sends_the_original_request_and_handoff_to_decode(
        stack: Stack, path: str, body: dict[str, Any]) -> None:
    """C02: prefill gets the derived request; decode gets the original plus the prefill's handoff verbatim."""
    transfers = stack.decode.metric("vllm:nixl_xfer_time_seconds_count")
    response = post(stack, path, body)
    assert_served_by_decode(response)
    prefill = only(stack.prefill.requests())
    decode = only(stack.decode.requests())
    assert prefill["json"]["stream"] is False
    assert prefill["json"]["max_tokens"] == 1
    assert prefill["json"]["kv_transfer_params"] == PRODUCER
    handoff = prefill["notes"]["kv_transfer_params"]
    assert decode["json"] == {**body, "kv_transfer_params": handoff}
    assert decode["notes"]["load"] == "ok"
    assert stack.decode.metric("vllm:nixl_xfer_time_seconds_count") == transfers + 1
    prompt = text.chat_prompt(body["messages"]) if path == CHAT else text.completion_prompt(body["prompt"])
    choice = response.json()["choices"][0]
    assert (choice["message"]["content"] if path == CHAT else choice["text"]) == "".join(text.generate(prompt, 5))


def test_c02_decode_receives_the_same_request_id_as_prefill(stack: Stack) -> None:
    """C02: one x-request-id on both legs, the client's own when it sent one."""
    post(stack, CHAT, chat_body(max_tokens=2), **{"x-request-id": "0b1e2d3c-aaaa-bbbb-cccc-000000000001"})
    prefill_headers = dict(only(stack.prefill.requests())["headers"])
    decode_headers = dict(only(stack.decode.requests())["headers"])
    assert prefill_headers["x-request-id"] == decode_headers["x-request-id"] == "0b1e2d3c-aaaa-bbbb-cccc-000000000001"


@pytest.mark.parametrize("path,body", [(CHAT, chat_body(max_tokens=6, stream=True)),
                                       (COMPLETIONS, completion_body(max_tokens=6, stream=True))],
                         ids=["chat", "completions"])
def test_c03_streaming_success_streams_decode_only_and_no_prefill_token_leaks(
        stack: Stack, path: str, body: dict[str, Any]) -> None:
    """C03: the client sees decode's SSE stream exactly; the prefill leg ran non-streaming."""
    response, raw = stream(stack, path, body)
    assert_event_stream(response)
    assert response.headers["content-type"] == "text/event-stream"
    events = [e for e in raw.decode().split("\n\n") if e]
    assert events[-1] == "data: [DONE]" and raw.count(b"[DONE]") == 1
    chunks = [json.loads(e.removeprefix("data: ")) for e in events[:-1]]
    pieces = [c["choices"][0]["delta"].get("content", "") if path == CHAT else c["choices"][0]["text"] for c in chunks]
    prompt = text.chat_prompt(body["messages"]) if path == CHAT else text.completion_prompt(body["prompt"])
    assert "".join(pieces) == "".join(text.generate(prompt, 6))
    assert {c["id"] for c in chunks} == {chunks[0]["id"]}, "every chunk comes from the one decode response"
    prefill = only(stack.prefill.requests())
    assert prefill["json"]["stream"] is False
    assert only(stack.decode.requests())["json"]["stream"] is True


# --- C04-C08: request derivation and pre-flight rejection ---------------------------------------


@pytest.mark.parametrize("path,limits,prefill_expected", [
    (CHAT, {}, {"max_tokens": 1, "max_completion_tokens": 1}),
    (CHAT, {"max_tokens": 7}, {"max_tokens": 1, "max_completion_tokens": 1}),
    (CHAT, {"max_completion_tokens": 9}, {"max_tokens": 1, "max_completion_tokens": 1}),
    (CHAT, {"max_tokens": 7, "max_completion_tokens": 9}, {"max_tokens": 1, "max_completion_tokens": 1}),
    (COMPLETIONS, {}, {"max_tokens": 1}),
    (COMPLETIONS, {"max_tokens": 7}, {"max_tokens": 1}),
    (COMPLETIONS, {"max_tokens": None}, {"max_tokens": 1}),
], ids=["chat-none", "chat-max", "chat-mct", "chat-both", "cmpl-none", "cmpl-max", "cmpl-null"])
def test_c04_token_limits_are_one_on_prefill_and_untouched_on_decode(
        stack: Stack, path: str, limits: dict[str, Any], prefill_expected: dict[str, int]) -> None:
    """C04: every max_tokens/max_completion_tokens combination: 1 on prefill, the client's on decode."""
    body = (chat_body if path == CHAT else completion_body)(**limits)
    assert post(stack, path, body).status_code == 200
    prefill = only(stack.prefill.requests())["json"]
    assert {k: prefill.get(k) for k in prefill_expected} == prefill_expected
    if path == COMPLETIONS:
        assert "max_completion_tokens" not in prefill
    decode = only(stack.decode.requests())["json"]
    assert {k: decode.get(k, "absent") for k in ("max_tokens", "max_completion_tokens")} == \
        {k: limits.get(k, "absent") for k in ("max_tokens", "max_completion_tokens")}


def test_c05_min_tokens_and_stream_options_are_prefill_only_removals(stack: Stack) -> None:
    """C05: min_tokens, min_completion_tokens and stream_options are removed on prefill, kept on decode."""
    body = chat_body(max_tokens=8, min_tokens=4, min_completion_tokens=3, stream=True,
                     stream_options={"include_usage": True})
    with stack.client() as client:
        response = client.post(CHAT, content=json.dumps(body), headers=stack.pd_headers())
    assert response.status_code == 200
    assert response.text.count("data: [DONE]") == 1
    usage = [json.loads(e[6:]) for e in response.text.split("\n\n") if e.startswith("data: {")][-1]["usage"]
    assert usage["completion_tokens"] == 8
    prefill = only(stack.prefill.requests())["json"]
    for removed in ("min_tokens", "min_completion_tokens", "stream_options"):
        assert removed not in prefill
    decode = only(stack.decode.requests())["json"]
    assert (decode["min_tokens"], decode["min_completion_tokens"], decode["stream_options"]) == \
        (4, 3, {"include_usage": True})


def test_c06_unknown_fields_and_tools_reach_both_legs_byte_for_byte(stack: Stack) -> None:
    """C06: members we do not own reach both engines exactly as the client wrote them."""
    members = [
        b'"model":"emulated"',
        b'"messages":[{"role":"user","content":"caf\\u00e9 \\ud83d\\ude00 \\"q\\""}]',
        b'"tools":[{"type":"function","function":{"name":"f","parameters":{"type":"object","properties":'
        b'{"x":{"type":"integer","maximum":1e3}}}}}]',
        b'"seed":1180591620717411303424',
        b'"temperature":1.0',
        b'"top_p":0.10000000000000001',
        b'"x_vendor":{"nested":[1,{"deep":null}],"empty":{}}',
        b'"max_tokens":4',
    ]
    raw = b"{" + b",".join(members) + b"}"
    assert post(stack, CHAT, raw).status_code == 200
    prefill_raw = stack.prefill.raw_body(only(stack.prefill.requests())["seq"])
    decode_raw = stack.decode.raw_body(only(stack.decode.requests())["seq"])
    for member in members:
        assert member in decode_raw, member
        if not member.startswith(b'"max_tokens"'):
            assert member in prefill_raw, member


@pytest.mark.parametrize("n", [2, 0, -1, 1.0, "1", True, [1]], ids=repr)
def test_c07_n_other_than_one_is_rejected_before_any_leg(stack: Stack, n: Any) -> None:
    """C07: n != 1 is refused with 400 before either leg, never silently rewritten."""
    error = assert_error(post(stack, CHAT, chat_body(n=n)), 400, "unsupported_pd_variant")
    assert error["param"] == "n"
    assert_no_leg_ran(stack)


@pytest.mark.parametrize("n", [None, 1], ids=["null", "one"])
def test_c07_n_null_or_one_is_served(stack: Stack, n: Any) -> None:
    """C07: n: null and n: 1 are ordinary P/D requests, and reach decode unchanged."""
    assert post(stack, CHAT, chat_body(n=n, max_tokens=2)).status_code == 200
    assert only(stack.prefill.requests())["json"]["n"] == n
    assert only(stack.decode.requests())["json"]["n"] == n


@pytest.mark.parametrize("injected", [{"do_remote_prefill": True}, [], "x", True, 0], ids=repr)
def test_c08_client_injected_handoff_is_rejected(stack: Stack, injected: Any) -> None:
    """C08: a client-supplied kv_transfer_params (anything but null or {}) is refused before any leg."""
    assert_error(post(stack, CHAT, chat_body(kv_transfer_params=injected)), 400, "reserved_request_field")
    assert_no_leg_ran(stack)


@pytest.mark.parametrize("tolerated", [None, {}], ids=["null", "empty"])
def test_c08_null_or_empty_client_handoff_is_replaced(stack: Stack, tolerated: Any) -> None:
    """C08: null and {} count as absent: prefill gets the producer params, decode the real handoff."""
    assert post(stack, CHAT, chat_body(kv_transfer_params=tolerated, max_tokens=2)).status_code == 200
    prefill = only(stack.prefill.requests())
    assert prefill["json"]["kv_transfer_params"] == PRODUCER
    decode_raw = stack.decode.raw_body(only(stack.decode.requests())["seq"])
    assert decode_raw.count(b'"kv_transfer_params"') == 1
    assert json.loads(decode_raw)["kv_transfer_params"] == prefill["notes"]["kv_transfer_params"]


# --- C09-C15: the handoff -----------------------------------------------------------------------


@pytest.mark.parametrize("behaviour,code", [
    ({"omit_kv_transfer_params": True}, "invalid_prefill_handoff"),
    ({"kv_transfer_params": None}, "invalid_prefill_handoff"),
    ({"kv_transfer_params": "remote"}, "invalid_prefill_handoff"),
    ({"raw_body": "[1, 2]"}, "prefill_response_not_json"),
], ids=["missing", "null", "string", "top-level-array"])
def test_c09_missing_null_or_non_object_handoff_never_reaches_decode(
        stack: Stack, behaviour: dict[str, Any], code: str) -> None:
    """C09: no usable handoff object means 502 and no decode leg."""
    stack.prefill.script(behaviour)
    assert_error(post(stack, CHAT, chat_body()), 502, code)
    assert len(stack.prefill.requests()) == 1
    assert stack.decode.requests() == [], "the decode leg must not run"


C10_CASES: list[tuple[str, dict[str, Any]]] = [
    (f"{field} is missing", {"kv_remove": [field]}) for field in (
        "do_remote_prefill", "do_remote_decode", "remote_block_ids", "remote_engine_id", "remote_request_id",
        "remote_host", "remote_port", "tp_size")
] + [
    ("do_remote_prefill is invalid", {"kv_set": {"do_remote_prefill": False}}),
    ("do_remote_decode is invalid", {"kv_set": {"do_remote_decode": True}}),
    ("remote_port is invalid", {"kv_set": {"remote_port": "5600"}}),
    ("remote_port is invalid", {"kv_set": {"remote_port": 0}}),
    ("remote_port is invalid", {"kv_set": {"remote_port": 65536}}),
    ("remote_port is invalid", {"kv_set": {"remote_port": True}}),
    ("tp_size is invalid", {"kv_set": {"tp_size": 0}}),
    ("pp_size is invalid", {"kv_set": {"pp_size": 2.0}}),
    ("remote_engine_id is invalid", {"kv_set": {"remote_engine_id": ""}}),
    ("remote_block_ids is invalid", {"kv_set": {"remote_block_ids": []}}),
    ("remote_block_ids is invalid", {"kv_set": {"remote_block_ids": [1, 2]}}),
    ("remote_block_ids is invalid", {"kv_set": {"remote_block_ids": [["1"]]}}),
    ("remote_block_ids is invalid", {"kv_set": {"remote_block_ids": [[-1]]}}),
    ("transfer_mode is invalid", {"kv_set": {"transfer_mode": "push"}}),
]


@pytest.mark.parametrize("reason,behaviour", C10_CASES, ids=[f"{r}:{b}" for r, b in C10_CASES])
def test_c10_field_level_handoff_errors_never_reach_decode(
        stack: Stack, reason: str, behaviour: dict[str, Any]) -> None:
    """C10: each required field missing, wrong type, bad port or wrong flag: 502 naming the field, no decode."""
    stack.prefill.script(behaviour)
    error = assert_error(post(stack, CHAT, chat_body()), 502, "invalid_prefill_handoff")
    assert error["param"] == f"kv_transfer_params.{reason}"
    assert stack.decode.requests() == [], "the decode leg must not run"


def test_c11_nested_block_groups_are_preserved(stack: Stack) -> None:
    """C11: remote_block_ids keeps its per-group nesting all the way to decode (flattening mis-addresses KV)."""
    groups = [[1, 2], [3], [4, 5, 6]]
    stack.prefill.script({"kv_set": {"remote_block_ids": groups}})
    assert post(stack, CHAT, chat_body(max_tokens=2)).status_code == 200
    decode = only(stack.decode.requests())
    assert decode["json"]["kv_transfer_params"]["remote_block_ids"] == groups
    assert decode["notes"]["load"] == "ok"


@pytest.mark.parametrize("groups", [[[]], [[], []]], ids=["one-empty-group", "two-empty-groups"])
def test_c12_legally_empty_block_groups_are_not_a_missing_handoff(stack: Stack, groups: Any) -> None:
    """C12: groups present but empty is a valid handoff (a full prefix hit on decode still notifies prefill)."""
    stack.prefill.script({"kv_set": {"remote_block_ids": groups}})
    assert post(stack, CHAT, chat_body(max_tokens=2)).status_code == 200
    assert only(stack.decode.requests())["json"]["kv_transfer_params"]["remote_block_ids"] == groups


def test_c13_extra_handoff_fields_reach_decode_intact(stack: Stack) -> None:
    """C13: unknown and newer connector fields travel verbatim, with their JSON types."""
    extra = {"remote_registration_generation": 3, "future_field": {"nested": [1, 2.5, "x", None]},
             "remote_blocks_expiry_time": 12.0}
    stack.prefill.script({"kv_set": extra})
    assert post(stack, CHAT, chat_body(max_tokens=2)).status_code == 200
    decode = only(stack.decode.requests())
    raw = stack.decode.raw_body(decode["seq"])
    assert b'"remote_blocks_expiry_time":12.0' in raw, "a float stays a float"
    assert b'"remote_registration_generation":3' in raw, "an int stays an int"
    params = decode["json"]["kv_transfer_params"]
    assert {k: params[k] for k in extra} == extra


def test_c14_remote_request_id_is_forwarded_unchanged(stack: Stack) -> None:
    """C14: the connector's remote_request_id is never rewritten to match the HTTP request id."""
    post(stack, CHAT, chat_body(max_tokens=2), **{"x-request-id": "11111111-2222-3333-4444-555555555555"})
    issued = only(stack.prefill.requests())["notes"]["remote_request_id"]
    decode = only(stack.decode.requests())
    assert decode["json"]["kv_transfer_params"]["remote_request_id"] == issued
    assert issued != "11111111-2222-3333-4444-555555555555"


@pytest.fixture(scope="module")
def trap_stack() -> Any:
    workers = (WorkerSpec("prefill", "prefill"), WorkerSpec("decode", "decode"), WorkerSpec("trap", "decode"))
    with running_stack(workers=workers) as stack:
        yield stack


def test_c15_remote_host_and_port_do_not_change_the_decode_destination(trap_stack: Stack) -> None:
    """C15: a handoff naming another host:port (side-channel data) never becomes the HTTP destination."""
    trap_stack.reset()
    trap = trap_stack.workers["trap"]
    host, port = trap.address.rsplit(":", 1)
    trap_stack.prefill.script({"kv_set": {"remote_host": host, "remote_port": int(port)}})
    post(trap_stack, CHAT, chat_body(max_tokens=2))
    assert [r["target"] for r in trap.requests() if r["target"].startswith("/v1/")] == []
    decode = only(trap_stack.decode.requests())
    assert decode["json"]["kv_transfer_params"]["remote_port"] == int(port)


# --- bad input ----------------------------------------------------------------------------------


@pytest.mark.parametrize("raw,content_type,status,code", [
    (b"not json", "application/json", 400, "invalid_request_body"),
    (b'["a list"]', "application/json", 400, "invalid_request_body"),
    (b'{"model": "m", "messages": [{"role": "user", "content": "x"}]', "application/json", 400,
     "invalid_request_body"),
    (b"\xff\xfe{}", "application/json", 400, "invalid_request_body"),
    (b'{"messages": [{"role": "user", "content": "x"}], "n": 1, "n": 2}', "application/json", 400,
     "invalid_request_body"),
    (json.dumps(chat_body()).encode(), "text/plain", 415, "unsupported_media_type"),
    (json.dumps(chat_body()).encode(), "application/x-www-form-urlencoded", 415, "unsupported_media_type"),
    (json.dumps(chat_body(stream="yes")).encode(), "application/json", 400, "invalid_request_field"),
    (json.dumps(chat_body(max_tokens=0)).encode(), "application/json", 400, "invalid_request_field"),
    (json.dumps({"model": "m", "messages": []}).encode(), "application/json", 400, "invalid_request_field"),
], ids=["not-json", "array", "truncated", "bad-utf8", "duplicate-key", "text-plain", "form", "stream-type",
        "max-tokens-zero", "no-messages"])
def test_bad_request_bodies_get_a_documented_error_and_no_leg_runs(
        stack: Stack, raw: bytes, content_type: str, status: int, code: str) -> None:
    """Bad input: a documented 4xx in the OpenAI error shape; neither leg runs."""
    with stack.client() as client:
        response = client.post(CHAT, content=raw, headers=stack.pd_headers(**{"content-type": content_type}))
    assert_error(response, status, code)
    assert_no_leg_ran(stack)


def test_batch_completion_prompts_are_refused_before_any_leg(stack: Stack) -> None:
    """vLLM returns a handoff for the first prompt of a batch only, so a batch cannot be disaggregated."""
    error = assert_error(post(stack, COMPLETIONS, completion_body(prompt=["a", "b"])), 400, "unsupported_pd_variant")
    assert error["param"] == "prompt"
    assert_no_leg_ran(stack)


@pytest.mark.parametrize("value", [
    "", "127.0.0.1", "127.0.0.1:", "127.0.0.1:0", "127.0.0.1:65536", "127.0.0.1:08000", "user@127.0.0.1:8000",
    "127.0.0.1:8000/v1", "127.0.0.1:8000?x=1", "127.0.0.1 :8000", "127.0.0.1:80 00", "127.0.0.1:8000,127.0.0.1:8001",
    "127.0.0.1%3A8000", "::1:8000", "[::1]", "[fe80::1%25eth0]:8000", "http://127.0.0.1:8000", "a_b.svc:80",
], ids=repr)
def test_malformed_prefill_header_is_refused_without_any_connection(stack: Stack, value: str) -> None:
    """Bad input: a malformed x-prefiller-host-port is a 400 and no leg runs (nothing is dialled)."""
    with stack.client() as client:
        response = client.post(CHAT, content=json.dumps(chat_body()),
                               headers={"content-type": "application/json", "x-prefiller-host-port": value})
    assert_error(response, 400, "invalid_prefill_target")
    assert_no_leg_ran(stack)


def test_repeated_prefill_header_is_refused(stack: Stack) -> None:
    """Bad input: two x-prefiller-host-port headers are one too many, even if equal."""
    with stack.client() as client:
        response = client.post(CHAT, content=json.dumps(chat_body()), headers=[
            ("content-type", "application/json"), ("x-prefiller-host-port", stack.prefill.address),
            ("x-prefiller-host-port", stack.prefill.address)])
    assert_error(response, 400, "invalid_prefill_target")
    assert_no_leg_ran(stack)


def test_post_without_a_body_is_refused(stack: Stack) -> None:
    """Bad input: a P/D POST with an empty body is a 400 from us, not a decode call without a handoff."""
    with stack.client() as client:
        response = client.post(CHAT, content=b"", headers=stack.pd_headers())
    assert_error(response, 400, "invalid_request_body")
    assert_no_leg_ran(stack)


def test_error_bodies_do_not_depend_on_input(stack: Stack) -> None:
    """Error messages are fixed phrases: two different bad inputs of one kind give identical bodies."""
    first = post(stack, CHAT, b'{"messages": [], "marker": "zq-first"}')
    second = post(stack, CHAT, b'{"messages": [], "marker": "zq-second-' + b"x" * 500 + b'"}')
    assert first.content == second.content
    assert hashlib.sha256(first.content).digest() == hashlib.sha256(second.content).digest()
