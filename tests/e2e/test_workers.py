"""``serve --workers 2`` behind a real Envoy (docs/workers.md): Envoy spreads ext_proc streams over both
worker processes, one in-flight limit holds across them, the supervisor's /metrics counts every
worker's requests, SIGTERM drains them all, and a killed worker is replaced and serves again.

A claim about one worker is tested on that worker's own socket (an ext_proc stream opened by the test,
as Envoy opens them): Envoy's balancer picks endpoints at random, so a test that waits for it to reach
both would fail by chance. Envoy's own per-endpoint counters (admin /clusters) show its endpoints."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import grpc
import httpx
import pytest
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from tests.ext_proc_messages import body_message, error_of, exchange, headers_message
from tests.harness import TEST_DEFAULTS, Stack, running_stack
from tests.helpers import CHAT, assert_error, chat_body, eventually, post, scrape
from tests.ports import candidate

pytestmark = pytest.mark.dataplane

OK = 'pd_extproc_requests_total{adapter="vllm_nixl",outcome="ok"}'
OVERLOADED = 'pd_extproc_requests_total{adapter="vllm_nixl",outcome="pd_overloaded"}'
EXCHANGE_TIMEOUT = 60  # seconds: a bound for a test that went wrong, never reached by one that passes


@pytest.fixture(scope="module")
def workers_stack() -> Iterator[Stack]:
    with running_stack({"PD_EXTPROC_WORKERS": "2", "PD_EXTPROC_MAX_INFLIGHT": "1"}, grpc_unix=True) as stack:
        yield stack


def endpoint_stats(stack: Stack, stat: str) -> dict[str, str]:
    """Envoy's ``stat`` for each endpoint of the ext_proc cluster, by socket path."""
    assert stack.envoy is not None
    found = {}
    for line in stack.envoy.admin_get("/clusters").decode().splitlines():
        parts = line.split("::")
        if len(parts) == 4 and parts[0] == "pd_extproc" and parts[2] == stat:
            found[parts[1]] = parts[3]
    return found


def requests_per_worker(stack: Stack) -> dict[str, int]:
    return {host: int(value) for host, value in endpoint_stats(stack, "rq_total").items()}


def worker_sockets(stack: Stack) -> list[str]:
    base = stack.settings.grpc_listen.unix_path
    return [f"{base}-0", f"{base}-1"]


def worker_pids(stack: Stack) -> list[int]:
    assert stack.server is not None and stack.server.process is not None
    pid = stack.server.process.pid
    return sorted(int(child) for child in Path(f"/proc/{pid}/task/{pid}/children").read_text().split())


def accepts(path: str) -> bool:
    with socket.socket(socket.AF_UNIX) as probe:
        try:
            probe.connect(path)
        except OSError:
            return False
        return True


def draining_workers(stack: Stack) -> int:
    """Workers that logged the start of their drain (the supervisor logs its own under another logger)."""
    return sum(1 for line in stack.server_log().splitlines()
               if '"logger":"extproc.server"' in line and '"msg":"draining"' in line)


def count(samples: dict[str, float], name: str) -> float:
    return samples.get(name, 0.0)


def direct_exchange(socket_path: str, *messages: pb.ProcessingRequest) -> list[pb.ProcessingResponse]:
    """One ext_proc stream on one worker's own socket, as Envoy would open it: which worker answers is
    chosen here, not by Envoy's balancer."""
    async def run() -> list[pb.ProcessingResponse]:
        async with grpc.aio.insecure_channel(f"unix:{socket_path}") as channel:
            return await asyncio.wait_for(exchange(channel, *messages), EXCHANGE_TIMEOUT)

    return asyncio.run(run())


def pd_head(stack: Stack) -> pb.ProcessingRequest:
    return headers_message(CHAT, {"x-prefiller-host-port": stack.prefill.address})


def served_directly(stack: Stack, socket_path: str) -> None:
    """A whole P/D exchange on ``socket_path``: its prefill ran and the body went on to decode."""
    responses = direct_exchange(socket_path, pd_head(stack), body_message(chat_body(max_tokens=2)))
    assert [r.WhichOneof("response") for r in responses] == ["request_headers", "request_body"], responses
    body = json.loads(responses[1].request_body.response.body_mutation.body)
    assert body["kv_transfer_params"]["do_remote_prefill"] is True


def shed_directly(stack: Stack, socket_path: str) -> None:
    """A P/D head on ``socket_path`` is answered at once with our JSON 503 pd_overloaded."""
    responses = direct_exchange(socket_path, pd_head(stack))
    assert [error_of(r) for r in responses] == [(503, "pd_overloaded")], responses


def all_endpoints_healthy(stack: Stack) -> bool:
    return set(endpoint_stats(stack, "health_flags").values()) == {"healthy"}


