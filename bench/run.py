"""The benchmark run: start the fleet, check every system, measure, write results.json.

Every phase runs on one worker set (bench/systems.py): the latency rounds on all three (cheap, cheap-sglang,
emulated), the memory, large-body and beside-large phases on the emulated set (their slow worker is
scripted; a 20 MiB body is no job for the cheap worker), the profile on the cheap set.

Order of phases:
  1. one request per system, inspected at both workers;
  2. 1,000 requests in flight against a slow prefill and against a slow decode (RSS);
  3. the load generator's own ceiling (plain Envoy answering by itself);
  4. warm-up, then ROUNDS rounds; each round walks concurrency levels and modes and, at each, runs
     every system once, in an order rotated by round;
  5. a py-spy profile of our server under P/D load, and the per-stage CPU of one P/D request measured
     in-process against the cheap prefill worker (bench/stages.py);
  6. the 20 MiB body, at concurrency 1, a fixed number of requests per system and round;
  7. one 20 MiB request sent in the middle of a run of small P/D requests (what it does to them);
  8. the size sweep (cheap set): chat and completions bodies of SWEEP_SIZES through direct decode,
     Envoy alone, pd-extproc and vllm-router, SWEEP_ROUNDS rounds in a rotated order, CPU counted over
     each proxy's whole process tree (our inspection pool parses bodies over 16 KiB in its own
     processes). With --size-sweep-only, phases 2-7 are skipped.
With --profile-only (``make profile``): phase 1, a warm-up, and phase 5's py-spy profile alone, at
profile_concurrency, written as a flame graph SVG (bench/flamegraph.py) beside results.json.
A point measured while other processes used more than NOISE_THRESHOLD of the machine is measured
again (at most NOISE_RETRIES times, within a run-wide RETRY_BUDGET, each retry after waiting up to
QUIET_WAIT seconds for the machine to calm down) and the quietest attempt is kept; each point
records its attempts and the share of the machine other processes used while it ran.
"""

from __future__ import annotations

import dataclasses
import functools
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench import (
    envoylog,
    flamegraph,
    inflight,
    loop_stall,
    machine,
    procs,
    profiling,
    sequential,
    serverlog,
    stages,
    verify,
    wrk,
)
from bench.envoy_plain import CEILING_PATH
from bench.report import ENVOY_SHARE_POINT
from bench.systems import ENVOY_SHARE_VARIANTS, HEADLINE, Fleet, System, WorkerSet
from bench.workers import LegCounters, pid
from bench.workload import CHAT_PATH, SWEEP_KINDS, chat_body, sweep_body_name, write_bodies
from pd_extproc_lab.emulator.worker import EmulatedWorker

LATENCY_SYSTEMS = ("direct", "envoy", "passthrough", "floor-cxx", "floor-aio", "pd-extproc", "pd-extproc-x2",
                   "vllm-router", "smg")
REFERENCE_SYSTEMS = ("direct-prefill",)  # measured for non-streaming only: prefill legs never stream
# Envoy's share A/B (bench/floor/aio.py's variants), measured at one point of the cheap set only.
ENVOY_SHARE_SYSTEMS = (*(f"floor-aio-{variant}" for variant in ENVOY_SHARE_VARIANTS), "floor-h2")
LARGE_BODY_SYSTEMS = ("direct", "envoy", "passthrough", "pd-extproc", "vllm-router")
PD_SYSTEMS = ("pd-extproc", "vllm-router")
SWEEP_SYSTEMS = ("direct", "envoy", "pd-extproc", "vllm-router")
SLOW_SET = "emulated"  # the set whose workers can be scripted (in-flight memory, 20 MiB bodies)
BESIDE_CONCURRENCY = 16
SETTLE_SECONDS = 0.2  # lets requests wrk abandoned at the end of a run finish before counters are read
NOISE_THRESHOLD = 0.10
NOISE_RETRIES = 2
RETRY_BUDGET = 0.25  # at most this share of the planned latency points is measured again
QUIET_WAIT = 20.0  # before a retry, wait up to this long for other processes to calm down ...
QUIET_BUDGET = 180.0  # ... and no more than this in the whole run
Load = Callable[[], wrk.WrkResult]


