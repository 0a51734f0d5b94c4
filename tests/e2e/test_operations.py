"""Issue 6: metrics with exact values, trace context, one log line per request, admission, health
during drain, and Envoy's own timeout for a stuck ext_proc server."""

from __future__ import annotations

import asyncio
import http.server
import json
import signal
import threading
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from grpc_health.v1 import health as grpc_health
from grpc_health.v1 import health_pb2, health_pb2_grpc

from extproc.app import EXT_PROC_SERVICE
from extproc.config import load_settings
from extproc.envoy.bootstrap import render_yaml
from pd_extproc_lab import stack as stack_module
from tests.harness import TEST_DEFAULTS, Stack, envoy_bin, running_stack
from tests.helpers import (
    CHAT,
    assert_error,
    chat_body,
    envoy_histogram,
    envoy_logged,
    envoy_stats_settled,
    eventually,
    post,
    scrape,
    stream,
)
from tests.ports import unused_ports

pytestmark = pytest.mark.dataplane



@pytest.fixture(scope="module")
def ops_stack() -> Iterator[Stack]:
    with running_stack() as stack:
        yield stack


def test_metrics_count_a_known_mix_of_requests_exactly(ops_stack: Stack) -> None:
    """3 successes, 2 refused variants, 1 prefill 500 and 1 invalid handoff give exact counter values."""
    ops_stack.reset()
    for _ in range(3):
        assert post(ops_stack, CHAT, chat_body(max_tokens=2)).status_code == 200
    for _ in range(2):
        assert post(ops_stack, CHAT, chat_body(n=3)).status_code == 400
    ops_stack.prefill.script({"status": 500}, {"kv_set": {"remote_port": "x"}})
    assert post(ops_stack, CHAT, chat_body()).status_code == 500
    assert post(ops_stack, CHAT, chat_body()).status_code == 502
    samples = scrape(ops_stack)
    labels = 'adapter="vllm_nixl"'
    assert samples[f'pd_extproc_requests_total{{{labels},outcome="ok"}}'] == 3
    assert samples[f'pd_extproc_requests_total{{{labels},outcome="unsupported_pd_variant"}}'] == 2
    assert samples[f'pd_extproc_requests_total{{{labels},outcome="prefill_upstream_error"}}'] == 1
    assert samples[f'pd_extproc_requests_total{{{labels},outcome="invalid_prefill_handoff"}}'] == 1
    assert samples[f'pd_extproc_handoff_failures_total{{{labels},reason="remote_port_invalid"}}'] == 1
    assert samples[f'pd_extproc_prefill_seconds_count{{{labels},phase="total"}}'] == 5
    assert samples[f'pd_extproc_prefill_seconds_count{{{labels},phase="response"}}'] == 5
    assert samples[f'pd_extproc_prefill_seconds_count{{{labels},phase="connect"}}'] >= 1
    assert samples[f'pd_extproc_processing_seconds_count{{{labels}}}'] == 7
    assert samples[f'pd_extproc_request_body_bytes_count{{{labels}}}'] == 7
    assert samples[f'pd_extproc_prefill_response_bytes_count{{{labels}}}'] == 4
    assert samples["pd_extproc_inflight_requests"] == 0


def test_one_structured_log_line_per_request_without_bodies_or_secrets(ops_stack: Stack) -> None:
    ops_stack.reset()
    request_id = "5a1e0000-0000-4000-8000-00000000beef"
    post(ops_stack, CHAT, chat_body(max_tokens=2, messages=[{"role": "user", "content": "top secret prompt"}]),
         **{"x-request-id": request_id, "authorization": "Bearer sk-do-not-log"})
    assert eventually(lambda: request_id in ops_stack.server_log())  # written by the server's log thread
    lines = [json.loads(line) for line in ops_stack.server_log().splitlines()
             if line.startswith("{") and request_id in line]
    assert len(lines) == 1
    entry = lines[0]
    assert entry["msg"] == "pd_request" and entry["outcome"] == "ok" and entry["status"] == 200
    assert entry["prefill_status"] == 200 and entry["adapter"] == "vllm_nixl"
    assert entry["prefill_ms"] > 0 and entry["total_ms"] >= entry["prefill_ms"]
    log = ops_stack.server_log()
    assert "top secret prompt" not in log and "sk-do-not-log" not in log


def test_traceparent_reaches_the_prefill_worker_and_decode(ops_stack: Stack) -> None:
    ops_stack.reset()
    trace = {"traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01", "tracestate": "vendor=1"}
    assert post(ops_stack, CHAT, chat_body(max_tokens=2), **trace).status_code == 200
    for worker in (ops_stack.prefill, ops_stack.decode):
        headers = dict(worker.requests()[0]["headers"])
        assert {k: headers[k] for k in trace} == trace


