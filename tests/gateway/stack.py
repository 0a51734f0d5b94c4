"""The gateway-shaped stack: a real Envoy (tests/gateway/bootstrap.py), the fake endpoint picker, two
pd-extproc replicas in gateway mode, one emulated prefill worker and three emulated decode workers (so a
request that reaches the wrong decode is visible). Every port is picked by the process that binds it."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import yaml

from extproc import ready
from extproc.config import Settings, load_settings
from pd_extproc_lab.emulator.worker import EmulatedWorker, WorkerSpec, start_workers
from pd_extproc_lab.process import Child, EnvoyProcess, python_child
from pd_extproc_lab.stack import settings_env, without_settings
from tests.gateway.bootstrap import PD_STAT, PICKER_STAT, gateway_bootstrap
from tests.gateway.picker import Pick, PickerProcess
from tests.harness import READY_TIMEOUT, REPO, TEST_DEFAULTS, envoy_bin, log_tails
from tests.helpers import metric_samples
from tests.ports import unused_port

DECODES = ("decode-a", "decode-b", "decode-c")
REPLICAS = 2


@dataclasses.dataclass
class Replica:
    child: Child
    grpc: str = ""
    metrics_url: str = ""

    def start(self) -> None:
        self.child.start()
        line = ready.parse(self.child.wait_ready(READY_TIMEOUT))
        self.grpc = str(line["grpc"])
        self.metrics_url = f"http://127.0.0.1:{line['metrics']}"

    def scrape(self) -> dict[str, float]:
        return metric_samples(self.metrics_url)


@dataclasses.dataclass
class GatewayStack:
    settings: Settings
    log_dir: Path
    workers: dict[str, EmulatedWorker]
    picker: PickerProcess
    replicas: list[Replica]
    envoy: EnvoyProcess | None = None
    url: str = ""

    @property
    def prefill(self) -> EmulatedWorker:
        return self.workers["prefill"]

    def decode(self, name: str) -> EmulatedWorker:
        return self.workers[name]

    def pick(self, decode: str, pd: bool = True, prefill: str | None = None) -> None:
        """The picker's next choices: this decode worker, and the prefill worker (or ``prefill``) when ``pd``."""
        target = prefill if prefill is not None else self.prefill.address
        self.picker.choose(Pick(decode=self.workers[decode].address, prefill=target if pd else None))

    def client(self, **kwargs: Any) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=kwargs.pop("timeout", 60), **kwargs)

    def reset(self) -> GatewayStack:
        for worker in self.workers.values():
            worker.reset()
        self.picker.forget()
        return self

    def metric(self, name: str) -> float:
        """A sample of our servers' metrics, summed over the replicas."""
        return sum(replica.scrape().get(name, 0.0) for replica in self.replicas)

    def envoy_stat(self, name: str) -> int:
        assert self.envoy is not None
        text = self.envoy.admin_get(f"/stats?filter=^{name}$").decode()
        return sum(int(line.rsplit(":", 1)[1]) for line in text.splitlines() if line.strip())

    def pd_streams(self) -> int:
        return self.envoy_stat(f"http.http-10080.ext_proc.{PD_STAT}.streams_started")

    def pd_messages_sent(self) -> int:
        return self.envoy_stat(f"http.http-10080.ext_proc.{PD_STAT}.stream_msgs_sent")

    def picker_streams(self) -> int:
        return self.envoy_stat(f"http.http-10080.ext_proc.{PICKER_STAT}.streams_started")

    def logs(self) -> str:
        return log_tails(self.log_dir)

    def restart(self, replica: Replica) -> None:
        """Start a stopped replica again on the same gRPC port (Envoy's cluster names it)."""
        replica.child = python_child(replica.child.name, ["serve"], {**without_settings(os.environ), **settings_env(
            self.settings), "PD_EXTPROC_GRPC_LISTEN": replica.grpc}, self.log_dir)
        replica.start()

    def healthy_replicas(self) -> int:
        """Replicas Envoy's gRPC health checks see as healthy."""
        assert self.envoy is not None
        text = self.envoy.admin_get("/clusters").decode()
        return sum(1 for line in text.splitlines()
                   if line.startswith("pd_extproc::") and line.endswith("::health_flags::healthy"))

    def stop(self) -> None:
        if self.envoy is not None:
            self.envoy.child.stop()
        for replica in self.replicas:
            replica.child.stop()
        self.picker.stop()
        for worker in self.workers.values():
            worker.stop()


# (settings, the picker's host:port, the replicas' host:port, the decode workers' host:port) -> bootstrap
Shape = Callable[[Settings, str, list[str], list[str]], dict[str, Any]]


def _test_shape(settings: Settings, picker: str, replicas: list[str], decodes: list[str]) -> dict[str, Any]:
    return gateway_bootstrap(settings, picker, replicas)


@contextlib.contextmanager
def gateway_stack(env_settings: dict[str, str] | None = None, replicas: int = REPLICAS,
                  shape: Shape = _test_shape) -> Iterator[GatewayStack]:
    """The stack; ``env_settings`` adds PD_EXTPROC_* settings for the replicas, ``shape`` renders Envoy's
    bootstrap (default: tests/gateway/bootstrap.py)."""
    log_dir = Path(tempfile.mkdtemp(prefix="pd-extproc-gateway-"))
    settings = load_settings({**TEST_DEFAULTS, "PD_EXTPROC_MODE": "gateway", "PD_EXTPROC_GRPC_LISTEN": "127.0.0.1:0",
                              **(env_settings or {})})
    env = without_settings(os.environ)
    specs = [WorkerSpec("prefill", "prefill"), *(WorkerSpec(name, "decode") for name in DECODES)]
    picker = PickerProcess(log_dir, {**env, "PYTHONPATH": os.pathsep.join(
        filter(None, [str(REPO), env.get("PYTHONPATH", "")]))})
    stack = GatewayStack(settings, log_dir, {}, picker, [])
    try:
        stack.workers = start_workers(specs, log_dir, READY_TIMEOUT, env)
        picker.start(READY_TIMEOUT)
        for index in range(replicas):
            # A port below the ephemeral range: restart() binds it again, and in between no outgoing
            # connection on the machine can be given it as its source port (tests/ports.py).
            server_env = {**env, **settings_env(settings), "PD_EXTPROC_GRPC_LISTEN": f"127.0.0.1:{unused_port()}"}
            stack.replicas.append(Replica(python_child(f"pd-extproc-{index}", ["serve"], server_env, log_dir)))
            stack.replicas[-1].start()
        config = log_dir / "envoy.yaml"
        bootstrap = shape(settings, f"127.0.0.1:{picker.port}", [r.grpc for r in stack.replicas],
                          [stack.workers[name].address for name in DECODES])
        config.write_text(yaml.safe_dump(bootstrap, sort_keys=False))
        stack.envoy = EnvoyProcess.launch(envoy_bin(), config, log_dir)
        stack.url = "http://" + stack.envoy.wait_ready(READY_TIMEOUT)
        yield stack
    finally:
        stack.stop()
        if os.environ.get("PD_TEST_KEEP_LOGS") is None:
            shutil.rmtree(log_dir, ignore_errors=True)