@dataclass(frozen=True)
class Options:
    rounds: int = 3
    seconds: int = 3
    concurrency: tuple[int, ...] = (1, 16, 64, 256)  # the cheap set (the headline table)
    sglang_concurrency: tuple[int, ...] = (1, 16, 64)
    emulated_concurrency: tuple[int, ...] = (1, 64)
    modes: tuple[str, ...] = ("non-stream", "stream")
    warmup_seconds: int = 1
    large_body_rounds: int = 2
    large_body_requests: int = 3  # per system and round
    inflight_requests: int = 1000
    inflight_delay: float = 5.0
    profile_seconds: int = 8
    loop_stall_mib: int = 32  # the worst-shape body beside small requests (bench/loop_stall.py)
    beside_seconds: int = 8
    profile_concurrency: int = 16
    stage_requests: int = 2000
    stage_repeats: int = 5
    py_spy: str = ""
    quiet_max_wait: float = 300.0
    sweep_sizes: tuple[int, ...] = (1 << 10, 16 << 10, 256 << 10, 1 << 20, 8 << 20)  # workload.SWEEP_SIZES
    sweep_rounds: int = 3
    sweep_seconds: int = 3
    sweep_concurrency: int = 1
    size_sweep_only: bool = False
    profile_only: bool = False


@dataclass
class Run:
    """Everything measured, JSON-ready (dataclasses.asdict)."""

    options: dict[str, Any]
    machine: dict[str, str]
    started: str
    inspections: list[dict[str, Any]] = field(default_factory=list)
    inflight: list[dict[str, Any]] = field(default_factory=list)
    ceiling: list[dict[str, Any]] = field(default_factory=list)
    points: list[dict[str, Any]] = field(default_factory=list)
    profile: dict[str, Any] = field(default_factory=dict)
    stages: dict[str, Any] = field(default_factory=dict)  # bench/stages.py's StageResult
    loop_stall: dict[str, Any] = field(default_factory=dict)  # bench/loop_stall.py's run_all
    envoy_outcomes: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    quiet_wait: dict[str, float] = field(default_factory=dict)
    idle_rss: dict[str, dict[str, int]] = field(default_factory=dict)
    foreign_cpu_share: float = 0.0
    finished: str = ""
    incomplete: str = ""  # why the run stopped early, if it did


