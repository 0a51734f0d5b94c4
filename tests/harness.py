"""End-to-end harness: a real Envoy, our server and emulated workers on loopback, ports chosen at runtime.

The stack is started by ``pd_extproc_lab.stack.start_stack`` (the same code ``pd-extproc up`` and the
benchmark use); every process binds port 0 and reports what it got, so no test ever assumes a port is
free. Logs stay in the harness directory and are printed only when a test fails (see conftest.py).
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

from extproc.config import load_settings
from extproc.protocol.units import parse_address
from pd_extproc_lab.emulator.worker import EmulatedWorker, WorkerSpec
from pd_extproc_lab.stack import RunningStack, start_stack

__all__ = ["REPO", "TEST_DEFAULTS", "Stack", "Worker", "WorkerSpec", "engine_workers", "envoy_bin", "log_tails",
           "running_stack"]

REPO = Path(__file__).resolve().parents[1]
READY_TIMEOUT = 90  # seconds a child may take to start on a loaded 2-core CI machine
# What an operator of this test "cluster" would configure: loopback workers are the allowed targets.
TEST_DEFAULTS = {
    "PD_EXTPROC_PREFILL_ALLOW": "127.0.0.0/8:*,[::1]/128:*",
    "PD_EXTPROC_METRICS_LISTEN": "127.0.0.1:0",
}
Worker = EmulatedWorker


def engine_workers(engine: str = "vllm", args: tuple[str, ...] = ()) -> tuple[WorkerSpec, WorkerSpec]:
    """An emulated prefill and decode worker of one engine, both with ``args``."""
    return (WorkerSpec("prefill", "prefill", engine=engine, args=args),
            WorkerSpec("decode", "decode", engine=engine, args=args))


DEFAULT_WORKERS = engine_workers()


def log_tails(log_dir: Path) -> str:
    """The last 60 lines of every child's log in ``log_dir``, for a failed test's report."""
    parts = []
    for path in sorted(log_dir.glob("*.log")):
        text = path.read_text(errors="replace")
        parts.append(f"----- {path.name} (last 60 lines)\n" + "\n".join(text.splitlines()[-60:]))
    return "\n".join(parts)


def envoy_bin() -> str:
    configured = os.environ.get("PD_EXTPROC_ENVOY_BIN")
    if configured:
        return configured
    local = REPO / ".venv-envoy" / "bin" / "envoy"
    return str(local) if local.exists() else "envoy"


@dataclasses.dataclass
class Stack(RunningStack):
    """A running stack as a test uses it: the processes (RunningStack), plus clients and helpers."""

    @classmethod
    def of(cls, running: RunningStack) -> Stack:
        return cls(**{field.name: getattr(running, field.name) for field in dataclasses.fields(RunningStack)})

    @property
    def prefill(self) -> EmulatedWorker:
        return self.workers["prefill"]

    @property
    def decode(self) -> EmulatedWorker:
        return self.workers["decode"]

    def client(self, **kwargs: Any) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=kwargs.pop("timeout", 60), **kwargs)

    def pd_headers(self, prefill: EmulatedWorker | None = None, **extra: str) -> dict[str, str]:
        return {"content-type": "application/json",
                "x-prefiller-host-port": (prefill or self.prefill).address, **extra}

    def reset(self) -> Stack:
        """Clear every worker's records and script; the stack itself, for fixtures."""
        for worker in self.workers.values():
            worker.reset()
        return self

    def logs(self) -> str:
        return log_tails(self.log_dir)

    def server_log(self) -> str:
        assert self.server is not None
        return str(self.server.log_path.read_text(errors="replace"))

    def start_server(self, ready_timeout: float = READY_TIMEOUT) -> None:
        super().start_server(ready_timeout)


@contextlib.contextmanager
def running_stack(env: Mapping[str, str] | None = None, workers: tuple[WorkerSpec, ...] = DEFAULT_WORKERS,
                  grpc_unix: bool = False,
                  env_from_workers: Callable[[Mapping[str, EmulatedWorker]], Mapping[str, str]] | None = None
                  ) -> Iterator[Stack]:
    """Start workers, then our server, then Envoy. Without a "decode" worker, PD_EXTPROC_DECODE from
    ``env`` is used as is."""
    log_dir = Path(tempfile.mkdtemp(prefix="pd-extproc-test-"))
    settings = load_settings({**TEST_DEFAULTS, "PD_EXTPROC_ENVOY_BIN": envoy_bin(), **(env or {})}, {})
    # Any free port, unless the test chose one (a stats listener needs a known admin port).
    given = env or {}
    picks = {name: parse_address("127.0.0.1:0", allow_port_zero=True)
             for name in ("grpc_listen", "listen", "envoy_admin") if f"PD_EXTPROC_{name.upper()}" not in given}
    settings = dataclasses.replace(settings, **picks)
    running = Stack.of(start_stack(settings, log_dir, workers=workers, env_from_workers=env_from_workers,
                                   grpc_unix=grpc_unix, ready_timeout=READY_TIMEOUT))
    try:
        yield running
    finally:
        running.stop()
        if os.environ.get("PD_TEST_KEEP_LOGS") is None:
            shutil.rmtree(log_dir, ignore_errors=True)
