"""One running envoy/docker-compose.yaml project, driven the way README drives it.

The compose command is PD_COMPOSE (the Makefile sets podman-compose from .venv-compose for the
suite, and ``docker compose`` for `make compose-docker`) and the container CLI for the final
"nothing left" check is PD_CONTAINER_ENGINE (podman, or docker). Host ports are picked at runtime
and handed to the compose file through its PD_*_PORT variables; everything the tests observe goes
through those ports.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import socket
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from tests.compose.commands import DOWN, PORT_VARIABLES, Compose, Http
from tests.ports import unused_ports

REPO = Path(__file__).resolve().parents[2]
PROJECT = "pd-extproc"  # the compose file's `name`
PROJECT_LABEL = f"label=com.docker.compose.project={PROJECT}"  # set by docker compose and podman-compose
BUILD_TIMEOUT = 900.0  # a cold build on a busy 2-core machine
COMMAND_TIMEOUT = 120.0  # up/stop/down take seconds; `up` waits forever for a dependency that exited
READY_TIMEOUT = 120.0


def compose_command() -> tuple[str, ...]:
    configured = os.environ.get("PD_COMPOSE")
    if configured:
        return tuple(shlex.split(configured))
    local = REPO / ".venv-compose" / "bin" / "podman-compose"
    if not local.exists():
        raise RuntimeError("no compose command: run `make compose-tools` or set PD_COMPOSE (e.g. 'docker compose')")
    return (str(local),)


def container_engine() -> str:
    return os.environ.get("PD_CONTAINER_ENGINE", "podman")


def port_is_free(port: int) -> bool:
    with socket.socket() as probe:
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _text(output: str | bytes | None) -> str:
    """What a timed-out subprocess had printed (bytes even in text mode)."""
    return output.decode(errors="replace") if isinstance(output, bytes) else output or ""


def without_noise(output: str) -> str:
    """podman without systemd logs an error for every health check it cannot schedule: drop those."""
    return "\n".join(line for line in output.splitlines() if "systemd connection" not in line)


def poll(condition: Callable[[], bool], within: float, what: str) -> None:
    """Wait for ``condition`` (checked every 0.2 s) or fail naming ``what``."""
    deadline = time.monotonic() + within
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {within:.0f}s")
        time.sleep(0.2)


@dataclass(frozen=True, slots=True)
class Ran:
    argv: tuple[str, ...]
    seconds: float
    returncode: int
    output: str


@dataclass
class ComposeProject:
    engine: str  # PD_ENGINE: vllm, sglang or trtllm
    ports: dict[str, int] = field(default_factory=lambda: dict(zip(PORT_VARIABLES, unused_ports(len(PORT_VARIABLES)),
                                                                   strict=True)))
    compose: tuple[str, ...] = field(default_factory=compose_command)
    history: list[Ran] = field(default_factory=list)
    overrides: tuple[str, ...] = ()  # compose files merged over envoy/docker-compose.yaml (-f each)

    @property
    def env(self) -> dict[str, str]:
        variables = {PORT_VARIABLES[name]: str(port) for name, port in self.ports.items()}
        return {**os.environ, **variables, "PD_ENGINE": self.engine}

    def argv(self, step: Compose) -> tuple[str, ...]:
        files = [arg for override in self.overrides for arg in ("-f", override)]
        return (*self.compose, *step.argv[:2], *files, *step.argv[2:])

    def run(self, step: Compose, timeout: float = COMMAND_TIMEOUT, check: bool = True) -> Ran:
        argv = self.argv(step)
        started = time.monotonic()
        try:
            result = subprocess.run(argv, cwd=REPO, env=self.env, capture_output=True, text=True, timeout=timeout,
                                    check=False)
        except subprocess.TimeoutExpired as exc:
            output = without_noise(_text(exc.stdout) + _text(exc.stderr))
            raise AssertionError(f"{shlex.join(argv)} did not finish within {timeout:.0f}s:\n{output[-2000:]}\n"
                                 f"{self.logs()}") from None
        ran = Ran(argv, time.monotonic() - started, result.returncode, result.stdout + result.stderr)
        self.history.append(ran)
        if check and ran.returncode != 0:  # e.g. Docker's `up --wait` when a service exits: its log says why
            raise AssertionError(f"{shlex.join(argv)} exited {ran.returncode}:\n{without_noise(ran.output)[-4000:]}\n"
                                 f"{self.logs()}")
        return ran

    def url(self, port: str) -> str:
        return f"http://127.0.0.1:{self.ports[port]}"

    def send(self, step: Http, timeout: float = 30.0, **overrides: Any) -> httpx.Response:
        """The request README's curl line for ``step`` makes, to this project's ports."""
        body = overrides.pop("body", step.body)
        headers = overrides.pop("headers", dict(step.headers))
        return httpx.request(step.method, self.url(step.port) + step.path, headers=headers,
                             content=None if body is None else body.encode(), timeout=timeout, **overrides)

    # --- what the tests observe, through the published ports --------------------------------------

    def prefill(self) -> httpx.Client:
        return httpx.Client(base_url=self.url("prefill"), timeout=30)

    def decode(self) -> httpx.Client:
        """The decode worker, through Envoy's passthrough route (it listens on the pod's loopback only)."""
        return httpx.Client(base_url=self.url("http"), timeout=30)

    def reset_workers(self) -> None:
        for client in (self.prefill(), self.decode()):
            with client:
                client.post("/_emulator/reset").raise_for_status()

    def records(self, role: str) -> list[dict[str, Any]]:
        with self.prefill() if role == "prefill" else self.decode() as client:
            result: list[dict[str, Any]] = client.get("/_emulator/requests").json()
            return result

    def metric(self, port: str, name: str, labels: str = "") -> float:
        """One sample of a Prometheus exposition, 0 if absent (a counter that never moved)."""
        text = httpx.get(self.url(port) + "/metrics", timeout=10).text
        total = 0.0
        for line in text.splitlines():
            if line.startswith(name) and (line[len(name):].startswith(("{", " "))) and labels in line:
                total += float(line.rsplit(" ", 1)[1])
        return total

    def answers(self, port: str, path: str, status: int = 200) -> bool:
        with contextlib.suppress(httpx.HTTPError):
            return httpx.get(self.url(port) + path, timeout=2).status_code == status
        return False

    # --- the project's containers -------------------------------------------------------------------

    def containers(self) -> list[str]:
        """Every container of the project, running or not: ``NAME STATUS`` lines."""
        result = subprocess.run([container_engine(), "ps", "-a", "--filter", PROJECT_LABEL,
                                 "--format", "{{.Names}} {{.Status}}"], capture_output=True, text=True, timeout=60,
                                check=True)
        return [line for line in result.stdout.splitlines() if line.strip()]

    def networks(self) -> list[str]:
        result = subprocess.run([container_engine(), "network", "ls", "--format", "{{.Name}}"], capture_output=True,
                                text=True, timeout=60, check=True)
        return [name for name in result.stdout.split() if name.startswith(f"{PROJECT}_")]

    def logs(self) -> str:
        with contextlib.suppress(subprocess.SubprocessError, OSError):
            ps = subprocess.run([container_engine(), "ps", "-a", "--filter", PROJECT_LABEL], capture_output=True,
                                text=True, timeout=60, check=False).stdout
            logs = subprocess.run(self.argv(Compose(("logs", "--no-color", "--tail", "30"))), cwd=REPO,
                                  env=self.env, capture_output=True, text=True, timeout=60, check=False)
            return f"{ps}\n{without_noise(logs.stdout + logs.stderr)}"
        return "(no logs)"


@contextlib.contextmanager
def brought_up(project: ComposeProject, up: Compose) -> Iterator[ComposeProject]:
    """``up``, then wait until every leg answers; ``down`` at the end unless a test already did."""
    if project.containers():
        raise AssertionError(f"a {PROJECT} compose project exists already; bring it down first: "
                             f"{project.containers()}")
    try:
        project.run(up)
        wait_until_serving(project)
        yield project
    finally:
        if project.containers():
            project.run(DOWN, check=False)


def refused_probe(project: ComposeProject) -> bool:
    """A P/D request to a target outside the allow-list: pd-extproc refuses it (403) without touching
    a worker, so once it is refused, Envoy reaches pd-extproc (until then Envoy answers 503)."""
    with contextlib.suppress(httpx.HTTPError):
        response = httpx.post(project.url("http") + "/v1/completions", json={"model": "emulated", "prompt": "x"},
                              headers={"x-prefiller-host-port": "172.28.0.10:9"}, timeout=5)
        return response.status_code == 403
    return False


def exited(project: ComposeProject) -> list[str]:
    """Containers of the project that stopped (the compose file has no restart policy)."""
    return [line for line in project.containers() if line.split(" ", 1)[1].startswith("Exited")]


def wait_until_serving(project: ComposeProject) -> None:
    """Poll each leg until it answers; fail at once, with the logs, if a container exits meanwhile."""

    def serving(check: Callable[[], bool]) -> Callable[[], bool]:
        def condition() -> bool:
            if check():
                return True
            stopped = exited(project)
            if stopped:
                raise AssertionError(f"a container exited: {stopped}")  # the logs follow, below
            return False
        return condition

    checks: list[tuple[str, Callable[[], bool]]] = [
        ("pd-extproc /readyz", lambda: project.answers("metrics", "/readyz")),
        ("the prefill worker", lambda: project.answers("prefill", "/health")),
        ("Envoy -> decode (passthrough /health)", lambda: project.answers("http", "/health")),
        ("Envoy -> pd-extproc (a refused P/D request)", lambda: refused_probe(project)),
    ]
    deadline = time.monotonic() + READY_TIMEOUT
    for what, check in checks:
        try:
            poll(serving(check), max(1.0, deadline - time.monotonic()), what)
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n{project.logs()}") from None
