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