def test_each_worker_serves_and_metrics_count_all_of_them(workers_stack: Stack) -> None:
    """Envoy's ext_proc cluster has one healthy endpoint per worker socket and counts every stream it
    opens; each worker serves a P/D request on its own socket; the supervisor's /metrics sums both.
    (How Envoy spreads streams over the endpoints is its balancer's choice, random by design: the
    test reaches each worker on purpose instead of hoping the dice reach both.)"""
    stack = workers_stack.reset()
    assert sorted(requests_per_worker(stack)) == worker_sockets(stack), "one endpoint per worker"
    assert eventually(lambda: all_endpoints_healthy(stack), within=30), endpoint_stats(stack, "health_flags")
    before, ok_before = requests_per_worker(stack), count(scrape(stack), OK)
    sent = 6
    for _ in range(sent):
        assert post(stack, CHAT, chat_body(max_tokens=2)).status_code == 200
    after = requests_per_worker(stack)
    assert sum(after[host] - before[host] for host in after) == sent, "every stream went to a worker socket"
    for socket_path in worker_sockets(stack):
        served_directly(stack, socket_path)
    assert eventually(lambda: count(scrape(stack), OK) == ok_before + sent + 2), \
        "the supervisor's /metrics sums both workers"
    assert len(stack.prefill.requests()) == sent + 2


def test_one_inflight_limit_across_both_workers(workers_stack: Stack) -> None:
    """Limit 1: while one P/D request holds the only slot (its prefill held until the test releases it),
    a P/D request on either worker's own socket is shed with the JSON 503 pd_overloaded, and so is one
    through Envoy; the held one then completes."""
    stack = workers_stack.reset()
    stack.prefill.script({"hold": True})
    overloaded_before = count(scrape(stack), OVERLOADED)
    with stack.client() as client, concurrent.futures.ThreadPoolExecutor(1) as pool:
        held = pool.submit(client.post, CHAT, json=chat_body(max_tokens=2), headers=stack.pd_headers())
        assert stack.prefill.wait("pending", 1), "the held request reached prefill"
        for socket_path in worker_sockets(stack):
            shed_directly(stack, socket_path)
        assert_error(post(stack, CHAT, chat_body()), 503, "pd_overloaded")
        assert stack.prefill.release() == 1
        assert held.result(timeout=EXCHANGE_TIMEOUT).status_code == 200
    assert count(scrape(stack), OVERLOADED) == overloaded_before + 3, "each shed request counted once"
    assert len(stack.prefill.requests()) == 1, "shed requests never reach prefill"


def test_a_killed_worker_is_replaced_and_serves_again(workers_stack: Stack) -> None:
    stack = workers_stack.reset()
    old = worker_pids(stack)
    assert len(old) == 2, old
    ok_before = count(scrape(stack), OK)  # both workers' pages as of now: the supervisor keeps the dead one's
    os.kill(old[0], signal.SIGKILL)
    assert eventually(lambda: len(worker_pids(stack)) == 2 and worker_pids(stack) != old, within=30), \
        "the supervisor starts a new worker"
    new = (set(worker_pids(stack)) - set(old)).pop()
    replaced = worker_sockets(stack)[0]
    assert eventually(lambda: accepts(replaced), within=30), "the new worker listens on the same socket"
    assert eventually(lambda: all_endpoints_healthy(stack), within=30), endpoint_stats(stack, "health_flags")
    served_directly(stack, replaced)
    assert post(stack, CHAT, chat_body(max_tokens=2)).status_code == 200
    assert eventually(lambda: count(scrape(stack), OK) == ok_before + 2), \
        "the new worker's count and the dead worker's both stay in the sum"
    assert new in worker_pids(stack)
    assert httpx.get(stack.metrics_url + "/readyz", timeout=10).status_code == 200


def test_sigterm_drains_every_worker_and_the_supervisor_exits_0() -> None:
    """SIGTERM mid-request: /readyz turns 503, the request in flight completes, every worker exits,
    and so does the supervisor, with status 0."""
    # The drain ends when the held request does; its timeout only bounds a test that went wrong.
    with running_stack({"PD_EXTPROC_WORKERS": "2", "PD_EXTPROC_DRAIN_TIMEOUT": "120s"}, grpc_unix=True) as stack:
        assert stack.server is not None and stack.server.process is not None
        supervisor = stack.server.process
        workers = worker_pids(stack)
        stack.prefill.script({"hold": True})

        async def run() -> tuple[httpx.Response, int]:
            async with httpx.AsyncClient(base_url=stack.url, timeout=30) as client:
                held = asyncio.ensure_future(client.post(CHAT, json=chat_body(max_tokens=2),
                                                         headers=stack.pd_headers()))
                assert await asyncio.to_thread(stack.prefill.wait, "pending", 1)
                supervisor.send_signal(signal.SIGTERM)
                ready = await asyncio.to_thread(
                    eventually, lambda: httpx.get(stack.metrics_url + "/readyz", timeout=5).status_code == 503)
                assert ready, "/readyz answers 503 while draining"
                assert await asyncio.to_thread(eventually, lambda: draining_workers(stack) == 2), stack.server_log()
                late = await client.post(CHAT, json=chat_body(max_tokens=2), headers=stack.pd_headers())
                assert_error(late, 503, late.json()["error"]["code"])
                assert late.json()["error"]["code"] in ("pd_shutting_down", "pd_extproc_unavailable")
                assert await asyncio.to_thread(stack.prefill.release) == 1
                return await held, await asyncio.to_thread(supervisor.wait, 60)

        held, status = asyncio.run(run())
        assert held.status_code == 200, held.text
        assert len(stack.prefill.requests()) == 1 and len(stack.decode.requests()) == 1, "the late one ran no leg"
        assert status == 0
        assert not any(Path(f"/proc/{pid}").exists() and "Z" not in Path(f"/proc/{pid}/stat").read_text().split()[2]
                       for pid in workers)