class Bench:
    def __init__(self, fleet: Fleet, options: Options, work_dir: Path, log: Callable[[str], None]) -> None:
        self.fleet = fleet
        self.options = options
        self.work_dir = work_dir
        self.log = log
        self.bodies = write_bodies(work_dir, options.sweep_sizes)
        self._scripts: dict[tuple[str, str], Path] = {}
        self.quiet_budget_left = QUIET_BUDGET
        # Retries of noisy points, for the whole run: a machine that stays busy must not triple its length.
        planned = sum(len(self.levels(name)) * (len(worker_set.systems) * len(options.modes))
                      for name, worker_set in fleet.sets.items())
        self.retries_left = int(RETRY_BUDGET * options.rounds * planned)

    def levels(self, set_name: str) -> tuple[int, ...]:
        return {"cheap-sglang": self.options.sglang_concurrency,
                "emulated": self.options.emulated_concurrency}.get(set_name, self.options.concurrency)

    def script(self, system: System, body: str) -> Path:
        key = (f"{system.workers}-{system.name}", body)
        if key not in self._scripts:
            path = self.work_dir / f"wrk-{key[0]}-{body}.lua"
            path.write_text(wrk.lua_script(self.bodies[body], system.headers))
            self._scripts[key] = path
        return self._scripts[key]

    def all_pids(self) -> list[int]:
        pids = []
        for worker_set in self.fleet.sets.values():
            pids += [pid(worker_set.prefill), pid(worker_set.decode)]
        for system in self.fleet.systems():
            pids += [pid for pid in system.processes.values() if pid not in pids]
        return pids

    def workers_of(self, system: System) -> WorkerSet:
        return self.fleet.sets[system.workers]

    def measure(self, system: System, body: str, concurrency: int, load: Load,
                cpu: Callable[[int], float] = procs.cpu_seconds) -> dict[str, Any]:
        """One run of ``load`` against one system, with CPU (``cpu`` of each process), worker counters and
        machine load around it."""
        worker_set = self.workers_of(system)
        for worker in (worker_set.prefill, worker_set.decode):
            worker.reset()
        legs_before = LegCounters.read(worker_set.prefill, worker_set.decode)
        cpu_before = {role: cpu(pid) for role, pid in system.processes.items()}
        worker_pids = {"prefill": pid(worker_set.prefill), "decode": pid(worker_set.decode)}
        worker_before = {role: procs.cpu_seconds(pid) for role, pid in worker_pids.items()}
        load_before = machine.LoadSnapshot.take(self.all_pids())
        started, wall_start = time.monotonic(), time.time()
        result = load()
        wall_end = time.time()
        load_seconds = time.monotonic() - started
        time.sleep(SETTLE_SECONDS)
        wall = time.monotonic() - started
        load_after = machine.LoadSnapshot.take(self.all_pids())
        cpu_used = {role: cpu(pid) - cpu_before[role] for role, pid in system.processes.items()}
        worker_used = {role: procs.cpu_seconds(pid) - worker_before[role] for role, pid in worker_pids.items()}
        legs = LegCounters.read(worker_set.prefill, worker_set.decode).minus(legs_before)
        handled = legs.prefill_leases_granted if system.pd else (
            legs.prefill_recomputed if system.name == "direct-prefill" else
            legs.decode_transfers if system.handoff else legs.decode_recomputed)
        return {
            "system": system.name, "workers": system.workers, "body": body, "concurrency": concurrency,
            **dataclasses.asdict(result), "rps": result.rps,
            "proxy_cpu_seconds": cpu_used, "requests_handled": int(handled), "legs": legs.as_dict(),
            "problems": verify.check_point(system, legs, result.requests, result.errors, concurrency),
            "foreign_cpu_share": load_after.foreign_share(load_before, wall),
            "wall_start": wall_start, "wall_end": wall_end,
            # each worker process's utime+stime during the load (and the settle after it), over the load's
            # wall time: how busy the workers were (the size sweep's validity, bench/sweep_report.py)
            "worker_busy": {role: used / load_seconds for role, used in worker_used.items()} if load_seconds else {},
        }

    def measure_quietly(self, system: System, body: str, concurrency: int, load: Load,
                        cpu: Callable[[int], float] = procs.cpu_seconds) -> dict[str, Any]:
        """``measure``, repeated while other processes were busy during it; the quietest attempt wins."""
        attempts = [self.measure(system, body, concurrency, load, cpu)]
        while (attempts[-1]["foreign_cpu_share"] > NOISE_THRESHOLD and len(attempts) <= NOISE_RETRIES
               and self.retries_left > 0):
            self.retries_left -= 1
            self.wait_for_quiet()
            attempts.append(self.measure(system, body, concurrency, load, cpu))
        best = min(attempts, key=lambda point: point["foreign_cpu_share"])
        best["attempts"] = len(attempts)
        return best

    def wait_for_quiet(self) -> None:
        """Wait a little for other processes to calm down, within the run's QUIET_BUDGET seconds."""
        if self.quiet_budget_left <= 0:
            return
        waited, _ = machine.wait_for_quiet(self.all_pids(), NOISE_THRESHOLD, min(QUIET_WAIT, self.quiet_budget_left))
        self.quiet_budget_left -= waited

    def wrk_load(self, system: System, body: str, concurrency: int, seconds: int) -> Load:
        return lambda: wrk.run(system.url + CHAT_PATH, self.script(system, body), concurrency, seconds)

    # --- phases ---------------------------------------------------------------------------------------

    def inspect_systems(self, run: Run) -> None:
        for system in self.fleet.systems():
            worker_set = self.workers_of(system)
            inspection = verify.inspect_one_request(system, worker_set.prefill, worker_set.decode)
            run.inspections.append({**dataclasses.asdict(inspection), "workers": system.workers})
            self.log(f"inspect {system.workers}/{system.name}: status {inspection.status}, "
                     f"problems {inspection.problems or 'none'}")

    def inflight_memory(self, run: Run) -> None:
        body = chat_body(stream=False)
        slow_set = self.fleet.sets[SLOW_SET]
        prefill, decode = slow_set.prefill, slow_set.decode
        cases = [("pd-extproc", prefill, "prefill"), ("pd-extproc", decode, "decode"),
                 ("vllm-router", prefill, "prefill"), ("vllm-router", decode, "decode"),
                 ("passthrough", decode, "decode"), ("envoy", decode, "decode")]
        for name, slow, role in cases:
            assert isinstance(slow, EmulatedWorker)
            result = inflight.measure(slow_set.systems[name], slow, role, body, self.options.inflight_requests,
                                      self.options.inflight_delay)
            run.inflight.append(dataclasses.asdict(result))
            self.log(f"in-flight {name} slow {role}: {result.ok}/{result.sent} ok, "
                     f"{result.in_flight_at_slow_worker} waiting at the slow worker, "
                     + ", ".join(f"{role} {m.baseline_bytes >> 20}->{m.peak_bytes >> 20} MiB"
                                 for role, m in result.memory.items()))

    def loadgen_ceiling(self, run: Run) -> None:
        envoy = self.fleet.sets[HEADLINE].systems["envoy"]
        ceiling = dataclasses.replace(envoy, name="loadgen-ceiling")
        for concurrency in (1, 64):
            script = self.script(ceiling, "non-stream")
            result = wrk.run(envoy.url + CEILING_PATH, script, concurrency, self.options.seconds)
            run.ceiling.append({"concurrency": concurrency, **dataclasses.asdict(result), "rps": result.rps})
            self.log(f"load generator ceiling c={concurrency}: {result.rps:.0f} req/s, "
                     f"wrk CPU {result.loadgen_cpu_seconds:.2f}s")

    def warm_up(self) -> None:
        for system in self.fleet.systems():
            for concurrency in (16, max(self.levels(system.workers))):
                wrk.run(system.url + CHAT_PATH, self.script(system, "non-stream"), concurrency,
                        self.options.warmup_seconds)

    def latency_rounds(self, run: Run) -> None:
        for round_index in range(self.options.rounds):
            for set_name in self.fleet.sets:
                for concurrency in self.levels(set_name):
                    for body in self.options.modes:
                        names = latency_systems(body, concurrency)
                        for system in _rotated(self._systems(set_name, names), round_index):
                            load = self.wrk_load(system, body, concurrency, self.options.seconds)
                            point = self.measure_quietly(system, body, concurrency, load)
                            point.update(phase="latency", round=round_index)
                            run.points.append(point)
                            self._log_point(point)

    def large_body_rounds(self, run: Run) -> None:
        body = self.bodies["20MiB"].read_bytes()
        for round_index in range(self.options.large_body_rounds):
            for system in _rotated(self._systems(SLOW_SET, LARGE_BODY_SYSTEMS), round_index):
                load = functools.partial(sequential.run, system.url, CHAT_PATH, body, system.headers,
                                         self.options.large_body_requests)
                # The whole process tree: our inspection pool's processes parse this body.
                point = self.measure_quietly(system, "20MiB", 1, load, cpu=procs.tree_cpu_seconds)
                point.update(phase="large-body", round=round_index)
                run.points.append(point)
                self._log_point(point)

    def large_body_beside_small(self, run: Run) -> None:
        """One 20 MiB request in the middle of a small-request run: what it does to everyone else."""
        body = self.bodies["20MiB"].read_bytes()
        seconds = self.options.beside_seconds
        for system in self._systems(SLOW_SET, PD_SYSTEMS):
            small = self.wrk_load(system, "non-stream", BESIDE_CONCURRENCY, seconds)
            load, large = _with_one_large_request(small, system, body, delay=seconds / 4)
            point = self.measure(system, "non-stream", BESIDE_CONCURRENCY, load)
            point.update(phase="beside-large", round=0,
                         large_request_ms=large[0].max_us / 1e3 if large else None,
                         large_request_errors=large[0].errors if large else None)
            run.points.append(point)
            self._log_point(point)
            self.log(f"  the 20 MiB request beside it took {point['large_request_ms']:.0f} ms")

    def size_sweep(self, run: Run) -> None:
        """Cost by prompt size: each (kind, size) through every SWEEP_SYSTEMS system, rounds interleaved."""
        concurrency, seconds = self.options.sweep_concurrency, self.options.sweep_seconds
        systems = self._systems(HEADLINE, SWEEP_SYSTEMS)
        for system in systems:  # the first large body starts our inspection pool: not inside a measurement
            for kind, path in SWEEP_KINDS.items():
                body = sweep_body_name(kind, max(self.options.sweep_sizes))
                wrk.run(system.url + path, self.script(system, body), 1, self.options.warmup_seconds)
        for round_index in range(self.options.sweep_rounds):
            for size in self.options.sweep_sizes:
                for kind, path in SWEEP_KINDS.items():
                    body = sweep_body_name(kind, size)
                    for system in _rotated(systems, round_index):
                        script = self.script(system, body)
                        load = functools.partial(wrk.run, system.url + path, script, concurrency, seconds)
                        point = self.measure_quietly(system, body, concurrency, load, cpu=procs.tree_cpu_seconds)
                        point.update(phase="size-sweep", round=round_index, kind=kind, body_bytes=size)
                        run.points.append(point)
                        self._log_point(point)

    def stage_budget(self, run: Run) -> None:
        """Our server's CPU per P/D request, stage by stage (bench/stages.py), in this process."""
        prefill = self.fleet.sets[HEADLINE].prefill
        prefill.reset()
        result = stages.measure(prefill.url, self.options.stage_requests, repeats=self.options.stage_repeats)
        run.stages = dataclasses.asdict(result)
        self.log(f"stages: {result.total_cpu_us:.0f} µs CPU per P/D request in-process, prefill leg "
                 f"{result.cpu_us['prefill leg']:.0f}")

    def loop_stall(self, run: Run) -> None:
        """One worst-shape body (tiny content parts) beside small P/D requests, in this process."""
        run.loop_stall = loop_stall.run_all(self.options.loop_stall_mib)
        pool = run.loop_stall["variants"][-1]
        self.log(f"loop stall: small p99 {pool['before_p99']:.0f} -> {pool['during_p99']:.0f} ms beside a "
                 f"{self.options.loop_stall_mib} MiB worst-shape body")

    def profile_server(self, run: Run) -> None:
        system = self.fleet.sets[HEADLINE].systems["pd-extproc"]
        if not self.options.py_spy:
            return
        raw = self.work_dir / "py-spy-pd-extproc.txt"
        seconds = self.options.profile_seconds
        recorder = profiling.record(self.options.py_spy, system.processes["pd-extproc"], seconds, raw)
        concurrency = self.options.profile_concurrency
        point = self.measure(system, "non-stream", concurrency, self.wrk_load(system, "non-stream", concurrency,
                                                                              seconds + 1))
        recorder.wait(timeout=seconds + 30)
        point.update(phase="profile", round=0)
        run.points.append(point)
        run.profile = dataclasses.asdict(profiling.summarise(raw, seconds))
        if raw.exists():
            svg = self.work_dir / "pd-extproc-profile.svg"
            flamegraph.write(raw, svg, f"pd-extproc serve, non-streaming P/D at c={concurrency}, {seconds} s "
                                       f"({point['rps']:.0f} req/s)")
            run.profile["flamegraph"] = str(svg)
        self.log(f"profile: {run.profile['samples']} samples of pd-extproc serve at c={point['concurrency']}")

    def idle_rss(self, run: Run, label: str) -> None:
        run.idle_rss[label] = {
            f"{system.workers}/{system.name}/{role}": procs.rss_bytes(pid)
            for system in self.fleet.systems() for role, pid in system.processes.items()
        }

    def _systems(self, set_name: str, names: tuple[str, ...]) -> list[System]:
        systems = self.fleet.sets[set_name].systems
        return [systems[name] for name in names if name in systems]

    def _log_point(self, point: dict[str, Any]) -> None:
        self.log(f"r{point['round']} {point['workers']:>12} {point['body']:>10} c={point['concurrency']:<3} "
                 f"{point['system']:<14} "
                 f"{point['rps']:8.0f} req/s  p50 {point['p50_us'] / 1e3:7.2f} ms  p99 {point['p99_us'] / 1e3:7.2f} ms"
                 f"  other load {point['foreign_cpu_share']:.0%}"
                 + (f"  PROBLEMS: {point['problems']}" if point["problems"] else ""))


