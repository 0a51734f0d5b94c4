"""End-to-end harness: a real Envoy, our server and emulated workers on loopback, ports chosen at runtime.

Every process binds port 0 and reports what it got (``ready`` lines, Envoy's admin address file), so
no test ever assumes a port is free. Logs stay in the harness directory and are printed only when a
test fails (see conftest.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import httpx

from extproc import stack
from extproc.config import Settings, load_settings
from extproc.envoy_config import render_yaml
from extproc.units import parse_address

REPO = Path(__file__).resolve().parents[1]
READY_TIMEOUT = 90  # seconds a child may take to start on a loaded 2-core CI machine
# What an operator of this test "cluster" would configure: loopback workers are the allowed targets.
TEST_DEFAULTS = {
    "PD_EXTPROC_PREFILL_ALLOW": "127.0.0.0/8:*,[::1]/128:*",
    "PD_EXTPROC_METRICS_LISTEN": "127.0.0.1:0",
}


def envoy_bin() -> str:
    configured = os.environ.get("PD_EXTPROC_ENVOY_BIN")
    if configured:
        return configured
    local = REPO / ".venv-envoy" / "bin" / "envoy"
    return str(local) if local.exists() else "envoy"


@dataclasses.dataclass(frozen=True)
class WorkerSpec:
    name: str
    role: str
    extra: tuple[str, ...] = ()
    http_kwargs: Mapping[str, Any] = dataclasses.field(default_factory=dict)  # for the control client (TLS)
    engine: str = "vllm"  # pd-extproc emulate --engine


DEFAULT_WORKERS = (WorkerSpec("prefill", "prefill"), WorkerSpec("decode", "decode"))


class Worker:
    """An emulated engine process and a client for its /_emulator control endpoints."""

    def __init__(self, spec: WorkerSpec, log_dir: Path):
        self.name = spec.name
        self.http_kwargs = dict(spec.http_kwargs)
        listen = () if "--listen" in spec.extra else ("--listen", "127.0.0.1:0")
        self.child = stack.python_child(spec.name, [
            "emulate", "--engine", spec.engine, "--role", spec.role, *listen, "--worker-id", spec.name, *spec.extra,
        ], os.environ, log_dir)
        self.child.start()
        self.url = ""
        self.side_channel_port = 0

    def wait_ready(self) -> None:
        line = self.child.wait_ready(READY_TIMEOUT)
        self.http = httpx.Client(base_url=line.split()[1], timeout=30, **self.http_kwargs)
        self.url = line.split()[1]
        self.side_channel_port = int(line.split("side_channel=")[1])

    @property
    def address(self) -> str:
        return self.url.split("://", 1)[1]

    def reset(self) -> None:
        self.http.post("/_emulator/reset").raise_for_status()

    def script(self, *behaviours: dict[str, Any]) -> None:
        self.http.post("/_emulator/script", json={"behaviours": list(behaviours)}).raise_for_status()

    def requests(self) -> list[dict[str, Any]]:
        result: list[dict[str, Any]] = self.http.get("/_emulator/requests").json()
        return result

    def bodies(self) -> list[Any]:
        return [r["json"] for r in self.requests()]

    def raw_body(self, seq: int) -> bytes:
        return self.http.get(f"/_emulator/requests/{seq}/body").content

    def wait(self, outcome: str, count: int = 1, timeout: float = 15) -> bool:
        response = self.http.get("/_emulator/wait", params={"outcome": outcome, "count": count, "timeout": timeout},
                                 timeout=timeout + 5)
        return bool(response.status_code == 200)

    def metric(self, name: str) -> float:
        for line in self.http.get("/metrics").text.splitlines():
            if line.startswith(name + "{") or line.startswith(name + " "):
                return float(line.rsplit(" ", 1)[1])
        raise KeyError(name)

    def stop(self) -> None:
        if self.url:
            self.http.close()
        self.child.stop()


@dataclasses.dataclass
class Stack:
    """Envoy + pd-extproc serve + workers, started from Settings (ports forced to runtime picks)."""

    settings: Settings
    log_dir: Path
    workers: dict[str, Worker]
    server: stack.Child | None = None
    metrics_url: str = ""
    envoy: stack.EnvoyProcess | None = None
    url: str = ""

    @property
    def prefill(self) -> Worker:
        return self.workers["prefill"]

    @property
    def decode(self) -> Worker:
        return self.workers["decode"]

    def client(self, **kwargs: Any) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=kwargs.pop("timeout", 60), **kwargs)

    def pd_headers(self, prefill: Worker | None = None, **extra: str) -> dict[str, str]:
        return {"content-type": "application/json",
                "x-prefiller-host-port": (prefill or self.prefill).address, **extra}

    def start_server(self) -> None:
        self.server = stack.python_child("pd-extproc", ["serve"], {**os.environ, **stack.settings_env(self.settings)},
                                         self.log_dir)
        self.server.start()
        ready = self.server.wait_ready(READY_TIMEOUT).split()
        self.metrics_url = f"http://127.0.0.1:{ready[4]}"

    def reset(self) -> None:
        for worker in self.workers.values():
            worker.reset()

    def logs(self) -> str:
        parts = []
        for path in sorted(self.log_dir.glob("*.log")):
            text = path.read_text(errors="replace")
            parts.append(f"----- {path.name} (last 60 lines)\n" + "\n".join(text.splitlines()[-60:]))
        return "\n".join(parts)

    def server_log(self) -> str:
        return (self.log_dir / "pd-extproc.log").read_text(errors="replace")

    def stop(self) -> None:
        if self.envoy is not None:
            self.envoy.child.stop()
        if self.server is not None:
            self.server.stop()
        for worker in self.workers.values():
            worker.stop()




@contextlib.contextmanager
def running_stack(env: Mapping[str, str] | None = None, workers: tuple[WorkerSpec, ...] = DEFAULT_WORKERS,
                  grpc_unix: bool = False,
                  env_from_workers: Callable[[dict[str, Worker]], dict[str, str]] | None = None) -> Iterator[Stack]:
    """Start workers, then our server, then Envoy (that order: each needs the previous one's address).
    Without a "decode" worker, PD_EXTPROC_DECODE from ``env`` is used as is."""
    log_dir = Path(tempfile.mkdtemp(prefix="pd-extproc-test-"))
    settings = load_settings({**TEST_DEFAULTS, "PD_EXTPROC_ENVOY_BIN": envoy_bin(), **(env or {})}, {})
    running = Stack(settings, log_dir, {spec.name: Worker(spec, log_dir) for spec in workers})
    try:
        for worker in running.workers.values():
            worker.wait_ready()
        if env_from_workers is not None:
            settings = load_settings({**TEST_DEFAULTS, "PD_EXTPROC_ENVOY_BIN": envoy_bin(), **(env or {}),
                                      **env_from_workers(running.workers)}, {})
        grpc_listen = f"unix:{log_dir}/extproc.sock" if grpc_unix else "127.0.0.1:0"
        running.settings = dataclasses.replace(
            settings,
            decode=parse_address(running.workers["decode"].address) if "decode" in running.workers else settings.decode,
            grpc_listen=parse_address(grpc_listen, allow_unix=True, allow_port_zero=True),
            listen=parse_address("127.0.0.1:0", allow_port_zero=True),
            envoy_admin=parse_address("127.0.0.1:0", allow_port_zero=True),
        )
        running.start_server()
        assert running.server is not None
        if not grpc_unix:  # Envoy must dial the port the server actually bound
            bound = running.server.ready_line.split()[2]
            running.settings = dataclasses.replace(running.settings, grpc_listen=parse_address(bound))
        config = log_dir / "envoy.yaml"
        config.write_text(render_yaml(running.settings))
        running.envoy = stack.EnvoyProcess.launch(running.settings.envoy_bin, config, log_dir)
        running.url = "http://" + running.envoy.wait_ready(READY_TIMEOUT)
        yield running
    finally:
        running.stop()
        if os.environ.get("PD_TEST_KEEP_LOGS") is None:
            shutil.rmtree(log_dir, ignore_errors=True)