def test_the_decode_queue_is_read_once_and_sheds_on_every_worker() -> None:
    """Worker 0 reads the decode worker's queue; worker 1 sheds from the same reading (the shared
    block); the supervisor's /metrics shows the one reading. Each worker is reached on its own socket."""
    # 1 s: a scrape is bounded by the interval and a reading ages out after three (test_decode_queue.py).
    env = {"PD_EXTPROC_WORKERS": "2", "PD_EXTPROC_DECODE_QUEUE_LIMIT": "4", "PD_EXTPROC_DECODE_QUEUE_INTERVAL": "1s"}
    with running_stack(env, grpc_unix=True) as stack:
        assert stack.decode.call("POST", "/_emulator/gauges", {"vllm:num_requests_waiting": 9})[0] == 200
        assert eventually(lambda: scrape(stack).get("pd_extproc_decode_queue_waiting") == 9)
        for socket_path in worker_sockets(stack):
            shed_directly(stack, socket_path)
        assert_error(post(stack, CHAT, chat_body(max_tokens=2)), 503, "pd_overloaded")
        assert stack.prefill.requests() == [] and stack.decode.requests() == []
        assert stack.decode.call("POST", "/_emulator/gauges", {"vllm:num_requests_waiting": 0})[0] == 200
        assert eventually(lambda: scrape(stack).get("pd_extproc_decode_queue_waiting") == 0)
        assert post(stack, CHAT, chat_body(max_tokens=2)).status_code == 200


def serve(*args: str) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "extproc", "serve", *args], text=True, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env={**os.environ, **TEST_DEFAULTS})


def test_zero_workers_is_refused_with_a_clear_error() -> None:
    process = serve("--workers", "0")
    out, err = process.communicate(timeout=60)
    assert process.returncode == 2
    assert "--workers: expected a positive integer" in err and "ready" not in out


@contextlib.contextmanager
def taken_port_after_a_free_one() -> Iterator[int]:
    """A port something listens on, whose predecessor is free (worker 0's, so worker 1 is the one that fails);
    both below the ephemeral range, where no outgoing connection can take the free one (tests/ports.py)."""
    for _ in range(50):
        with socket.socket() as taken:
            try:
                taken.bind(("127.0.0.1", candidate()))
            except OSError:
                continue
            taken.listen(1)
            port: int = taken.getsockname()[1]
            with socket.socket() as probe:
                try:
                    probe.bind(("127.0.0.1", port - 1))
                except OSError:
                    continue
            yield port
            return
    pytest.fail("no taken port with a free predecessor in 50 tries")


def test_a_worker_that_cannot_listen_stops_the_supervisor() -> None:
    """Worker 1's port (grpc_listen + 1) is taken: the supervisor exits 1 with the worker's reason and
    never says ready; it does not restart a worker that never started."""
    with taken_port_after_a_free_one() as port:
        process = serve("--workers", "2", "--grpc-listen", f"127.0.0.1:{port - 1}", "--drain-timeout", "2s")
        out, err = process.communicate(timeout=60)
    assert process.returncode == 1
    assert f"worker 1: cannot listen on 127.0.0.1:{port} (grpc_listen)" in err and "Traceback" not in err
    assert "ready" not in out


def test_a_config_error_found_by_a_worker_exits_2_like_serve(tmp_path: Path) -> None:
    """A decode name that does not resolve is found while a worker builds its server: the supervisor
    exits 2 (a configuration error, as a single `serve` does) with the worker's message."""
    process = serve("--workers", "2", "--grpc-listen", f"unix:{tmp_path}/extproc.sock",
                    "--decode", "no-such-host.invalid:8200", "--drain-timeout", "2s")
    out, err = process.communicate(timeout=60)
    assert process.returncode == 2
    assert "the decode worker's name no-such-host.invalid does not resolve" in err and "Traceback" not in err
    assert "ready" not in out
