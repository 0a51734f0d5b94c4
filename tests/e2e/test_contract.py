"""The claims every adapter shares, one suite run over the three engines (each on its own emulated
workers, through a real Envoy and our server): the three paths, refusals before any leg with their
documented codes, the prefill leg's failures, and which headers each leg sees.

What each engine does beyond these (vLLM's C01-C30 matrix, SGLang's rendezvous and abort,
TensorRT-LLM's signing and direct answers) is in test_vllm_pd_contract.py, test_sglang_pd.py and
test_trtllm_pd.py.
"""

from __future__ import annotations

import json
import secrets
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from extproc.adapters import build_adapter, engines
from extproc.adapters.base import Demo, Disabled, Engine
from tests.harness import Stack, engine_workers, running_stack
from tests.helpers import (
    CHAT,
    COMPLETIONS,
    assert_error,
    assert_event_stream,
    assert_no_leg_ran,
    assert_served_by_decode,
    chat_body,
    closed_port,
    completion_body,
    envoy_histogram,
    envoy_logged,
    envoy_stats_settled,
    eventually,
    ext_proc_streams,
    only,
    post,
    stream,
)

pytestmark = pytest.mark.dataplane


@dataclass(frozen=True)
class EngineCase:
    adapter: str
    engine: str
    worker_args: tuple[str, ...] = ()
    demo: Demo = Demo()


# Emulator options the suite needs beyond an engine's demo: SGLang's emulated KV wait must outlast a
# loaded CI machine's slowest prefill in the failure cases.
EXTRA_WORKER_ARGS = {"sglang": ("--kv-timeout", "60s")}


def _case(engine: Engine) -> EngineCase:
    return EngineCase(engine.name, engine.engine, EXTRA_WORKER_ARGS.get(engine.engine, ()), engine.demo)


# Every registered engine, with the settings its demo declares (Engine.demo), as `up --demo` runs it.
CASES = [_case(engine) for engine in engines().values()]


