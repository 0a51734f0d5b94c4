"""The compose stage: envoy/docker-compose.yaml, built from our Dockerfile and brought up with a real
container engine, checked only through the ports it publishes; once per engine (PD_ENGINE).

Each engine's project is brought up once for this module; the tests run in file order and the last
one stops Envoy (a drain) and brings the project down, as README does.
"""

from __future__ import annotations

import json
import re
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import httpx
import pytest

from tests.compose.commands import (
    DOWN,
    ENVOY_LOGS,
    PD_OUTCOMES,
    PD_REQUEST,
    PREFILL_LEGS,
    PREFILL_TARGET,
    READY,
    START_SERVER,
    STOP_ENVOY,
    STOP_SERVER,
    VLLM_DECODE_TRANSFERS,
    Compose,
)
from tests.compose.project import ComposeProject, Ran, poll, port_is_free, wait_until_serving

pytestmark = pytest.mark.compose

ADAPTERS = {"vllm": "vllm_nixl", "sglang": "sglang", "trtllm": "trtllm"}
# A decode worker's own answer to a plain request: SGLang's PD decode refuses one without a bootstrap room.
PASSTHROUGH_STATUS = {"vllm": 200, "sglang": 400, "trtllm": 200}
# The prefill worker holds the next request (a request in flight) until the test, having seen the drain
# begin (the server's /readyz; Envoy's runner's line in its log), releases it.
HELD_PREFILL = {"hold": True}
ENVOY_DRAINING = "pd-extproc envoy: draining Envoy"


def decode_transfers(stack: ComposeProject) -> float:
    """KV transfers the decode worker completed, as its engine reports them."""
    if stack.engine == "vllm":
        return stack.metric("http", VLLM_DECODE_TRANSFERS)
    if stack.engine == "sglang":
        return stack.metric("http", "emulator_kv_transfers_total")
    # trtllm-serve's /metrics is a JSON list of iteration stats: count the generation requests whose KV loaded
    return float(sum(r["notes"].get("kv") == "ok" for r in stack.records("decode")))


def ok_outcomes(stack: ComposeProject) -> float:
    return stack.metric("metrics", PD_OUTCOMES.grep or "", 'outcome="ok"')


def prefill_legs(stack: ComposeProject) -> float:
    return stack.metric("metrics", PREFILL_LEGS.grep or "", 'phase="total"')


def body(**changes: Any) -> str:
    return json.dumps({**json.loads(PD_REQUEST.body or "{}"), **changes})


def assert_error(response: httpx.Response, status: int, *codes: str) -> None:
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json")
    assert response.json()["error"]["code"] in codes, response.text


def sse_events(text: str) -> list[str]:
    return [block[len("data: "):] for block in text.split("\n\n") if block.startswith("data: ")]


def status_of(stack: ComposeProject, service: str) -> str:
    line = next(line for line in stack.containers() if re.search(rf"[_-]{service}[_-]1 ", line))
    return line.split(" ", 1)[1]


def in_flight(stack: ComposeProject, behaviour: dict[str, Any]) -> Future[httpx.Response]:
    """README's P/D request, sent in the background and held by the prefill worker (``behaviour``)."""
    with stack.prefill() as prefill:
        prefill.post("/_emulator/script", json={"behaviours": [behaviour]}).raise_for_status()
        executor = ThreadPoolExecutor(max_workers=1)
        future = executor.submit(stack.send, PD_REQUEST, 60.0)
        executor.shutdown(wait=False)
        waited = prefill.get("/_emulator/wait", params={"outcome": "pending", "count": 1, "timeout": 30}, timeout=40)
    assert waited.status_code == 200, "the P/D request never reached the prefill worker"
    return future


def run_in_background(stack: ComposeProject, step: Compose) -> Future[Ran]:
    executor = ThreadPoolExecutor(max_workers=1)
    future = executor.submit(stack.run, step)
    executor.shutdown(wait=False)
    return future


def assert_served_by_both_legs(stack: ComposeProject, response: httpx.Response) -> None:
    assert response.status_code == 200, response.text
    if not response.headers["content-type"].startswith("text/event-stream"):
        assert response.headers["x-emulator-worker"] == "decode"
    prefill, decode = stack.records("prefill"), stack.records("decode")
    assert [r["target"] for r in prefill] == [PD_REQUEST.path], "exactly one prefill leg"
    assert [r["target"] for r in decode] == [PD_REQUEST.path], "exactly one decode leg"


def test_pd_request_runs_prefill_then_decode_with_a_kv_transfer(stack: ComposeProject) -> None:
    """The install page's P/D request: both legs ran once; decode's transfer counter, pd-extproc's prefill
    legs and its ok count each moved by one."""
    transfers, ok, legs = decode_transfers(stack), ok_outcomes(stack), prefill_legs(stack)
    response = stack.send(PD_REQUEST)
    assert_served_by_both_legs(stack, response)
    choice = response.json()["choices"][0]
    assert choice["message"]["content"] and response.json()["usage"]["completion_tokens"] == 8
    assert decode_transfers(stack) == transfers + 1
    assert ok_outcomes(stack) == ok + 1
    assert prefill_legs(stack) == legs + 1


