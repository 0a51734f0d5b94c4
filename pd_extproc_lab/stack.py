"""One way to start a stack, used by ``pd-extproc up``, the end-to-end tests and the benchmark:
emulated workers (if any), then our server, then Envoy (each needs the previous one's address), every
port either configured or picked by the process that binds it and read back from its ready line.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from extproc import ready
from extproc.config import Settings, load_settings, specs
from extproc.envoy import runner as envoy_runner
from extproc.envoy.bootstrap import render_yaml
from extproc.protocol.settings_spec import ENV_PREFIX
from extproc.protocol.units import parse_address
from pd_extproc_lab.emulator.worker import EmulatedWorker, WorkerSpec, start_workers
from pd_extproc_lab.process import Child, EnvoyProcess, python_child

SERVER_NAME = "pd-extproc-serve"
ENVOY_NAME = "envoy"


def settings_env(settings: Settings) -> dict[str, str]:
    """Settings as PD_EXTPROC_* variables (a child reads them back with load_settings)."""
    return {spec.env: spec.show(settings.value(spec.name)) for spec in specs()}


def without_settings(environ: Mapping[str, str]) -> dict[str, str]:
    """The environment for children, minus any PD_EXTPROC_* variable (they get theirs explicitly)."""
    return {key: value for key, value in environ.items() if not key.startswith(ENV_PREFIX)}


@dataclass
class RunningStack:
    settings: Settings  # as the server and Envoy run it (ports resolved)
    log_dir: Path
    workers: dict[str, EmulatedWorker] = field(default_factory=dict)
    server: Child | None = None
    envoy: EnvoyProcess | None = None
    url: str = ""  # Envoy's listener, http://host:port
    metrics_url: str = ""  # our server's /metrics, /healthz, /readyz
    env: Mapping[str, str] = field(default_factory=dict)  # the children's environment, settings aside

    def start_server(self, ready_timeout: float = 30.0) -> None:
        """Start (or, after it stopped, restart) our server from ``settings``; the first start binds the
        gRPC port, a restart binds the same one again."""
        self.server = python_child(SERVER_NAME, ["serve"], {**self.env, **settings_env(self.settings)}, self.log_dir)
        self.server.start()
        line = ready.parse(self.server.wait_ready(ready_timeout))
        self.metrics_url = f"http://{_metrics_host(self.settings)}:{line['metrics']}"
        if not self.settings.grpc_listen.is_unix:  # Envoy must dial the port the server actually bound
            self.settings = dataclasses.replace(self.settings, grpc_listen=parse_address(line["grpc"]))

    def children(self) -> list[Child]:
        found = [worker.child for worker in self.workers.values()]
        if self.server is not None:
            found.append(self.server)
        if self.envoy is not None:
            found.append(self.envoy.child)
        return found

    def stop(self, grace: float = 0.0, say: Callable[[str], None] | None = None,
             note: Callable[[str], None] | None = None) -> None:
        """Envoy first (with ``grace``: stop accepting, let in-flight requests finish), then our server,
        then the workers; ``say`` hears each name as it stops, ``note`` the line saying Envoy drains."""
        if self.envoy is not None:
            if grace > 0 and self.envoy.child.alive() and self.envoy.admin:
                envoy_runner.drain(envoy_runner.EnvoyAdmin(self.envoy.admin), grace, note)
            self.envoy.child.stop()
            if say is not None:
                say(self.envoy.child.name)
        if self.server is not None:
            self.server.stop(timeout=grace + 5 if grace else 10)
            if say is not None:
                say(self.server.name)
        for worker in reversed(list(self.workers.values())):
            worker.stop()
            if say is not None:
                say(worker.name)


def start_stack(settings: Settings, log_dir: Path, *, workers: Sequence[WorkerSpec] = (),
                env: Mapping[str, str] | None = None,
                env_from_workers: Callable[[Mapping[str, EmulatedWorker]], Mapping[str, str]] | None = None,
                grpc_unix: bool = False, ready_timeout: float = 30.0, decode_worker: str = "decode") -> RunningStack:
    """Start the stack; on any failure, stop what was started and re-raise.

    The worker named ``decode_worker`` becomes the decode destination. ``env_from_workers`` may add PD_EXTPROC_*
    settings that depend on the workers (their ports). ``grpc_unix`` puts the ext_proc socket in
    ``log_dir``; otherwise the server binds ``settings.grpc_listen`` (port 0 = any) and Envoy dials what
    it reports."""
    base_env = without_settings(os.environ if env is None else env)
    running = RunningStack(settings, log_dir)
    try:
        running.workers = start_workers(workers, log_dir, ready_timeout, base_env)
        if env_from_workers is not None:
            settings = load_settings({**settings_env(settings), **env_from_workers(running.workers)})
        if decode_worker in running.workers:
            settings = dataclasses.replace(settings, decode=parse_address(running.workers[decode_worker].address))
        if grpc_unix:
            settings = dataclasses.replace(settings, grpc_listen=parse_address(f"unix:{log_dir}/extproc.sock",
                                                                               allow_unix=True))
        running.settings = settings
        running.env = base_env
        running.start_server(ready_timeout)
        settings = running.settings
        config = log_dir / "envoy.yaml"
        config.write_text(render_yaml(settings))
        running.envoy = EnvoyProcess.launch(settings.envoy_bin, config, log_dir)
        running.url = "http://" + running.envoy.wait_ready(ready_timeout)
    except BaseException:
        running.stop()
        raise
    return running


def _metrics_host(settings: Settings) -> str:
    host = settings.metrics_listen.host
    if host in ("0.0.0.0", ""):
        return "127.0.0.1"
    if host == "::":
        return "[::1]"
    return f"[{host}]" if ":" in host else host