@pytest.fixture(scope="module", params=CASES, ids=[case.adapter for case in CASES])
def engine_stack(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    case: EngineCase = request.param
    env = {"PD_EXTPROC_ADAPTER": case.adapter, **case.demo.env}
    args = case.worker_args
    if case.demo.key_setting:  # one shared key for our server and both workers, as `up --demo` makes it
        key = Path(tmp_path_factory.mktemp("key")) / "demo-shared.key"
        key.write_text(secrets.token_hex(32) + "\n")
        env[case.demo.key_setting] = str(key)
        args = (*args, case.demo.key_flag, str(key))
    with running_stack(env, engine_workers(case.engine, args)) as stack:
        yield stack


@pytest.fixture
def stack(engine_stack: Stack) -> Stack:
    return engine_stack.reset()


def reserved_field(stack: Stack) -> str:
    """A field the running adapter's route owns (its first reserved field)."""
    settings = stack.settings
    adapter = build_adapter(settings.adapter, settings.protocol, settings.engine_options)
    assert not isinstance(adapter, Disabled)
    return adapter.reserved_fields[0].name


# --- the paths -------------------------------------------------------------------------------------


def test_a_request_without_the_header_passes_through_without_calling_us(stack: Stack) -> None:
    raw = b'{"model": "emulated",  "prompt": "hi", "max_tokens": 3}'
    streams = ext_proc_streams(stack)
    with stack.client() as client:
        client.post(COMPLETIONS, content=raw, headers={"content-type": "application/json"})
    assert stack.decode.raw_body(only(stack.decode.requests())["seq"]) == raw, "decode gets the client's bytes"
    assert stack.prefill.requests() == [], "the prefill leg must not run"
    assert ext_proc_streams(stack) == streams, "our server must not be called"


@pytest.mark.parametrize("path,body", [(CHAT, chat_body(max_tokens=4)), (COMPLETIONS, completion_body(max_tokens=4))],
                         ids=["chat", "completions"])
def test_a_pd_request_runs_one_prefill_and_one_decode_leg(stack: Stack, path: str, body: dict[str, Any]) -> None:
    response = post(stack, path, body, **{"x-request-id": "0b1e2d3c-aaaa-bbbb-cccc-000000000002"})
    assert_served_by_decode(response)
    assert eventually(lambda: len(stack.prefill.requests()) == 1 and stack.prefill.requests()[0]["status"] == 200)
    prefill, decode = only(stack.prefill.requests()), only(stack.decode.requests())
    for leg in (prefill, decode):
        headers = dict(leg["headers"])
        assert "x-prefiller-host-port" not in headers, "the routing header reaches no engine"
        assert headers["x-request-id"] == "0b1e2d3c-aaaa-bbbb-cccc-000000000002", "one request id on both legs"
    assert prefill["json"]["stream"] is False, "the prefill leg is one JSON answer"
    for name, value in body.items():
        if name not in ("max_tokens", "prompt"):
            assert decode["json"][name] == value, f"decode keeps the client's {name}"


def test_routing_headers_each_leg_sees(stack: Stack) -> None:
    """The picker's headers reach no engine; a data-parallel rank is the decode engine's: decode
    keeps it, the prefill leg never carries it (its rank is its port)."""
    headers = {"x-encoder-hosts-ports": "10.0.0.2:8000,10.0.0.3:8000", "x-kv-cache-source-host-port": "10.0.0.4:8000",
               "x-data-parallel-rank": "0", "x-custom": "kept"}
    assert post(stack, CHAT, chat_body(max_tokens=3), **headers).status_code == 200
    assert eventually(lambda: len(stack.prefill.requests()) == 1)
    prefill, decode = dict(only(stack.prefill.requests())["headers"]), dict(only(stack.decode.requests())["headers"])
    for name in ("x-prefiller-host-port", "x-encoder-hosts-ports", "x-kv-cache-source-host-port"):
        assert name not in prefill and name not in decode, name
    assert "x-data-parallel-rank" not in prefill and decode["x-data-parallel-rank"] == "0"
    assert prefill["x-custom"] == decode["x-custom"] == "kept"


# --- refused before any leg ------------------------------------------------------------------------


def refusals(field: str) -> list[tuple[str, dict[str, str], bytes, int, str]]:
    value = {"forged": True}  # a value of the client's own: no tolerated value is an object with members
    return [
        ("n", {}, json.dumps(chat_body(n=2)).encode(), 400, "unsupported_pd_variant"),
        ("not-json", {}, b'{"model": ', 400, "invalid_request_body"),
        ("bad-field", {}, json.dumps(chat_body(max_tokens=0)).encode(), 400, "invalid_request_field"),
        ("reserved", {}, json.dumps(chat_body(**{field: value})).encode(), 400, "reserved_request_field"),
        ("bad-header", {"x-prefiller-host-port": "10.0.0.1:8000,10.0.0.2:8000"}, json.dumps(chat_body()).encode(),
         400, "invalid_prefill_target"),
        ("link-local", {"x-prefiller-host-port": "169.254.169.254:80"}, json.dumps(chat_body()).encode(),
         403, "prefill_target_forbidden"),
    ]


@pytest.mark.parametrize("kind", ["n", "not-json", "bad-field", "reserved", "bad-header", "link-local"])
def test_refusals_have_their_documented_code_and_no_leg_runs(stack: Stack, kind: str) -> None:
    name, headers, body, status, code = next(r for r in refusals(reserved_field(stack)) if r[0] == kind)
    error = assert_error(post(stack, CHAT, body, **headers), status, code)
    if name == "reserved":
        assert error["param"] == reserved_field(stack)
    assert_no_leg_ran(stack)


# --- the prefill leg fails ---------------------------------------------------------------------------


def test_an_unreachable_prefill_worker_is_502_whatever_the_engine(stack: Stack) -> None:
    response = post(stack, CHAT, chat_body(max_tokens=3), **{"x-prefiller-host-port": f"127.0.0.1:{closed_port()}"})
    assert_error(response, 502, "prefill_upstream_unavailable")
    assert stack.prefill.requests() == []


def test_a_prefill_error_status_keeps_its_status(stack: Stack) -> None:
    stack.prefill.script({"status": 503})
    assert_error(post(stack, COMPLETIONS, completion_body(max_tokens=3)), 503, "prefill_upstream_error")
    assert only(stack.prefill.requests())["status"] == 503


# --- Envoy times the P/D requests it served ------------------------------------------------------------


def pd_timings(stack: Stack) -> tuple[float, float]:
    """How many requests Envoy's P/D histograms hold: (time to first token, decode time)."""
    ttft = sum(count for count, _ in envoy_histogram(stack, "pd_time_to_first_token_ms").values())
    decode = sum(count for count, _ in envoy_histogram(stack, "pd_decode_ms").values())
    return ttft, decode


def test_envoy_times_first_token_of_pd_streams_and_every_pd_decode_leg(stack: Stack) -> None:
    """A P/D stream adds one TTFT and one decode observation, a P/D JSON answer one decode observation;
    a passthrough and a request refused before any leg add none. Each step is read once Envoy has
    logged its requests and merged its histograms since."""
    ids = [str(uuid.uuid4()) for _ in range(4)]
    envoy_stats_settled(stack)
    ttft, decode = pd_timings(stack)
    with stack.client() as client:
        client.post(COMPLETIONS, content=json.dumps(completion_body(max_tokens=2)),
                    headers={"content-type": "application/json", "x-request-id": ids[0]})
    assert_error(post(stack, CHAT, chat_body(n=2), **{"x-request-id": ids[1]}), 400, "unsupported_pd_variant")
    envoy_logged(stack, *ids[:2])
    envoy_stats_settled(stack)
    assert pd_timings(stack) == (ttft, decode), "a passthrough and a refusal are not P/D timings"
    response, _ = stream(stack, CHAT, chat_body(max_tokens=3, stream=True), **{"x-request-id": ids[2]})
    assert_event_stream(response)
    envoy_logged(stack, ids[2])
    envoy_stats_settled(stack)
    assert pd_timings(stack) == (ttft + 1, decode + 1)
    assert_served_by_decode(post(stack, COMPLETIONS, completion_body(max_tokens=3), **{"x-request-id": ids[3]}))
    envoy_logged(stack, ids[3])
    envoy_stats_settled(stack)
    assert pd_timings(stack) == (ttft + 1, decode + 2), "a JSON answer has a decode time and no TTFT"
    assert '{code="200"}' in envoy_histogram(stack, "pd_decode_ms"), "decode time is labelled by status"


# --- the client guard on the passthrough route (issue 23) ------------------------------------------

_JSON = {"content-type": "application/json"}
# Bodies that would make an engine connect where the client says or hold KV for it, each refused on
# the passthrough route of every engine's stack (the guard refuses the union: steering.py).
STEERING_BODIES = [
    ("vllm-ssrf", "kv_transfer_params", _JSON, completion_body(kv_transfer_params={
        "do_remote_prefill": True, "remote_host": "127.0.0.1", "remote_port": 9, "remote_engine_id": "e",
        "remote_block_ids": [[1]], "remote_request_id": "r"})),
    ("vllm-do-remote-decode", "kv_transfer_params", _JSON,
     completion_body(kv_transfer_params={"do_remote_decode": True})),
    ("vllm-xargs", "vllm_xargs.kv_transfer_params", _JSON, completion_body(vllm_xargs={"kv_transfer_params": "x"})),
    ("vllm-generate", "sampling_params.extra_args.kv_transfer_params", _JSON,
     {"token_ids": [1, 2], "sampling_params": {"extra_args": {"kv_transfer_params": {"do_remote_decode": True}}}}),
    ("sglang-bootstrap", "bootstrap_host", _JSON,
     chat_body(bootstrap_host="127.0.0.1", bootstrap_port=9, bootstrap_room=7)),
    ("sglang-list", "bootstrap_room", _JSON, completion_body(bootstrap_room=[7])),
    ("sglang-prefill-rank", "disagg_prefill_dp_rank", _JSON, chat_body(disagg_prefill_dp_rank=1)),
    ("sglang-vertex", "parameters.bootstrap_host", _JSON,
     {"instances": [{"text": "hi"}], "parameters": {"bootstrap_host": "127.0.0.1"}}),
    ("trtllm", "disaggregated_params", _JSON, chat_body(disaggregated_params={
        "request_type": "generation_only", "ctx_info_endpoint": "tcp://127.0.0.1:9"})),
    ("no-content-type", "kv_transfer_params", {}, completion_body(kv_transfer_params={"do_remote_decode": True})),
    ("json-with-parameters", "kv_transfer_params", {"content-type": "Application/JSON ; charset=utf-8"},
     completion_body(kv_transfer_params={"do_remote_decode": True})),
    ("vendor-json", "kv_transfer_params", {"content-type": "application/vnd.api+json"},
     completion_body(kv_transfer_params={"do_remote_decode": True})),
]


@pytest.mark.parametrize("case,param,headers,body", STEERING_BODIES, ids=[case[0] for case in STEERING_BODIES])
def test_passthrough_refuses_a_body_that_steers_the_engine(
        stack: Stack, case: str, param: str, headers: dict[str, str], body: dict[str, Any]) -> None:
    """No x-prefiller-host-port: Envoy alone refuses the body with the P/D route's 400; decode
    receives nothing (an SSRF body never makes it dial 127.0.0.1:9, a do_remote_decode body never
    makes it compute and lease KV)."""
    streams = ext_proc_streams(stack)
    with stack.client() as client:
        response = client.post("/v1/completions", content=json.dumps(body).encode(), headers=headers)
    error = assert_error(response, 400, "reserved_request_field")
    assert error["param"] == param
    assert_no_leg_ran(stack)
    assert ext_proc_streams(stack) == streams, "Envoy refused it alone"


@pytest.mark.parametrize("case,raw,headers,status,code", [
    ("escaped-key", b'{"prompt": "hi", "kv\\u005ftransfer_params": {"do_remote_decode": true}}', _JSON, 400,
     "reserved_request_field"),
    ("duplicate-key", b'{"prompt": "hi", "kv_transfer_params": null, "kv_transfer_params": {"do_remote_decode": true}}',
     _JSON, 400, "reserved_request_field"),
    ("python-whitespace", b'{"prompt": "hi", "kv_transfer_params": {"do_remote_decode": true}}',
     {"content-type": b"application/json\xa0"}, 400, "reserved_request_field"),
    ("utf-16", '{"prompt": "hi", "kv_transfer_params": {"do_remote_decode": true}}'.encode("utf-16"), _JSON, 400,
     "invalid_request_body"),
    ("two-content-types", b'{"prompt": "hi", "kv_transfer_params": {"do_remote_decode": true}}',
     [("content-type", "text/plain"), ("content-type", "application/json")], 415, "unsupported_media_type"),
], ids=["escaped-key", "duplicate-key", "python-whitespace", "utf-16", "two-content-types"])
def test_passthrough_guard_cannot_be_read_differently_from_the_engine(
        stack: Stack, case: str, raw: bytes, headers: Any, status: int, code: str) -> None:
    """CPython's json (what FastAPI runs) decodes escaped keys, keeps the last duplicate and reads UTF-16;
    email.message strips Python's whitespace (NBSP) from the media type; FastAPI takes the first content-type.
    The guard refuses each, and fails closed where it cannot follow."""
    with stack.client() as client:
        response = client.post("/v1/completions", content=raw, headers=headers)
    error = assert_error(response, status, code)
    if code == "reserved_request_field":
        assert error["param"] == "kv_transfer_params"
    assert_no_leg_ran(stack)


BOUNDARY = "pd-guard-form"
MULTIPART_FORM = (f"--{BOUNDARY}\r\nContent-Disposition: form-data; name=\"model\"\r\n\r\nemulated\r\n"
                  f"--{BOUNDARY}\r\nContent-Disposition: form-data; name=\"vllm_xargs\"\r\n\r\n"
                  '{"kv_transfer_params": "x"}\r\n'
                  f"--{BOUNDARY}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"a.wav\"\r\n"
                  f"Content-Type: audio/wav\r\n\r\nRIFF\x00\x00\x00\x00WAVE\r\n--{BOUNDARY}--\r\n").encode("latin-1")
UNINSPECTABLE_BODIES = [
    ("zstd", "x-body-compressed", {**_JSON, "x-body-compressed": "zstd"},
     b'{"prompt": "hi", "kv_transfer_params": {"do_remote_decode": true}}'),
    ("multipart-xargs", "vllm_xargs", {"content-type": f"multipart/form-data; boundary={BOUNDARY}"}, MULTIPART_FORM),
    ("urlencoded-xargs", "vllm_xargs", {"content-type": "application/x-www-form-urlencoded"},
     b"model=emulated&vllm%5Fxargs=%7B%22kv_transfer_params%22%3A%22x%22%7D"),
    ("multipart-charset", "content-type", {"content-type": f"multipart/form-data; boundary={BOUNDARY}; charset=cp500"},
     MULTIPART_FORM.replace(b"vllm_xargs", b"language")),
]


@pytest.mark.parametrize("case,param,headers,raw", UNINSPECTABLE_BODIES, ids=[case[0] for case in UNINSPECTABLE_BODIES])
def test_passthrough_refuses_a_body_the_engine_would_read_otherwise(
        stack: Stack, case: str, param: str, headers: dict[str, str], raw: bytes) -> None:
    """What the guard cannot read as the engine would (SGLang's zstd decompression; vLLM's vllm_xargs form
    field, decoded as JSON; a multipart charset that changes how field names are decoded): refused, no leg."""
    with stack.client() as client:
        response = client.post("/v1/audio/transcriptions", content=raw, headers=headers)
    assert assert_error(response, 415, "uninspectable_request_body")["param"] == param
    assert_no_leg_ran(stack)


LEGITIMATE_BODIES = [
    ("plain", b'{"model": "emulated", "prompt": "hi", "max_tokens": 2}', _JSON),
    ("names-inside-strings", b'{"model": "emulated", "prompt": "\\"kv_transfer_params\\": {\\"remote_host\\": 1}, '
                             b'bootstrap_host", "max_tokens": 2}', _JSON),
    ("escapes", b'{"model": "emulated", "prompt": "\\u00e9t\\u00e9 \\ud83d\\ude00 \\n\\t\\u0041", "max_tokens": 2}',
     _JSON),
    ("null-and-empty", b'{"model": "emulated", "prompt": "hi", "kv_transfer_params": {}, "bootstrap_room": null,'
                       b' "max_tokens": 2}', _JSON),
    ("unwatched-nesting", b'{"model": "emulated", "prompt": "hi", "metadata": {"kv_transfer_params": {"a": 1}},'
                          b' "vllm_xargs": {"b": [1]}, "max_tokens": 2}', _JSON),
    ("not-json-for-the-engine", b'{"prompt": "hi", "kv_transfer_params": {"do_remote_decode": true}}',
     {"content-type": "text/plain"}),
    ("duplicate-key-last-null", b'{"model": "emulated", "prompt": "hi", "kv_transfer_params": {"do_remote_decode":'
                                b' true}, "kv_transfer_params": null, "max_tokens": 2}', _JSON),
    ("form-without-json-fields", MULTIPART_FORM.replace(b"vllm_xargs", b"language").replace(
        b'{"kv_transfer_params": "x"}', b"en"), {"content-type": f"multipart/form-data; boundary={BOUNDARY}"}),
    ("form-in-utf-8", MULTIPART_FORM.replace(b"vllm_xargs", b"language"),
     {"content-type": f"multipart/form-data; boundary={BOUNDARY}; charset=UTF-8"}),
]


@pytest.mark.parametrize("case,raw,headers", LEGITIMATE_BODIES, ids=[case[0] for case in LEGITIMATE_BODIES])
def test_passthrough_forwards_a_body_without_steering_byte_for_byte(
        stack: Stack, case: str, raw: bytes, headers: dict[str, str]) -> None:
    with stack.client() as client:
        client.post(COMPLETIONS, content=raw, headers=headers)
    assert stack.decode.raw_body(only(stack.decode.requests())["seq"]) == raw
    assert stack.prefill.requests() == []


STEERING_HEADERS = {"x-override-bootstrap-host": "127.0.0.1", "x-override-bootstrap-port": "9",
                    "x-override-bootstrap-room": "7", "x-override-disagg-prefill-dp-rank": "1",
                    "x-trtllm-disagg-auth": "sha256=00"}


def test_passthrough_strips_the_headers_that_steer_an_engine(stack: Stack) -> None:
    raw = b'{"model": "emulated", "prompt": "hi", "max_tokens": 2}'
    with stack.client() as client:
        client.post(COMPLETIONS, content=raw, headers={**_JSON, **STEERING_HEADERS, "x-override-priority": "1"})
    decode = only(stack.decode.requests())
    received = {name for name, _ in decode["headers"]}
    assert not received & STEERING_HEADERS.keys()
    assert "x-override-priority" in received, "other headers pass"
    assert stack.decode.raw_body(decode["seq"]) == raw


@pytest.mark.parametrize("field,value", [("vllm_xargs", {"kv_transfer_params": "x"}), ("ec_transfer_params", {"a": 1}),
                                         ("disagg_prefill_dp_rank", 1), ("bootstrap_pair_key", "k")])
def test_the_pd_route_refuses_every_engines_steering_fields_too(stack: Stack, field: str, value: Any) -> None:
    """Beyond the adapter's own reserved fields: what steers any engine is refused before any leg."""
    error = assert_error(post(stack, CHAT, chat_body(**{field: value})), 400, "reserved_request_field")
    assert error["param"] == (field if field != "vllm_xargs" else "vllm_xargs.kv_transfer_params")
    assert_no_leg_ran(stack)


def test_the_pd_route_keeps_the_steering_headers_from_both_legs(stack: Stack) -> None:
    """Whatever the adapter: a client's x-override-bootstrap-* or x-trtllm-disagg-auth reaches neither
    leg (the trtllm adapter signs decode's request with its own)."""
    assert post(stack, CHAT, chat_body(max_tokens=3), **STEERING_HEADERS).status_code == 200
    assert eventually(lambda: len(stack.prefill.requests()) == 1)
    prefill, decode = only(stack.prefill.requests()), only(stack.decode.requests())
    assert not {name for name, _ in prefill["headers"]} & STEERING_HEADERS.keys()
    received = dict(decode["headers"])
    assert not received.keys() & (STEERING_HEADERS.keys() - {"x-trtllm-disagg-auth"})
    assert received.get("x-trtllm-disagg-auth") != STEERING_HEADERS["x-trtllm-disagg-auth"]