def test_streaming_pd_request_streams_from_decode(stack: ComposeProject) -> None:
    transfers = decode_transfers(stack)
    with httpx.Client(timeout=30) as client, client.stream(
            "POST", stack.url("http") + PD_REQUEST.path, headers=dict(PD_REQUEST.headers),
            content=body(stream=True).encode()) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        text = "".join(response.iter_text())
    events = sse_events(text)
    assert events[-1] == "[DONE]"
    deltas = [json.loads(e)["choices"][0]["delta"].get("content") for e in events[:-1] if json.loads(e)["choices"]]
    assert len([d for d in deltas if d]) > 1, "several content chunks"
    assert_served_by_both_legs(stack, response)
    assert decode_transfers(stack) == transfers + 1


def test_passthrough_request_goes_to_decode_alone(stack: ComposeProject) -> None:
    """No x-prefiller-host-port: Envoy proxies to decode, whose answer the client gets; no prefill leg,
    pd-extproc not called."""
    calls = stack.metric("metrics", "pd_extproc_requests_total")
    response = httpx.post(stack.url("http") + "/v1/completions", timeout=30,
                          json={"model": "emulated", "prompt": "Hello", "max_tokens": 4})
    assert response.status_code == PASSTHROUGH_STATUS[stack.engine], response.text
    if response.status_code == 200:
        assert response.json()["choices"][0]["text"]
    assert stack.records("prefill") == []
    assert [r["target"] for r in stack.records("decode")] == ["/v1/completions"]
    assert stack.metric("metrics", "pd_extproc_requests_total") == calls


def test_a_target_outside_the_allow_list_is_refused_before_any_leg(stack: ComposeProject) -> None:
    host = PREFILL_TARGET.rsplit(":", 1)[0]
    response = stack.send(PD_REQUEST, headers={**dict(PD_REQUEST.headers), "x-prefiller-host-port": f"{host}:8001"})
    assert_error(response, 403, "prefill_target_forbidden")
    assert stack.records("prefill") == [] and stack.records("decode") == []


def test_health_and_metrics_answer_on_the_published_ports(stack: ComposeProject) -> None:
    ready = stack.send(READY)
    assert ready.status_code == 200 and ready.json() == {"status": "ready"}
    assert httpx.get(stack.url("metrics") + "/healthz", timeout=10).status_code == 200
    metrics = httpx.get(stack.url("metrics") + "/metrics", timeout=10).text
    assert f'adapter="{ADAPTERS[stack.engine]}"' in metrics
    assert "pd_extproc_inflight_requests 0.0" in metrics
    assert httpx.get(stack.url("http") + "/health", timeout=10).status_code == 200  # Envoy -> decode


def test_stopping_pd_extproc_lets_the_request_in_flight_finish(stack: ComposeProject) -> None:
    """SIGTERM to the pd-extproc container: it leaves readiness, refuses new P/D requests, finishes
    the one in flight and exits 0; Envoy keeps serving passthrough traffic; `start` brings it back."""
    pending = in_flight(stack, HELD_PREFILL)
    stopping = run_in_background(stack, STOP_SERVER)
    poll(lambda: stack.answers("metrics", "/readyz", 503), 60, "/readyz 503 while draining")
    late = stack.send(PD_REQUEST)
    assert_error(late, 503, "pd_shutting_down", "pd_extproc_unavailable")
    with stack.prefill() as prefill:
        assert prefill.post("/_emulator/release").json() == {"released": 1}
    finished = pending.result(timeout=60)
    assert_served_by_both_legs(stack, finished)
    stopping.result(timeout=120)
    assert status_of(stack, "pd-extproc").startswith("Exited (0)")
    assert_error(stack.send(PD_REQUEST), 503, "pd_extproc_unavailable")  # Envoy alone: a JSON error, no decode
    assert httpx.get(stack.url("http") + "/health", timeout=10).status_code == 200
    stack.run(START_SERVER)
    wait_until_serving(stack)
    stack.reset_workers()
    assert_served_by_both_legs(stack, stack.send(PD_REQUEST))


def test_stopping_envoy_drains_and_down_leaves_nothing(stack: ComposeProject) -> None:
    """README's last two steps: `stop envoy` while a request is in flight (held until Envoy's runner says
    it drains; released, it finishes), then `down`: no container or network of the project is left and
    the published ports are free again."""
    pending = in_flight(stack, HELD_PREFILL)
    stopping = run_in_background(stack, STOP_ENVOY)
    poll(lambda: ENVOY_DRAINING in stack.run(ENVOY_LOGS).output, 60, "Envoy's runner says it drains")
    # Still running ("Up ..." under Docker, "Stopping ..." under podman while its stop is under way).
    assert not status_of(stack, "envoy").startswith("Exited"), "Envoy stopped with a request in flight"
    assert not pending.done(), "the held request was answered before its release"
    with stack.prefill() as prefill:
        assert prefill.post("/_emulator/release").json() == {"released": 1}
    finished = pending.result(timeout=60)
    stopped = stopping.result(timeout=120)
    assert finished.status_code == 200, finished.text
    assert finished.headers["x-emulator-worker"] == "decode"  # decode answered (Envoy, its window, is gone now)
    assert finished.json()["choices"][0]["message"]["content"]
    assert [r["target"] for r in stack.records("prefill")] == [PD_REQUEST.path]
    assert status_of(stack, "envoy").startswith("Exited (0)"), stopped.output
    stack.run(DOWN)
    assert stack.containers() == []
    assert stack.networks() == []
    assert all(port_is_free(port) for port in stack.ports.values())

