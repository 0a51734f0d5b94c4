"""``serve --workers 2`` behind a real Envoy (docs/workers.md): Envoy spreads ext_proc streams over both
worker processes, one in-flight limit holds across them, the supervisor's /metrics counts every
worker's requests, SIGTERM drains them all, and a killed worker is replaced and serves again.

Which worker a stream reached is read from Envoy's own per-endpoint counters (admin /clusters)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.harness import TEST_DEFAULTS, Stack, running_stack
from tests.helpers import CHAT, assert_error, chat_body, eventually, post, scrape

pytestmark = pytest.mark.dataplane

OK = 'pd_extproc_requests_total{adapter="vllm_nixl",outcome="ok"}'
OVERLOADED = 'pd_extproc_requests_total{adapter="vllm_nixl",outcome="pd_overloaded"}'


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


def test_streams_reach_both_workers_and_metrics_count_all_of_them(workers_stack: Stack) -> None:
    stack = workers_stack.reset()
    assert sorted(requests_per_worker(stack)) == worker_sockets(stack), "one endpoint per worker"
    before, ok_before = requests_per_worker(stack), count(scrape(stack), OK)
    sent = 20
    for _ in range(sent):
        assert post(stack, CHAT, chat_body(max_tokens=2)).status_code == 200
    after = requests_per_worker(stack)
    per_worker = {host: after[host] - before[host] for host in after}
    assert sum(per_worker.values()) == sent
    assert all(n > 0 for n in per_worker.values()), per_worker
    assert count(scrape(stack), OK) == ok_before + sent, "the supervisor's /metrics sums both workers"
    assert len(stack.prefill.requests()) == sent


def test_one_inflight_limit_across_both_workers(workers_stack: Stack) -> None:
    """Limit 1: while one P/D request holds the only slot (a slow prefill), every other P/D request is
    shed, on whichever worker it lands (each worker gets at least one: Envoy's counters say so)."""
    stack = workers_stack.reset()
    stack.prefill.script({"delay": 4})

    async def run() -> tuple[httpx.Response, list[httpx.Response], dict[str, int]]:
        async with httpx.AsyncClient(base_url=stack.url, timeout=30) as client:
            held = asyncio.ensure_future(client.post(CHAT, json=chat_body(max_tokens=2), headers=stack.pd_headers()))
            assert await asyncio.to_thread(stack.prefill.wait, "pending", 1)
            before = requests_per_worker(stack)
            shed: list[httpx.Response] = []
            while len(shed) < 12:
                shed.append(await client.post(CHAT, json=chat_body(), headers=stack.pd_headers()))
                after = requests_per_worker(stack)
                if len(shed) >= 4 and all(after[host] > before[host] for host in after):
                    break
            return await held, shed, {host: after[host] - before[host] for host in after}

    overloaded_before = count(scrape(stack), OVERLOADED)
    held, shed, per_worker = asyncio.run(run())
    assert held.status_code == 200, held.text
    for response in shed:
        assert_error(response, 503, "pd_overloaded")
    assert all(n > 0 for n in per_worker.values()), f"a shed request on each worker: {per_worker}"
    assert count(scrape(stack), OVERLOADED) == overloaded_before + len(shed)
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
    assert eventually(lambda: set(endpoint_stats(stack, "health_flags").values()) == {"healthy"}, within=30), \
        endpoint_stats(stack, "health_flags")
    before = requests_per_worker(stack)
    sent = 0
    while sent < 50:
        assert post(stack, CHAT, chat_body(max_tokens=2)).status_code == 200
        sent += 1
        if requests_per_worker(stack)[replaced] > before[replaced]:
            break
    assert requests_per_worker(stack)[replaced] > before[replaced], "the new worker serves"
    assert count(scrape(stack), OK) == ok_before + sent, "the dead worker's counts stay in the sum"
    assert new in worker_pids(stack)
    assert httpx.get(stack.metrics_url + "/readyz", timeout=10).status_code == 200


def test_sigterm_drains_every_worker_and_the_supervisor_exits_0() -> None:
    """SIGTERM mid-request: /readyz turns 503, the request in flight completes, every worker exits,
    and so does the supervisor, with status 0."""
    with running_stack({"PD_EXTPROC_WORKERS": "2", "PD_EXTPROC_DRAIN_TIMEOUT": "20s"}, grpc_unix=True) as stack:
        assert stack.server is not None and stack.server.process is not None
        supervisor = stack.server.process
        workers = worker_pids(stack)
        stack.prefill.script({"delay": 4})

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
                return await held, await asyncio.to_thread(supervisor.wait, 40)

        held, status = asyncio.run(run())
        assert held.status_code == 200, held.text
        assert len(stack.prefill.requests()) == 1 and len(stack.decode.requests()) == 1, "the late one ran no leg"
        assert status == 0
        assert not any(Path(f"/proc/{pid}").exists() and "Z" not in Path(f"/proc/{pid}/stat").read_text().split()[2]
                       for pid in workers)


def test_the_decode_queue_is_read_once_and_sheds_on_every_worker() -> None:
    """Worker 0 reads the decode worker's queue; worker 1 sheds from the same reading (the shared
    block); the supervisor's /metrics shows the one reading."""
    env = {"PD_EXTPROC_WORKERS": "2", "PD_EXTPROC_DECODE_QUEUE_LIMIT": "4", "PD_EXTPROC_DECODE_QUEUE_INTERVAL": "100ms"}
    with running_stack(env, grpc_unix=True) as stack:
        assert stack.decode.call("POST", "/_emulator/gauges", {"vllm:num_requests_waiting": 9})[0] == 200
        assert eventually(lambda: scrape(stack).get("pd_extproc_decode_queue_waiting") == 9)
        before = requests_per_worker(stack)
        shed: list[Any] = []
        while len(shed) < 40:
            shed.append(post(stack, CHAT, chat_body(max_tokens=2)))
            after = requests_per_worker(stack)
            if all(after[host] > before[host] for host in after):
                break
        assert all(after[host] > before[host] for host in after), (before, after)
        for response in shed:
            assert_error(response, 503, "pd_overloaded")
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
    """A port something listens on, whose predecessor is free (worker 0's, so worker 1 is the one that fails)."""
    for _ in range(50):
        with socket.socket() as taken:
            taken.bind(("127.0.0.1", 0))
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