def attach_server_timings(run: Run, fleet: Fleet) -> None:
    """Add our server's own medians (time it held the request, prefill call) to each pd-extproc point."""
    for name, worker_set in fleet.sets.items():
        if worker_set.server_log is None:
            continue
        requests = serverlog.read_requests(worker_set.server_log)
        for point in run.points:
            if point["system"] == "pd-extproc" and point.get("workers") == name:
                point["server"] = serverlog.timings(requests, point["wall_start"], point["wall_end"])


def latency_systems(body: str, concurrency: int) -> tuple[str, ...]:
    """The systems of a latency point (those a worker set does not run are skipped by the caller)."""
    return (LATENCY_SYSTEMS + (REFERENCE_SYSTEMS if body == "non-stream" else ())
            + (ENVOY_SHARE_SYSTEMS if (body, concurrency) == ENVOY_SHARE_POINT else ()))


def _with_one_large_request(small: Load, system: System, body: bytes, delay: float
                            ) -> tuple[Load, list[wrk.WrkResult]]:
    """``small`` with one request of ``body`` sent ``delay`` seconds in; its result lands in the list."""
    large: list[wrk.WrkResult] = []

    def send_large() -> None:
        time.sleep(delay)
        large.append(sequential.run(system.url, CHAT_PATH, body, system.headers, 1))

    def both() -> wrk.WrkResult:
        sender = threading.Thread(target=send_large, daemon=True)
        sender.start()
        result = small()
        sender.join()
        return result

    return both, large