def test_envoy_times_the_first_token_at_decodes_first_event_not_its_response_head(ops_stack: Stack) -> None:
    """Decode sends its response head at once and each SSE event 0.3 s apart (role, one token, [DONE]):
    Envoy's TTFT must include the wait for the first event, its decode time all three waits. Lower
    bounds the emulator causes, not speed: timed to the response head instead, TTFT would be a few ms."""
    ops_stack.reset()
    wait_ms = 300
    ops_stack.decode.script({"token_interval": wait_ms / 1000})

    def observed() -> tuple[tuple[float, float], tuple[float, float]]:
        return (envoy_histogram(ops_stack, "pd_time_to_first_token_ms").get("{}", (0.0, 0.0)),
                envoy_histogram(ops_stack, "pd_decode_ms").get('{code="200"}', (0.0, 0.0)))

    envoy_stats_settled(ops_stack)
    (ttft_count, ttft_sum), (decode_count, decode_sum) = observed()
    request_id = "5a1e0000-0000-4000-8000-00000000771f"
    response, _ = stream(ops_stack, CHAT, chat_body(max_tokens=1, stream=True), **{"x-request-id": request_id})
    assert response.status_code == 200
    envoy_logged(ops_stack, request_id)
    envoy_stats_settled(ops_stack)
    (ttft_after_count, ttft_after), (decode_after_count, decode_after) = observed()
    assert (ttft_after_count, decode_after_count) == (ttft_count + 1, decode_count + 1)
    # Envoy's histograms keep two significant digits: 0.95 leaves room for that rounding alone.
    assert ttft_after - ttft_sum >= 0.95 * wait_ms
    assert decode_after - decode_sum >= 0.95 * 3 * wait_ms


def test_the_stats_listener_serves_only_envoys_prometheus_page() -> None:
    """PD_EXTPROC_ENVOY_STATS_LISTEN: a scraper gets the P/D histograms without the admin port, and
    nothing else of the admin API (which could stop Envoy) is reachable through it."""
    stats_port, admin_port = unused_ports(2)
    env = {"PD_EXTPROC_ENVOY_STATS_LISTEN": f"127.0.0.1:{stats_port}",
           "PD_EXTPROC_ENVOY_ADMIN": f"127.0.0.1:{admin_port}"}
    with running_stack(env) as stack:
        request_id = "5a1e0000-0000-4000-8000-000000005747"
        assert post(stack, CHAT, chat_body(max_tokens=2), **{"x-request-id": request_id}).status_code == 200
        url = f"http://127.0.0.1:{stats_port}"
        envoy_logged(stack, request_id)
        envoy_stats_settled(stack)
        assert 'envoy_pd_decode_ms_count{code="200"} 1' in httpx.get(url + "/stats/prometheus", timeout=10).text
        # The decode engine's own page (its KV transfers among them), which it serves on loopback only.
        engine = httpx.get(url + "/engine/metrics", timeout=10)
        assert engine.status_code == 200 and "vllm:nixl_xfer_time_seconds_count{" in engine.text
        assert httpx.post(url + "/engine/metrics", timeout=10).status_code == 404
        assert httpx.post(url + "/quitquitquit", timeout=10).status_code == 404
        assert httpx.post(url + "/stats/prometheus", timeout=10).status_code == 404
        for path in ("/stats", "/config_dump", "/clusters", "/stats/prometheus?filter=.*&format=json",
                     "/stats/prometheus?usedonly"):
            assert httpx.get(url + path, timeout=10).status_code == 404, path
        assert stack.envoy is not None and stack.envoy.child.alive()
        assert post(stack, CHAT, chat_body(max_tokens=2)).status_code == 200


@pytest.fixture(scope="module")
def capped_stack() -> Iterator[Stack]:
    with running_stack({"PD_EXTPROC_MAX_INFLIGHT": "2"}) as stack:
        yield stack


async def hold_both_slots(stack: Stack, client: httpx.AsyncClient) -> list[asyncio.Future[httpx.Response]]:
    """Two P/D requests held at prefill until the test releases them: both admission slots taken."""
    stack.reset()
    stack.prefill.script({"hold": True}, {"hold": True})
    held = [asyncio.ensure_future(client.post(CHAT, json=chat_body(max_tokens=2), headers=stack.pd_headers()))
            for _ in range(2)]
    assert await asyncio.to_thread(stack.prefill.wait, "pending", 2)
    return held


