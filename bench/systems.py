"""Starting and stopping every process of the benchmark, each on ports picked at runtime.

The fleet is two emulated workers (shared by all systems) plus one process group per proxy:
  direct            the client talks to the decode worker (the floor)
  direct-prefill    the client talks to the prefill worker (the prefill leg's own floor, reference only)
  envoy             plain Envoy, router filter only ("Envoy alone")
  passthrough       our Envoy bootstrap (render_yaml), request without x-prefiller-host-port
  pd-extproc        our Envoy bootstrap + ``pd-extproc serve``, request with x-prefiller-host-port
  vllm-router       vllm-router 0.1.17 in --vllm-pd-disaggregation mode
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from bench import envoy_plain, procs
from bench.workers import emulated_vllm
from extproc import process
from extproc.config import Settings, load_settings
from extproc.prefill_target import HEADER as PREFILL_TARGET_HEADER
from extproc.stack import RunningStack, start_stack
from extproc.units import parse_address

REPO = Path(__file__).resolve().parents[1]
ROUTER_VERSION = "0.1.17"


@dataclass(frozen=True, slots=True)
class System:
    """One way to serve a request, as the load generator sees it."""

    name: str
    url: str  # base URL, no path
    headers: Mapping[str, str] = field(default_factory=dict)
    pd: bool = False  # runs a prefill leg and hands KV to decode
    processes: Mapping[str, int] = field(default_factory=dict)  # proxy processes to account: role -> pid


@dataclass(frozen=True, slots=True)
class Tools:
    envoy: str
    vllm_router: str


def default_tools() -> Tools:
    envoy = os.environ.get("PD_EXTPROC_ENVOY_BIN") or str(REPO / ".venv-envoy" / "bin" / "envoy")
    router = os.environ.get("BENCH_VLLM_ROUTER") or str(REPO / ".venv-bench" / "bin" / "vllm-router")
    return Tools(envoy=envoy, vllm_router=router)


class Fleet:
    """Every process the benchmark runs. ``stop`` ends all of them, whatever state start left."""

    def __init__(self, tools: Tools, log_dir: Path) -> None:
        self.tools = tools
        self.log_dir = log_dir
        self.prefill = emulated_vllm("prefill", log_dir)
        self.decode = emulated_vllm("decode", log_dir)
        self.children: list[process.Child] = []
        self.envoys: dict[str, process.EnvoyProcess] = {}
        self.pd: RunningStack | None = None
        self.systems: dict[str, System] = {}
        self.settings: Settings | None = None
        self.server_log = log_dir / "pd-extproc-serve.log"  # set to the real path when the server starts

    def start(self) -> None:
        for worker in (self.prefill, self.decode):
            worker.start()
        for worker in (self.prefill, self.decode):
            worker.wait_ready(30)
        self.systems["direct"] = System("direct", self.decode.url)
        self.systems["direct-prefill"] = System("direct-prefill", self.prefill.url)
        self._start_plain_envoy()
        self._start_pd_stack()
        self._start_vllm_router()

    def stop(self) -> None:
        if self.pd is not None:
            self.pd.stop()
        for envoy in self.envoys.values():
            envoy.child.stop()
        for child in reversed(self.children):
            child.stop()
        for worker in (self.decode, self.prefill):
            worker.stop()

    def _subdir(self, name: str) -> Path:
        path = self.log_dir / name
        path.mkdir(exist_ok=True)
        return path

    def _launch_envoy(self, name: str, config: str) -> str:
        workdir = self._subdir(name)
        config_path = workdir / "envoy.yaml"
        config_path.write_text(config)
        envoy = process.EnvoyProcess.launch(self.tools.envoy, config_path, workdir)
        self.envoys[name] = envoy
        return "http://" + envoy.wait_ready(30)

    def _start_plain_envoy(self) -> None:
        decode_port = int(self.decode.address.rsplit(":", 1)[1])
        url = self._launch_envoy("envoy", envoy_plain.render_yaml(decode_port))
        self.systems["envoy"] = System("envoy", url, processes={"envoy": self._envoy_pid("envoy")})

    def _envoy_pid(self, name: str) -> int:
        process = self.envoys[name].child.process
        assert process is not None
        return process.pid

    def _start_pd_stack(self) -> None:
        """Our product as ``pd-extproc up`` runs it: the server on a Unix socket, Envoy from render_yaml."""
        workdir = self._subdir("pd")
        prefill_port = self.prefill.address.rsplit(":", 1)[1]
        settings = load_settings({
            "PD_EXTPROC_ENVOY_BIN": self.tools.envoy,
            # What an operator configures: the one prefill worker is the allowed target (loopback is
            # refused by default), and the metrics endpoint must not claim a fixed port.
            "PD_EXTPROC_PREFILL_ALLOW": f"127.0.0.1/32:{prefill_port}",
            "PD_EXTPROC_METRICS_LISTEN": "127.0.0.1:0",
        }, {})
        settings = dataclasses.replace(
            settings,
            decode=parse_address(self.decode.address),
            listen=parse_address("127.0.0.1:0", allow_port_zero=True),
            envoy_admin=parse_address("127.0.0.1:0", allow_port_zero=True),
        )
        self.pd = start_stack(settings, workdir, grpc_unix=True)
        self.settings = self.pd.settings
        assert self.pd.server is not None and self.pd.server.process is not None and self.pd.envoy is not None
        assert self.pd.envoy.child.process is not None
        self.server_log = self.pd.server.log_path
        envoy_pid = self.pd.envoy.child.process.pid
        self.systems["passthrough"] = System("passthrough", self.pd.url, processes={"envoy": envoy_pid})
        self.systems["pd-extproc"] = System(
            "pd-extproc", self.pd.url, headers={PREFILL_TARGET_HEADER: self.prefill.address}, pd=True,
            processes={"pd-extproc": self.pd.server.process.pid, "envoy": envoy_pid},
        )

    def _start_vllm_router(self, attempts: int = 3) -> None:
        """vllm-router cannot bind port 0 and report it: pick free ports, retry if one was taken meanwhile."""
        for attempt in range(attempts):
            port, metrics_port = procs.free_port(), procs.free_port()
            child = process.Child(f"vllm-router-{attempt}", [
                self.tools.vllm_router, "--host", "127.0.0.1", "--port", str(port),
                "--vllm-pd-disaggregation", "--prefill", self.prefill.url, "--decode", self.decode.url,
                "--prefill-policy", "round_robin", "--decode-policy", "round_robin",
                "--prometheus-host", "127.0.0.1", "--prometheus-port", str(metrics_port),
                "--worker-startup-check-interval", "1",
            ], os.environ, self._subdir("vllm-router"))
            self.children.append(child)
            child.start()
            url = f"http://127.0.0.1:{port}"
            if _wait_http_up(url + "/health", child, timeout=60):
                assert child.process is not None
                self.systems["vllm-router"] = System(
                    "vllm-router", url, pd=True, processes={"vllm-router": child.process.pid})
                return
            child.stop()
        raise process.StackError(f"vllm-router did not start after {attempts} attempts; see {self.log_dir}")


def _wait_http_up(url: str, child: process.Child, timeout: float) -> bool:
    """True once ``url`` answers 200; False if the child exits or the time runs out."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and child.alive():
        with contextlib.suppress(OSError, urllib.error.URLError), urllib.request.urlopen(url, timeout=2) as answer:
            if answer.status == 200:
                return True
        time.sleep(0.2)
    return False


@contextlib.contextmanager
def running_fleet(tools: Tools, log_dir: Path) -> Iterator[Fleet]:
    fleet = Fleet(tools, log_dir)
    try:
        fleet.start()
        yield fleet
    finally:
        fleet.stop()