def _rotated(items: list[System], by: int) -> Iterator[System]:
    shift = by % len(items)
    yield from items[shift:] + items[:shift]


def execute(fleet: Fleet, options: Options, work_dir: Path, run: Run, log: Callable[[str], None]) -> None:
    bench = Bench(fleet, options, work_dir, log)
    own_before = machine.LoadSnapshot.take(bench.all_pids())
    started = time.monotonic()
    waited, share = machine.wait_for_quiet(bench.all_pids(), NOISE_THRESHOLD, options.quiet_max_wait)
    run.quiet_wait = {"seconds": waited, "foreign_share": share}
    log(f"waited {waited:.0f}s for a quiet machine (other processes at {share:.0%})")
    try:
        bench.inspect_systems(run)
        if options.size_sweep_only:
            bench.size_sweep(run)
            return
        if options.profile_only:
            bench.warm_up()
            bench.profile_server(run)
            return
        bench.idle_rss(run, "after start")
        slow = SLOW_SET in fleet.sets
        if slow:
            bench.inflight_memory(run)
        if HEADLINE in fleet.sets:
            bench.loadgen_ceiling(run)
        bench.warm_up()
        bench.latency_rounds(run)
        if HEADLINE in fleet.sets:
            bench.profile_server(run)  # before any 20 MiB request: see large_body_beside_small
            bench.stage_budget(run)
            bench.loop_stall(run)
        if slow:
            bench.large_body_rounds(run)
            bench.large_body_beside_small(run)
        if HEADLINE in fleet.sets:
            bench.size_sweep(run)
        bench.idle_rss(run, "at the end")
    finally:  # also when a phase failed: keep the evidence gathered so far
        run.envoy_outcomes = {name: envoylog.outcomes(envoy.child.log_path) for name, envoy in fleet.envoys.items()}
        attach_server_timings(run, fleet)
        run.foreign_cpu_share = machine.LoadSnapshot.take(bench.all_pids()).foreign_share(
            own_before, time.monotonic() - started)