def test_admission_cap_sheds_with_503(capped_stack: Stack) -> None:
    """With 2 requests holding both slots, every further P/D request gets an immediate 503
    pd_overloaded with Retry-After; the counter matches; the two held requests then succeed."""
    async def run() -> tuple[list[httpx.Response], list[httpx.Response]]:
        async with httpx.AsyncClient(base_url=capped_stack.url, timeout=30) as client:
            held = await hold_both_slots(capped_stack, client)
            shed = [await client.post(CHAT, json=chat_body(), headers=capped_stack.pd_headers()) for _ in range(3)]
            assert await asyncio.to_thread(capped_stack.prefill.release) == 2
            return list(await asyncio.gather(*held)), shed

    held, shed = asyncio.run(run())
    for response in shed:
        assert_error(response, 503, "pd_overloaded")
        assert response.headers["retry-after"] == "1"
    assert [r.status_code for r in held] == [200, 200], [r["notes"] for r in capped_stack.decode.requests()]
    assert scrape(capped_stack)['pd_extproc_requests_total{adapter="vllm_nixl",outcome="pd_overloaded"}'] == 3
    assert len(capped_stack.prefill.requests()) == 2, "shed requests never reach prefill"


def test_admission_cap_sheds_at_the_request_head_before_the_body_arrives(capped_stack: Stack) -> None:
    """Over the cap, a request is refused from its head alone: a client that sent only headers gets
    503 pd_overloaded, not the 408 it would get waiting for its body, and Envoy buffers nothing."""
    async def run() -> tuple[list[httpx.Response], bytes]:
        async with httpx.AsyncClient(base_url=capped_stack.url, timeout=30) as client:
            held = await hold_both_slots(capped_stack, client)
            host, port = capped_stack.url.removeprefix("http://").rsplit(":", 1)
            reader, writer = await asyncio.open_connection(host, int(port))
            prefill = capped_stack.pd_headers()["x-prefiller-host-port"]
            writer.write((f"POST {CHAT} HTTP/1.1\r\nhost: pd\r\ncontent-type: application/json\r\n"
                          f"content-length: 1000\r\nx-prefiller-host-port: {prefill}\r\n\r\n").encode())
            await writer.drain()
            head = await reader.readuntil(b"\r\n\r\n")
            length = int(next(line.split(b":", 1)[1] for line in head.split(b"\r\n")
                              if line.lower().startswith(b"content-length:")))
            reply = head + await reader.readexactly(length)
            writer.close()
            assert await asyncio.to_thread(capped_stack.prefill.release) == 2
            return list(await asyncio.gather(*held)), reply

    held, reply = asyncio.run(run())
    head, body = reply.split(b"\r\n\r\n", 1)
    assert head.startswith(b"HTTP/1.1 503 "), head
    assert json.loads(body)["error"]["code"] == "pd_overloaded"
    assert [r.status_code for r in held] == [200, 200]
    assert len(capped_stack.prefill.requests()) == 2


@pytest.fixture
def draining_stack() -> Iterator[Stack]:
    # The drain ends when the held request does; its timeout only bounds a test that went wrong.
    with running_stack({"PD_EXTPROC_DRAIN_TIMEOUT": "120s"}, grpc_unix=True) as stack:
        yield stack


def test_health_flips_as_soon_as_draining_starts(draining_stack: Stack) -> None:
    """gRPC health and /readyz are SERVING/200 before SIGTERM and NOT_SERVING/503 while an in-flight
    request drains; /healthz (liveness) stays 200."""
    server = draining_stack.server
    assert server is not None and server.process is not None
    target = draining_stack.settings.grpc_listen.grpc_target()

    channel = grpc.insecure_channel(target)

    def health() -> int:
        reply = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=EXT_PROC_SERVICE), timeout=5)
        return int(reply.status)

    assert health() == health_pb2.HealthCheckResponse.SERVING
    assert httpx.get(draining_stack.metrics_url + "/readyz").status_code == 200
    draining_stack.prefill.script({"hold": True})

    async def run() -> httpx.Response:
        async with httpx.AsyncClient(base_url=draining_stack.url, timeout=30) as client:
            inflight = asyncio.ensure_future(client.post(CHAT, json=chat_body(max_tokens=2),
                                                         headers=draining_stack.pd_headers()))
            assert await asyncio.to_thread(draining_stack.prefill.wait, "pending")
            assert server.process is not None
            server.process.send_signal(signal.SIGTERM)
            assert await asyncio.to_thread(eventually, lambda: _readyz(draining_stack) == 503)
            assert await asyncio.to_thread(health) == health_pb2.HealthCheckResponse.NOT_SERVING
            liveness = await client.get(draining_stack.metrics_url + "/healthz")
            assert liveness.status_code == 200
            assert await asyncio.to_thread(draining_stack.prefill.release) == 1
            return await inflight

    try:
        assert asyncio.run(run()).status_code == 200
    finally:
        channel.close()


def _readyz(stack: Stack) -> int:
    try:
        return httpx.get(stack.metrics_url + "/readyz", timeout=2).status_code
    except httpx.HTTPError:
        return 0



