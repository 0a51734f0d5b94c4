"""A running emulated worker, as ``pd-extproc up --demo``, the tests and the benchmark see it: the
``pd-extproc emulate`` child process and a client for its /_emulator/* control endpoints.

The client is plain urllib (no test-only dependency), and every call has a timeout.
"""

from __future__ import annotations

import os
import ssl
import sys
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from extproc import ready
from extproc.protocol.prom_text import sample_values
from pd_extproc_lab.process import Child


@dataclass(frozen=True, slots=True)
class WorkerSpec:
    name: str  # also its worker id, log file name and key in a stack's workers
    role: str  # prefill | decode | both
    engine: str = "vllm"
    args: tuple[str, ...] = ()  # more `pd-extproc emulate` arguments (--listen, --lease, engine options)
    control_tls: ssl.SSLContext | None = field(default=None, compare=False)  # to reach an HTTPS worker


class ControlError(RuntimeError):
    """A control request failed; the message has the status and the worker's answer."""


class EmulatedWorker:
    def __init__(self, spec: WorkerSpec, log_dir: Path, env: Mapping[str, str] | None = None) -> None:
        self.spec = spec
        self.name = spec.name
        listen = () if "--listen" in spec.args else ("--listen", "127.0.0.1:0")
        self.child = Child(spec.name, [
            sys.executable, "-m", "extproc", "emulate", "--engine", spec.engine, "--role", spec.role, *listen,
            "--worker-id", spec.name, *spec.args,
        ], os.environ if env is None else env, log_dir)
        self.url = ""
        self.side_channel_port = 0

    def start(self) -> None:
        self.child.start()

    def wait_ready(self, timeout: float) -> None:
        line = ready.parse(self.child.wait_ready(timeout))
        self.url = line["url"]
        self.side_channel_port = int(line["side_channel"])

    @property
    def address(self) -> str:
        """``host:port`` of the worker's OpenAI listener (what x-prefiller-host-port carries)."""
        return self.url.split("://", 1)[1]

    def stop(self, timeout: float = 10.0) -> int | None:
        return self.child.stop(timeout)

    # --- the control API ---------------------------------------------------------------------------

    def call(self, method: str, path: str, payload: Any = None, query: Mapping[str, Any] | None = None,
             timeout: float = 30.0) -> tuple[int, bytes]:
        url = self.url + path + ("?" + urllib.parse.urlencode(query) if query else "")
        data = None if payload is None else orjson.dumps(payload)
        if not url.startswith(("http://", "https://")):
            raise ControlError(f"{self.name} is not running")
        request = urllib.request.Request(url, data=data, method=method,  # noqa: S310 (the scheme is checked)
                                         headers={"content-type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=timeout, context=self.spec.control_tls) as answer:  # noqa: S310
                return int(answer.status), bytes(answer.read())
        except urllib.error.HTTPError as error:
            return int(error.code), bytes(error.read())

    def _ok(self, method: str, path: str, payload: Any = None, **kwargs: Any) -> bytes:
        status, body = self.call(method, path, payload, **kwargs)
        if status != 200:
            raise ControlError(f"{self.name} {method} {path}: {status} {body[:300]!r}")
        return body

    def reset(self) -> None:
        self._ok("POST", "/_emulator/reset", {})

    def script(self, *behaviours: Mapping[str, Any]) -> None:
        """Queue one behaviour per next request; a behaviour key the emulator does not know is an error."""
        self._ok("POST", "/_emulator/script", {"behaviours": list(behaviours)})

    def release(self) -> int:
        """Let every request a ``hold`` behaviour holds go on; how many there were."""
        released: int = orjson.loads(self._ok("POST", "/_emulator/release", {}))["released"]
        return released

    def info(self) -> dict[str, Any]:
        result: dict[str, Any] = orjson.loads(self._ok("GET", "/_emulator/info"))
        return result

    def requests(self) -> list[dict[str, Any]]:
        result: list[dict[str, Any]] = orjson.loads(self._ok("GET", "/_emulator/requests"))
        return result

    def bodies(self) -> list[Any]:
        return [record["json"] for record in self.requests()]

    def raw_body(self, seq: int) -> bytes:
        return self._ok("GET", f"/_emulator/requests/{seq}/body")

    def wait(self, outcome: str, count: int = 1, timeout: float = 60) -> bool:
        """Block until ``count`` requests have ``outcome`` (pending, answered, disconnected, ...); the
        answer comes as soon as they do, so ``timeout`` only bounds a wait that fails."""
        status, _ = self.call("GET", "/_emulator/wait", query={"outcome": outcome, "count": count,
                                                               "timeout": timeout}, timeout=timeout + 5)
        return status == 200

    def metrics_text(self) -> str:
        return self._ok("GET", "/metrics").decode()

    def metric(self, name: str) -> float:
        """The first sample of ``name`` on the worker's metrics page."""
        for value in sample_values(self.metrics_text(), {name}):
            return value
        raise KeyError(name)


def start_workers(specs: Sequence[WorkerSpec], log_dir: Path, timeout: float,
                  env: Mapping[str, str] | None = None) -> dict[str, EmulatedWorker]:
    """Start every worker, then wait for each (they start in parallel). On a failure the ones started
    are stopped before the error propagates."""
    workers = {spec.name: EmulatedWorker(spec, log_dir, env) for spec in specs}
    try:
        for worker in workers.values():
            worker.start()
        for worker in workers.values():
            worker.wait_ready(timeout)
    except BaseException:
        for worker in workers.values():
            worker.stop()
        raise
    return workers
