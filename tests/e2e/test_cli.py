"""The command line: `up` (ready line, demo P/D, errors, ordered shutdown) and refusing bad settings."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import IO

import httpx
import pytest

from extproc import ready
from tests.harness import TEST_DEFAULTS, envoy_bin

pytestmark = pytest.mark.dataplane
CHAT = "/v1/chat/completions"


def extproc(*args: str, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    environment = {**os.environ, "PD_EXTPROC_ENVOY_BIN": envoy_bin(), **(env or {})}
    return subprocess.Popen([sys.executable, "-m", "extproc", *args], text=True, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env=environment)


def children_of(pid: int) -> set[int]:
    found = set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            found.add(int(stat.parent.name))
    return found


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _lines_until(stream: IO[str], prefix: str) -> list[str]:
    """The lines read up to and including the first that starts with ``prefix`` (or up to the end)."""
    lines: list[str] = []
    while line := stream.readline():
        lines.append(line)
        if line.startswith(prefix):
            break
    return lines or [""]


@pytest.fixture
def demo() -> Iterator[tuple[subprocess.Popen[str], list[str]]]:
    # A drain that waits for a held request ends when the test releases it: the timeout is only a bound.
    process = extproc("up", "--demo", "--listen", "127.0.0.1:0", env={"PD_EXTPROC_DRAIN_TIMEOUT": "120s"})
    assert process.stdout is not None
    lines = [process.stdout.readline() for _ in range(5)]
    yield process, lines
    if process.poll() is None:
        process.send_signal(signal.SIGINT)
    process.communicate(timeout=60)


@pytest.mark.parametrize("stop_signal", [signal.SIGINT, signal.SIGTERM], ids=["sigint", "sigterm"])
def test_up_demo_serves_pd_and_stops_everything_in_order_on_a_signal(
        demo: tuple[subprocess.Popen[str], list[str]], stop_signal: signal.Signals) -> None:
    """`up --demo`: one `ready` line with the address and a working curl; a P/D request succeeds with a
    real (emulated) KV transfer; Ctrl-C (or SIGTERM, as from a supervisor) lets the in-flight request
    finish, then stops Envoy before our server and the workers, and leaves no process behind."""
    process, lines = demo
    banner = ready.parse(lines[0])
    url, prefill = banner["url"], banner["prefill"]
    assert url.startswith("http://127.0.0.1:"), lines
    assert f"x-prefiller-host-port: {prefill}" in lines[2] and f"{url}/v1/chat/completions" in lines[2]
    children = children_of(process.pid)
    assert len(children) == 4, "Envoy, the server and two emulated workers"
    assert process.stdout is not None
    with httpx.Client(timeout=120) as client:
        client.post(f"http://{prefill}/_emulator/script", json={"behaviours": [{"hold": True}]}).raise_for_status()
        with ThreadPoolExecutor(max_workers=2) as pool:
            inflight = pool.submit(client.post, f"{url}{CHAT}", headers={"x-prefiller-host-port": prefill},
                                   json={"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 4})
            waited = client.get(f"http://{prefill}/_emulator/wait", params={"outcome": "pending", "timeout": 60})
            assert waited.status_code == 200, waited.text
            process.send_signal(stop_signal)
            reader = pool.submit(_lines_until, process.stdout, "draining Envoy")
            try:
                before_drain = reader.result(timeout=60)
            except TimeoutError:
                process.kill()  # ends the blocked read, so the pool can close
                raise
            assert before_drain[-1].startswith("draining Envoy"), before_drain
            assert process.poll() is None and all(alive(pid) for pid in children), "stopped while draining"
            assert not inflight.done(), "the held request was answered before its release"
            released = client.post(f"http://{prefill}/_emulator/release")
            assert released.json() == {"released": 1}
            response = inflight.result(timeout=60)
            assert response.status_code == 200, "the in-flight request must finish"
            assert response.headers["x-emulator-worker"] == "emulated-decode"
    output, _ = process.communicate(timeout=60)
    assert process.returncode == 0
    stops = [line.split()[1] for line in output.splitlines() if line.startswith("stopped ")]
    assert stops == ["envoy", "pd-extproc-serve", "emulated-decode", "emulated-prefill"]
    assert not any(alive(pid) for pid in children)


def test_up_demo_counts_one_transfer_per_pd_request(demo: tuple[subprocess.Popen[str], list[str]]) -> None:
    _, lines = demo
    banner = ready.parse(lines[0])
    url, prefill = banner["url"], banner["prefill"]
    metrics_url = f"http://{banner['decode']}/metrics"
    assert metrics_url in lines[4], "the banner shows where decode's transfer counter is"
    with httpx.Client(timeout=30) as client:
        for stream in (False, True):
            response = client.post(f"{url}{CHAT}", headers={"x-prefiller-host-port": prefill},
                                   json={"messages": [{"role": "user", "content": "Hi"}], "stream": stream})
            assert response.status_code == 200
        count = [line for line in client.get(metrics_url).text.splitlines()
                 if line.startswith("vllm:nixl_xfer_time_seconds_count")]
    assert count and float(count[0].rsplit(" ", 1)[1]) == 2.0


# What each engine's emulated decode worker notes when it received the KV of a request.
KV_RECEIVED = {"vllm_nixl": ("load", "ok"), "sglang": ("transfer", "ok"), "trtllm": ("kv", "ok")}


@pytest.mark.parametrize("adapter", ["vllm_nixl", "sglang", "trtllm"])
def test_up_demo_runs_the_configured_engines_emulators(adapter: str) -> None:
    """`up --demo --adapter X` starts X's emulated workers (it used to start vLLM's whatever X was): chat
    requests with max_tokens and with max_completion_tokens, streaming and not, are served with a KV
    handoff each."""
    process = extproc("up", "--demo", "--adapter", adapter)
    assert process.stdout is not None
    try:
        banner = ready.parse(process.stdout.readline())
        url, prefill = banner["url"], banner["prefill"]
        bodies = [{"messages": [{"role": "user", "content": "Hello"}], limit: 4, "stream": stream}
                  for limit in ("max_tokens", "max_completion_tokens") for stream in (False, True)]
        with httpx.Client(timeout=60) as client:
            for body in bodies:
                response = client.post(f"{url}{CHAT}", headers={"x-prefiller-host-port": prefill}, json=body)
                assert response.status_code == 200, (body, response.text)
            decode = f"http://{banner['decode']}"
            assert client.get(f"{decode}/_emulator/info").json()["engine"] == adapter.split("_")[0]
            note, value = KV_RECEIVED[adapter]
            received = client.get(f"{decode}/_emulator/requests").json()
            assert [record["notes"].get(note) for record in received] == [value] * len(bodies)
    finally:
        process.send_signal(signal.SIGINT)
        process.communicate(timeout=60)
    assert process.returncode == 0


def test_up_demo_trtllm_context_worker_refuses_both_token_limit_names() -> None:
    """The demo's context emulator is as strict as trtllm-serve: one field, two names, both given -> 400."""
    process = extproc("up", "--demo", "--adapter", "trtllm")
    assert process.stdout is not None
    try:
        prefill = ready.parse(process.stdout.readline())["prefill"]
        body = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 1, "max_completion_tokens": 1}
        response = httpx.post(f"http://{prefill}{CHAT}", json=body, timeout=30)
        assert response.status_code == 400 and "extra_forbidden" in response.json()["error"]
    finally:
        process.send_signal(signal.SIGINT)
        process.communicate(timeout=60)