class SilentExtProc(pb_grpc.ExternalProcessorServicer):  # type: ignore[misc]
    """A broken ext_proc server: it continues the headers and never answers the body."""

    def __init__(self) -> None:
        self.release = threading.Event()

    def Process(self, request_iterator: Iterator[pb.ProcessingRequest], context: Any) -> Iterator[Any]:
        for request in request_iterator:
            if request.WhichOneof("request") == "request_headers":
                yield pb.ProcessingResponse(request_headers=pb.HeadersResponse())
            else:
                self.release.wait(30)
                return


def test_extproc_message_timeout_is_json_504(tmp_path: Path) -> None:
    """If an ext_proc server ever failed to answer within Envoy's message timeout, the client still
    gets our JSON shape: 504 pd_extproc_timeout (a healthy stand-in server that never answers the body)."""
    silent = SilentExtProc()
    grpc_server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    pb_grpc.add_ExternalProcessorServicer_to_server(silent, grpc_server)
    health = grpc_health.HealthServicer()
    health.set(EXT_PROC_SERVICE, health_pb2.HealthCheckResponse.SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(health, grpc_server)
    port = grpc_server.add_insecure_port("127.0.0.1:0")
    grpc_server.start()
    settings = load_settings({
        **TEST_DEFAULTS, "PD_EXTPROC_PREFILL_DEADLINE": "1s", "PD_EXTPROC_PREFILL_CONNECT_TIMEOUT": "500ms",
        "PD_EXTPROC_ENVOY_MESSAGE_TIMEOUT": "2100ms", "PD_EXTPROC_GRPC_LISTEN": f"127.0.0.1:{port}",
        "PD_EXTPROC_LISTEN": "127.0.0.1:0", "PD_EXTPROC_ENVOY_ADMIN": "127.0.0.1:0", "PD_EXTPROC_DECODE": "127.0.0.1:9",
    }, {})
    config = tmp_path / "envoy.yaml"
    config.write_text(render_yaml(settings))
    envoy = stack_module.EnvoyProcess.launch(envoy_bin(), config, tmp_path)
    try:
        listen = envoy.wait_ready(30)
        assert eventually(lambda: _extproc_healthy(envoy)), "the stand-in must pass Envoy's health check first"
        response = httpx.post(f"http://{listen}{CHAT}", json=chat_body(), timeout=30,
                              headers={"x-prefiller-host-port": "127.0.0.1:9"})
        assert_error(response, 504, "pd_extproc_timeout")
    finally:
        silent.release.set()
        envoy.child.stop()
        grpc_server.stop(0)


def _extproc_healthy(envoy: stack_module.EnvoyProcess) -> bool:
    clusters = json.loads(envoy.admin_get("/clusters?format=json"))
    for cluster in clusters["cluster_statuses"]:
        if cluster["name"] == "pd_extproc":
            statuses = cluster["host_statuses"][0]["health_status"]
            return statuses.get("eds_health_status") == "HEALTHY" and not statuses.get("failed_active_health_check")
    return False


class Collector:
    """A stand-in OTLP/HTTP collector that keeps every span it is sent."""

    def __init__(self) -> None:
        spans: list[dict[str, Any]] = []
        self.spans = spans

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["content-length"])))
                for resource in body["resourceSpans"]:
                    for scope in resource["scopeSpans"]:
                        spans.extend(scope["spans"])
                self.send_response(200)
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                return None

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.endpoint = f"http://127.0.0.1:{self.server.server_address[1]}/v1/traces"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def test_optional_spans_nest_under_the_client_trace_and_parent_the_prefill_leg(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """With PD_EXTPROC_TRACING=otlp: pd.request is a child of the client's span, pd.prefill a child of
    pd.request, and the prefill worker's traceparent names pd.prefill, all in the client's trace."""
    collector = Collector()
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "50")
    trace_id, client_span = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
    try:
        with running_stack({"PD_EXTPROC_TRACING": "otlp", "PD_EXTPROC_OTLP_ENDPOINT": collector.endpoint}) as stack:
            response = post(stack, CHAT, chat_body(max_tokens=2),
                            traceparent=f"00-{trace_id}-{client_span}-01")
            assert response.status_code == 200
            assert eventually(lambda: len(collector.spans) >= 2), "spans must reach the collector"
            prefill_parent = dict(stack.prefill.requests()[0]["headers"])["traceparent"].split("-")
    finally:
        collector.close()
    by_name = {span["name"]: span for span in collector.spans}
    request, prefill = by_name["pd.request"], by_name["pd.prefill"]
    assert request["traceId"] == prefill["traceId"] == prefill_parent[1] == trace_id
    assert request["parentSpanId"] == client_span
    assert prefill["parentSpanId"] == request["spanId"]
    assert prefill_parent[2] == prefill["spanId"]
    attributes = {a["key"]: a["value"] for a in request["attributes"]}
    assert attributes["pd.outcome"] == {"stringValue": "ok"}
