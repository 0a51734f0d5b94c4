"""Starting and stopping every process of the benchmark, each on ports picked at runtime.

The fleet is three worker sets, each a prefill and a decode worker shared by the systems in front of it:

  cheap          cheap vLLM-shaped workers (bench/cheap_worker.py): the headline table
  cheap-sglang   cheap SGLang-shaped workers: pd-extproc's sglang adapter against smg
  emulated       emulated vLLM workers with a KV ledger (pd_extproc_lab/emulator): proves every handoff is consumed

and the systems of a set:
  direct            the client talks to the decode worker (the floor)
  direct-prefill    the client talks to the prefill worker (the prefill leg's own floor, reference only)
  envoy             plain Envoy, router filter only ("Envoy alone")
  passthrough       our Envoy bootstrap (render_yaml, with the client guard), request without x-prefiller-host-port
  pd-extproc        our Envoy bootstrap + ``pd-extproc serve``, request with x-prefiller-host-port
  pd-extproc-x2     the same with ``pd-extproc serve --workers 2`` (a supervisor and two worker processes),
                    Envoy balancing streams over their two Unix sockets (cheap set only: what a second
                    core buys)
  floor-aio         our Envoy bootstrap (route pd) + a grpc.aio ext_proc servicer that does nothing: the
                    floor of grpc.aio, our transport until our own gRPC server (bench/floor; cheap set only)
  floor-h2          the same do-nothing servicer on our own gRPC server (extproc/envoy/h2server.py): our
                    transport's floor (Envoy's share A/B only)
  floor-cxx         the same with a compiled do-nothing ext_proc server (grpc++): the design's floor
  floor-aio-shape   floor-aio answering the body with our exact reply to a successful vllm_nixl request
                    (the handoff spliced in, decode counts a consumer leg): Envoy's share A/B, cheap set only,
                    measured at ENVOY_SHARE_POINT (bench/run.py); floor-aio-delay holds each body
                    DELAY_MS, floor-aio-burn spins BURN_US of CPU before answering (bench/floor/aio.py)
  vllm-router       vllm-router 0.1.17 in --vllm-pd-disaggregation mode
  smg               smg 1.13 (Shepherd Model Gateway, sglang-router's successor) ``launch
                    --pd-disaggregation`` (cheap-sglang only)
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from bench import envoy_plain, procs
from bench.workers import CheapWorker, Worker, emulated_vllm
from bench.workload import MODEL as WORKLOAD_MODEL
from extproc.config import load_settings
from extproc.envoy.bootstrap import render_yaml
from extproc.protocol.prefill_target import HEADER as PREFILL_TARGET_HEADER
from extproc.protocol.units import parse_address
from pd_extproc_lab import process
from pd_extproc_lab.stack import RunningStack, start_stack

REPO = Path(__file__).resolve().parents[1]
ROUTER_VERSION = "0.1.17"
SMG_VERSION = "1.13.0"
SGLANG_BOOTSTRAP_PORT = 8998  # what smg and our sglang adapter put in bootstrap_port
FLOOR_CXX = REPO / ".cache" / "bench-floor" / "ext_proc_floor"  # python -m bench.floor.build (make bench)
HEADLINE = "cheap"
ENVOY_SHARE_VARIANTS = ("shape", "delay", "burn")  # floor-aio-<variant>: bench/floor/aio.py --variant
WORKER_SETS = ("cheap", "cheap-sglang", "emulated")


@dataclass(frozen=True, slots=True)
class System:
    """One way to serve a request, as the load generator sees it."""

    name: str
    url: str  # base URL, no path
    headers: Mapping[str, str] = field(default_factory=dict)
    pd: bool = False  # runs a prefill leg and hands KV to decode
    processes: Mapping[str, int] = field(default_factory=dict)  # proxy processes to account: role -> pid
    workers: str = HEADLINE  # the worker set it runs on
    handoff: bool = False  # decode gets a handoff without a prefill leg (floor-aio-shape)


@dataclass(frozen=True, slots=True)
class Tools:
    envoy: str
    vllm_router: str
    smg: str
    floor_cxx: str


def default_tools() -> Tools:
    envoy = os.environ.get("PD_EXTPROC_ENVOY_BIN") or str(REPO / ".venv-envoy" / "bin" / "envoy")
    router = os.environ.get("BENCH_VLLM_ROUTER") or str(REPO / ".venv-bench" / "bin" / "vllm-router")
    smg = os.environ.get("BENCH_SMG") or str(REPO / ".venv-bench" / "bin" / "smg")
    floor = os.environ.get("BENCH_FLOOR_CXX") or str(FLOOR_CXX)
    return Tools(envoy=envoy, vllm_router=router, smg=smg, floor_cxx=floor)


class WorkerSet:
    """Two workers and the systems in front of them."""

    def __init__(self, name: str, prefill: Worker, decode: Worker) -> None:
        self.name, self.prefill, self.decode = name, prefill, decode
        self.systems: dict[str, System] = {}
        self.pd: RunningStack | None = None
        self.server_log: Path | None = None

    @property
    def engine(self) -> str:
        return "sglang" if self.name == "cheap-sglang" else "vllm"

    @property
    def cheap(self) -> bool:
        return isinstance(self.decode, CheapWorker)


class Fleet:
    """Every process the benchmark runs. ``stop`` ends all of them, whatever state start left."""

    def __init__(self, tools: Tools, log_dir: Path, sets: tuple[str, ...] = WORKER_SETS) -> None:
        self.tools = tools
        self.log_dir = log_dir
        self.sets: dict[str, WorkerSet] = {}
        for name in sets:
            if name == "emulated":
                self.sets[name] = WorkerSet(name, emulated_vllm("prefill", log_dir), emulated_vllm("decode", log_dir))
            else:
                engine = "sglang" if name == "cheap-sglang" else "vllm"
                self.sets[name] = WorkerSet(name, CheapWorker(engine, "prefill", log_dir, f"{name}-prefill"),
                                            CheapWorker(engine, "decode", log_dir, f"{name}-decode"))
        self.children: list[process.Child] = []
        self.stacks: list[RunningStack] = []  # stacks of their own (serve --workers 2)
        self.envoys: dict[str, process.EnvoyProcess] = {}

    def systems(self) -> Iterator[System]:
        for worker_set in self.sets.values():
            yield from worker_set.systems.values()

    def start(self) -> None:
        for worker_set in self.sets.values():
            for worker in (worker_set.prefill, worker_set.decode):
                worker.start()
        for worker_set in self.sets.values():
            for worker in (worker_set.prefill, worker_set.decode):
                worker.wait_ready(30)
        for worker_set in self.sets.values():
            self._start_set(worker_set)

    def _start_set(self, worker_set: WorkerSet) -> None:
        name = worker_set.name
        worker_set.systems["direct"] = System("direct", worker_set.decode.url, workers=name)
        if worker_set.engine == "vllm":
            worker_set.systems["direct-prefill"] = System("direct-prefill", worker_set.prefill.url, workers=name)
            self._start_plain_envoy(worker_set)
        self._start_pd_stack(worker_set)
        if name == HEADLINE:
            self._start_two_servers(worker_set)
            self._start_floor(worker_set, "floor-aio", [sys.executable, "-m", "bench.floor.aio"])
            for variant in ENVOY_SHARE_VARIANTS:
                self._start_floor(worker_set, f"floor-aio-{variant}",
                                  [sys.executable, "-m", "bench.floor.aio", "--variant", variant],
                                  handoff=variant == "shape")
            self._start_floor(worker_set, "floor-h2", [sys.executable, "-m", "bench.floor.h2"])
            self._start_floor(worker_set, "floor-cxx", [self.tools.floor_cxx])
        if worker_set.engine == "vllm":
            self._start_router(worker_set, "vllm-router", [
                self.tools.vllm_router, "--vllm-pd-disaggregation", "--prefill", worker_set.prefill.url,
                "--decode", worker_set.decode.url, "--prefill-policy", "round_robin",
                "--decode-policy", "round_robin", "--worker-startup-check-interval", "1"])
        else:
            # --log-level warn: at its default (info) smg, like sglang-router before it, logs two lines per
            # request, which vllm-router does not; our server logs one.
            self._start_router(worker_set, "smg", [
                self.tools.smg, "launch", "--pd-disaggregation",
                "--prefill", worker_set.prefill.url, str(SGLANG_BOOTSTRAP_PORT), "--decode", worker_set.decode.url,
                "--prefill-policy", "round_robin", "--decode-policy", "round_robin",
                "--worker-startup-check-interval", "1", "--log-level", "warn",
                # smg routes by model id: the workers serve "cheap", the benchmark's requests name the
                # workload's model (sglang-router 0.3.2 did not look).
                "--model-alias", f"{WORKLOAD_MODEL}=cheap"])

    def stop(self) -> None:
        for worker_set in self.sets.values():
            if worker_set.pd is not None:
                worker_set.pd.stop()
        for stack in self.stacks:
            stack.stop()
        for envoy in self.envoys.values():
            envoy.child.stop()
        for child in reversed(self.children):
            child.stop()
        for worker_set in self.sets.values():
            for worker in (worker_set.decode, worker_set.prefill):
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

    def _start_plain_envoy(self, worker_set: WorkerSet) -> None:
        decode_port = int(worker_set.decode.address.rsplit(":", 1)[1])
        name = f"{worker_set.name}-envoy"
        url = self._launch_envoy(name, envoy_plain.render_yaml(decode_port))
        worker_set.systems["envoy"] = System("envoy", url, processes={"envoy": self._envoy_pid(name)},
                                             workers=worker_set.name)

    def _envoy_pid(self, name: str) -> int:
        process = self.envoys[name].child.process
        assert process is not None
        return process.pid

    def _start_pd_stack(self, worker_set: WorkerSet) -> None:
        """Our product as ``pd-extproc up`` runs it: the server on a Unix socket, Envoy from render_yaml."""
        workdir = self._subdir(f"{worker_set.name}-pd")
        prefill_port = worker_set.prefill.address.rsplit(":", 1)[1]
        settings = load_settings({
            "PD_EXTPROC_ENVOY_BIN": self.tools.envoy,
            "PD_EXTPROC_ADAPTER": "sglang" if worker_set.engine == "sglang" else "vllm_nixl",
            # What an operator configures: the one prefill worker is the allowed target (loopback is
            # refused by default), and the metrics endpoint must not claim a fixed port.
            "PD_EXTPROC_PREFILL_ALLOW": f"127.0.0.1/32:{prefill_port}",
            "PD_EXTPROC_METRICS_LISTEN": "127.0.0.1:0",
        }, {})
        settings = dataclasses.replace(
            settings,
            decode=parse_address(worker_set.decode.address),
            listen=parse_address("127.0.0.1:0", allow_port_zero=True),
            envoy_admin=parse_address("127.0.0.1:0", allow_port_zero=True),
        )
        worker_set.pd = pd = start_stack(settings, workdir, grpc_unix=True)
        assert pd.server is not None and pd.server.process is not None and pd.envoy is not None
        assert pd.envoy.child.process is not None
        worker_set.server_log = pd.server.log_path
        self.envoys[f"{worker_set.name}-pd"] = pd.envoy
        envoy_pid = pd.envoy.child.process.pid
        if worker_set.engine == "vllm":
            worker_set.systems["passthrough"] = System("passthrough", pd.url, processes={"envoy": envoy_pid},
                                                       workers=worker_set.name)
        worker_set.systems["pd-extproc"] = System(
            "pd-extproc", pd.url, headers={PREFILL_TARGET_HEADER: worker_set.prefill.address}, pd=True,
            processes={"pd-extproc": pd.server.process.pid, "envoy": envoy_pid}, workers=worker_set.name,
        )

    def _start_two_servers(self, worker_set: WorkerSet) -> None:
        """``pd-extproc serve --workers 2`` (the pd stack's settings): a supervisor and two worker
        processes, each on its own Unix socket, behind its own Envoy whose ext_proc cluster lists both
        (render_yaml, LEAST_REQUEST). The CPU accounted is both workers' and the supervisor's."""
        assert worker_set.pd is not None
        workdir = self._subdir(f"{worker_set.name}-pd-x2")
        settings = dataclasses.replace(worker_set.pd.settings, workers=2)
        stack = start_stack(settings, workdir, grpc_unix=True)
        self.stacks.append(stack)
        assert stack.server is not None and stack.server.process is not None and stack.envoy is not None
        supervisor = stack.server.process.pid
        workers = sorted(int(pid) for pid in Path(f"/proc/{supervisor}/task/{supervisor}/children").read_text().split())
        if len(workers) != 2:
            raise process.StackError(f"serve --workers 2 runs {len(workers)} worker processes; see {workdir}")
        assert stack.envoy.child.process is not None
        worker_set.systems["pd-extproc-x2"] = System(
            "pd-extproc-x2", stack.url, headers={PREFILL_TARGET_HEADER: worker_set.prefill.address}, pd=True,
            processes={"pd-extproc": workers[0], "pd-extproc-2": workers[1], "pd-extproc-supervisor": supervisor,
                       "envoy": stack.envoy.child.process.pid},
            workers=worker_set.name)

    def _start_floor(self, worker_set: WorkerSet, name: str, argv: list[str], handoff: bool = False) -> None:
        """A floor server (bench/floor) on its own Unix socket behind our Envoy bootstrap, the pd stack's
        settings: the request carries x-prefiller-host-port, so route pd runs ext_proc as for ours."""
        assert worker_set.pd is not None
        if not os.access(argv[0], os.X_OK):
            raise process.StackError(f"{argv[0]} is missing: make bench builds it (python -m bench.floor.build)")
        workdir = self._subdir(f"{worker_set.name}-{name}")
        socket_path = workdir / "extproc.sock"
        path = os.pathsep.join(filter(None, (str(REPO), os.environ.get("PYTHONPATH"))))
        child = process.Child(name, [*argv, f"unix:{socket_path}"], {**os.environ, "PYTHONPATH": path}, workdir)
        self.children.append(child)
        child.start()
        child.wait_ready(30)
        assert child.process is not None
        settings = dataclasses.replace(worker_set.pd.settings,
                                       grpc_listen=parse_address(f"unix:{socket_path}", allow_unix=True))
        envoy_name = f"{worker_set.name}-{name}"
        url = self._launch_envoy(envoy_name, render_yaml(settings))
        worker_set.systems[name] = System(
            name, url, headers={PREFILL_TARGET_HEADER: worker_set.prefill.address},
            processes={name: child.process.pid, "envoy": self._envoy_pid(envoy_name)}, workers=worker_set.name,
            handoff=handoff)

    def _start_router(self, worker_set: WorkerSet, name: str, argv: list[str], attempts: int = 3) -> None:
        """The routers cannot bind port 0 and report it: pick free ports, retry if one was taken meanwhile."""
        for attempt in range(attempts):
            port, metrics_port = procs.free_port(), procs.free_port()
            child = process.Child(f"{worker_set.name}-{name}-{attempt}", [
                *argv, "--host", "127.0.0.1", "--port", str(port),
                "--prometheus-host", "127.0.0.1", "--prometheus-port", str(metrics_port),
            ], os.environ, self._subdir(name))
            self.children.append(child)
            child.start()
            url = f"http://127.0.0.1:{port}"
            if _wait_http_up(url + "/health", child, timeout=60):
                assert child.process is not None
                worker_set.systems[name] = System(name, url, pd=True, processes={name: child.process.pid},
                                                  workers=worker_set.name)
                return
            child.stop()
        raise process.StackError(f"{name} did not start after {attempts} attempts; see {self.log_dir}")


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
def running_fleet(tools: Tools, log_dir: Path, sets: tuple[str, ...] = WORKER_SETS) -> Iterator[Fleet]:
    fleet = Fleet(tools, log_dir, sets)
    try:
        fleet.start()
        yield fleet
    finally:
        fleet.stop()