def test_up_refuses_a_port_that_is_taken() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        process = extproc("up", "--listen", f"127.0.0.1:{port}", "--decode", "127.0.0.1:9", env=TEST_DEFAULTS)
        _, err = process.communicate(timeout=60)
    assert process.returncode == 1
    assert f"127.0.0.1:{port} (listen) is already in use" in err


@pytest.mark.parametrize("command", ["serve", "up"])
def test_a_taken_metrics_port_is_one_clear_line(command: str) -> None:
    """It used to end in a traceback ("Event loop is closed") when 9190 was taken."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        envoy_listen = ["--listen", "127.0.0.1:0"] if command == "up" else []  # serve has no Envoy flags
        process = extproc(command, "--metrics-listen", f"127.0.0.1:{port}", "--grpc-listen", "127.0.0.1:0",
                          *envoy_listen, "--decode", "127.0.0.1:9", env=TEST_DEFAULTS)
        _, err = process.communicate(timeout=60)
    assert process.returncode == 1
    assert f"127.0.0.1:{port} (metrics_listen)" in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1, err


def test_up_says_clearly_when_envoy_is_missing() -> None:
    process = extproc("up", "--listen", "127.0.0.1:0", "--envoy-bin", "/nonexistent/envoy", env=TEST_DEFAULTS)
    _, err = process.communicate(timeout=60)
    assert process.returncode == 1
    assert "Envoy binary '/nonexistent/envoy' not found" in err


@pytest.mark.parametrize("args,env,message", [
    (["--prefill-deadline", "soon"], {}, "--prefill-deadline: expected a duration"),
    ([], {"PD_EXTPROC_ADAPTER": "tensorrt"}, "PD_EXTPROC_ADAPTER: expected one of"),
    ([], {"PD_EXTPROC_PROTOCOL": "vllm-0.10-nixl-pull"}, "does not implement protocol 'vllm-0.10-nixl-pull'"),
    ([], {"PD_EXTPROC_MAX_INFLIGHT": "-3"}, "PD_EXTPROC_MAX_INFLIGHT"),
    ([], {"PD_EXTPROC_GRPC_LISTN": "x"}, "PD_EXTPROC_GRPC_LISTN: unknown setting"),
], ids=["bad-duration", "unknown-adapter", "unknown-protocol-pin", "bad-number", "misspelt-variable"])
def test_serve_refuses_to_start_on_a_bad_setting(args: list[str], env: dict[str, str], message: str) -> None:
    process = extproc("serve", *args, env=env)
    out, err = process.communicate(timeout=60)
    assert process.returncode == 2
    assert message in err and "ready" not in out


def test_envoy_config_prints_the_rendered_bootstrap() -> None:
    process = extproc("envoy-config", "--decode", "10.1.2.3:8200", "--prefill-deadline", "30s")
    out, _ = process.communicate(timeout=60)
    assert process.returncode == 0
    assert "message_timeout: 35s" in out and "address: 10.1.2.3" in out


def test_up_deletes_its_folder_after_a_run(tmp_path: Path) -> None:
    """`up` used to leave its pd-extproc-up-* folder (logs, socket, demo key) behind on every run."""
    process = extproc("up", "--demo", "--listen", "127.0.0.1:0", env={"TMPDIR": str(tmp_path)})
    assert process.stdout is not None
    logs = Path(ready.parse(process.stdout.readline())["logs"])
    assert logs.parent == tmp_path and logs.name.startswith("pd-extproc-up-") and (logs / "envoy.log").exists()
    process.send_signal(signal.SIGINT)
    out, _ = process.communicate(timeout=60)
    assert process.returncode == 0
    assert list(tmp_path.iterdir()) == [], out


def test_up_deletes_its_folder_after_a_failed_start(tmp_path: Path) -> None:
    process = extproc("up", "--demo", "--listen", "127.0.0.1:0", "--envoy-bin", "/nonexistent/envoy",
                      env={"TMPDIR": str(tmp_path)})
    _, err = process.communicate(timeout=60)
    assert process.returncode == 1 and "not found" in err
    assert list(tmp_path.iterdir()) == []


def test_up_keeps_its_logs_when_asked_and_says_where(tmp_path: Path) -> None:
    process = extproc("up", "--demo", "--keep-logs", "--listen", "127.0.0.1:0", "--envoy-bin", "/nonexistent/envoy",
                      env={"TMPDIR": str(tmp_path)})
    out, _ = process.communicate(timeout=60)
    assert process.returncode == 1
    [kept] = tmp_path.iterdir()
    assert kept.name.startswith("pd-extproc-up-") and f"logs kept in {kept}" in out


def test_serve_warns_at_startup_when_the_address_settings_miss_the_pod_network() -> None:
    """The shipped 10.0.0.0/8 on a pod in 192.168/16: said in the log before the server is ready."""
    env = {"POD_IP": "192.168.7.12", "PD_EXTPROC_PREFILL_ALLOW": "10.0.0.0/8:8000",
           "PD_EXTPROC_TRUSTED_SOURCES": "10.0.0.0/8", "PD_EXTPROC_GRPC_LISTEN": "127.0.0.1:0",
           "PD_EXTPROC_METRICS_LISTEN": "127.0.0.1:0"}
    process = extproc("serve", env=env)
    assert process.stdout is not None
    assert ready.is_ready(process.stdout.readline())
    process.send_signal(signal.SIGTERM)
    _, err = process.communicate(timeout=60)
    assert "PD_EXTPROC_PREFILL_ALLOW (10.0.0.0/8) does not contain this pod's address 192.168.7.12" in err
    assert "PD_EXTPROC_TRUSTED_SOURCES (10.0.0.0/8) does not contain this pod's address 192.168.7.12" in err
