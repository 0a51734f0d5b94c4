"""The soak (issue 27): the real stack (Envoy + pd-extproc) in front of emulated workers and their KV
ledger, a seeded mixed workload at a fixed rate, and faults on a schedule; what must hold is checked
after every segment and at the end. Results: bench/SOAK.md. Loopback only.

    python -m bench.soak --engine vllm --minutes 60 --rate 6 --seed 27 --json out.json
    python -m bench.soak --short            # the one-minute version tests/soak runs in `make test`

A run is a list of segments. Each segment sends the mix for ``segment`` seconds, with at most one
fault injected a third of the way in (and cleared, and the stack's recovery timed with probes); then a
checkpoint: the load stops, every request in flight ends, the KV leases run out, and the checkpoint
reads the emulators' records and ledgers, our server's /metrics and /proc, and Envoy's stats. Every
answer must be documented (bench/soak_load.py) and expected, or excused by a fault it overlapped
(bench/soak_checks.py).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import sys
import tempfile
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from bench import soak_checks as checks
from bench.soak_load import Load, Outcome, probe
from bench.soak_procs import open_fds, rss_bytes, tcp_connections
from bench.soak_stack import PROFILES, SoakStack
from extproc.protocol.prom_text import sample_values

RECOVERY_BOUND = 15.0  # seconds: after each fault is cleared the stack must serve a P/D request within this
REST_TIMEOUT = 15.0  # seconds the server may take to give everything back once the load stops
FD_SLACK = 2  # fds above the incarnation's baseline tolerated at rest (the decode queue watch's connection)
TASK_SLACK = 3
CLIENT_QUIESCE = 70.0  # seconds: the client timeout (60 s) and some

FULL_CYCLE = ("quiet", "decode_5xx", "prefill_hang", "prefill_5xx", "decode_reset", "decode_queue", "quiet",
              "prefill_kill", "extproc_kill", "quiet", "extproc_drain", "envoy_drain")
SHORT_SCHEDULE = ("quiet", "extproc_kill", "quiet", "decode_5xx", "prefill_hang", "prefill_5xx", "decode_queue",
                  "prefill_kill", "quiet", "quiet")


@dataclass
class Sample:
    at: float  # seconds since the run started
    incarnation: int
    fds: int
    rss: int
    loop_tasks: float
    idle_pool: float
    inflight: float
    admitted: float
    background: float
    tcp: dict[str, int]


@dataclass
class Report:
    engine: str
    command: str
    seed: int
    rate: float
    segment_seconds: float
    started_utc: str = ""
    seconds: float = 0.0
    requests: int = 0
    labels: Counter[str] = field(default_factory=Counter)
    labels_by_kind: dict[str, Counter[str]] = field(default_factory=dict)
    faults: list[dict[str, Any]] = field(default_factory=list)
    samples: list[Sample] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)
    ledger: Counter[str] = field(default_factory=Counter)
    unpulled_by_label: Counter[str] = field(default_factory=Counter)
    slopes: dict[str, dict[str, float | None]] = field(default_factory=dict)
    segments: int = 0
    counter_checks: Counter[str] = field(default_factory=Counter)

    def fail(self, what: str) -> None:
        self.failures.append(what)
        print(f"FAIL {what}", file=sys.stderr, flush=True)


def _metric(text: str, name: str) -> float:
    values = list(sample_values(text, frozenset({name})))
    return sum(values) if values else float("nan")


def _by_label(text: str, name: str, label: str) -> dict[str, float]:
    found: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith(name + "{"):
            labels, _, value = line.rpartition(" ")
            for part in labels[len(name) + 1:-1].split(","):
                key, _, raw = part.partition("=")
                if key == label:
                    found[raw.strip('"')] = found.get(raw.strip('"'), 0.0) + float(value)
    return found


class Soak:
    def __init__(self, args: argparse.Namespace, run_dir: Path) -> None:
        self.args = args
        self.rng = random.Random(args.seed)
        self.profile = PROFILES[args.engine]
        self.stack = SoakStack(self.profile, run_dir, {
            "PD_EXTPROC_PREFILL_DEADLINE": f"{args.prefill_deadline}s",
            "PD_EXTPROC_PREFILL_READ_TIMEOUT": f"{args.prefill_deadline}s",
            "PD_EXTPROC_PREFILL_CONNECT_TIMEOUT": "1s",
            "PD_EXTPROC_MAX_REQUEST_BYTES": str(2 << 20),
            "PD_EXTPROC_DRAIN_TIMEOUT": "6s",
            "PD_EXTPROC_DECODE_QUEUE_LIMIT": "32",
            "PD_EXTPROC_DECODE_QUEUE_INTERVAL": "0.5s",
            "PD_EXTPROC_MAX_INFLIGHT": "512",
            **dict(item.split("=", 1) for item in args.server_env),
        }, args.lease, args.envoy_bin)
        self.report = Report(args.engine, "python -m bench.soak " + " ".join(sys.argv[1:]), args.seed, args.rate,
                             args.segment)
        self.windows: list[checks.Window] = []
        self.t0 = time.monotonic()
        self.incarnation = 1
        self.probe_seq = 0
        self.load: Load | None = None
        self.session: aiohttp.ClientSession | None = None
        self.last_server_metrics: str = ""
        self.last_envoy: dict[str, int] = {}
        self.baseline: dict[int, Sample] = {}

    # --- faults ---------------------------------------------------------------------------------------

    async def inject(self, fault: str) -> checks.Window:
        stack = self.stack
        assert stack.prefill is not None and stack.decode is not None and stack.server is not None
        window = checks.Window(fault, time.monotonic())
        if fault == "prefill_kill":
            stack.prefill.child.send(signal.SIGKILL)
            await stack.prefill.child.wait(10)
            await asyncio.sleep(2.0)
            await stack.start_worker("prefill")
        elif fault == "prefill_hang":
            await stack.prefill.control("script", {"behaviours": [{"hang": True}] * 3})
            await asyncio.sleep(self.args.prefill_deadline + 1.0)
        elif fault == "prefill_5xx":
            await stack.prefill.control("script", {"behaviours": [{"status": 503}] * 6})
            await asyncio.sleep(2.0)
        elif fault == "decode_5xx":
            await stack.decode.control("script", {"behaviours": [{"status": 500}] * 3})
            await asyncio.sleep(2.0)
        elif fault == "decode_reset":
            await stack.decode.control("script", {"behaviours": [{"close": True}] * 3})
            await asyncio.sleep(2.0)
        elif fault == "decode_queue":
            await stack.decode.control("gauges", {self.profile.queue_gauge: 1000})
            await asyncio.sleep(3.0)
            await stack.decode.control("gauges", {self.profile.queue_gauge: 0})
        elif fault == "extproc_kill":
            stack.server.send(signal.SIGKILL)
            await stack.server.wait(10)
            await asyncio.sleep(1.0)
            await stack.start_server()
            self.incarnation += 1
        elif fault == "extproc_drain":
            stack.server.send(signal.SIGTERM)
            code = await stack.server.wait(30)
            if code != 0:
                self.report.fail(f"pd-extproc drained with SIGTERM exited {code}")
            await stack.start_server()
            self.incarnation += 1
        elif fault == "envoy_drain":
            assert stack.envoy is not None
            stack.envoy.send(signal.SIGTERM)
            code = await stack.envoy.wait(30)
            window.note = f"envoy exit {code}"
            if code != 0:
                self.report.fail(f"Envoy drained with SIGTERM exited {code}")
            await stack.start_envoy()
        window.end = time.monotonic()
        window.recovery = await self.recovery(window.end)
        if window.recovery is None:
            self.report.fail(f"{fault}: no good P/D answer within {RECOVERY_BOUND}s of clearing it")
        return window

    async def recovery(self, since: float) -> float | None:
        assert self.load is not None and self.session is not None and self.stack.prefill is not None
        while time.monotonic() - since < RECOVERY_BOUND:
            self.probe_seq += 1
            tag = f"probe-{self.probe_seq:06d}"
            outcome = await probe(self.session, self.stack.url, self.stack.prefill.address, self.rng, tag)
            self.load.outcomes.append(outcome)
            if outcome.label == "ok" and not outcome.problem:
                return outcome.ended - since
            await asyncio.sleep(0.2)
        return None

    # --- a segment and its checkpoint -------------------------------------------------------------------

    async def segment(self, fault: str) -> None:
        assert self.load is not None and self.stack.prefill is not None and self.stack.decode is not None
        started_incarnation = self.incarnation
        envoy_starts = self.stack.envoy_starts
        prefill_starts = self.stack.prefill.child.starts
        granted_before_kill: list[dict[str, Any]] = []
        first = len(self.load.outcomes)
        # Slow prefills: a few requests each segment wait before the prefill answers (below the deadline).
        await self.stack.prefill.control("script", {"behaviours": [{"delay": self.args.prefill_deadline * 0.4}] * 2})
        if self.profile.slow_decode:  # streams that last long enough to be cut mid-way
            await self.stack.decode.control("script", {"behaviours": [dict(self.profile.slow_decode)] * 3})
        self.load.running.set()
        seg_start = time.monotonic()
        if fault != "quiet":
            await asyncio.sleep(self.args.segment / 3)
            if fault == "prefill_kill":  # what the worker granted so far (its records die with it)
                granted_before_kill = await self.stack.prefill.control("requests")
            window = await self.inject(fault)
            self.windows.append(window)
            self.report.faults.append({"fault": fault, "at": round(window.start - self.t0, 1),
                                       "cleared_after": round(window.end - window.start, 2),
                                       "recovery_seconds": None if window.recovery is None
                                       else round(window.recovery, 2), "note": window.note})
            print(f"  {fault}: cleared after {window.end - window.start:.1f}s, served again "
                  f"{window.recovery if window.recovery is None else round(window.recovery, 2)}s later", flush=True)
        remaining = self.args.segment - (time.monotonic() - seg_start)
        if remaining > 0:
            await asyncio.sleep(remaining)
        if not await self.load.quiesce(CLIENT_QUIESCE):
            self.report.fail(f"{len(self.load.inflight)} client requests still running {CLIENT_QUIESCE}s "
                             "after the load stopped")
        outcomes = self.load.outcomes[first:]
        await self.checkpoint(fault, outcomes, started_incarnation == self.incarnation,
                              envoy_starts == self.stack.envoy_starts,
                              prefill_starts == self.stack.prefill.child.starts, granted_before_kill)

    async def checkpoint(self, fault: str, outcomes: list[Outcome], same_server: bool, same_envoy: bool,
                         same_prefill: bool, granted_before_kill: list[dict[str, Any]]) -> None:
        stack, report = self.stack, self.report
        assert stack.prefill is not None and stack.decode is not None and stack.server is not None
        report.segments += 1
        for outcome in outcomes:
            report.labels[outcome.label] += 1
            report.labels_by_kind.setdefault(outcome.kind, Counter())[outcome.label] += 1
            why = checks.verdict(outcome, self.windows[-2:], self.profile.concurrent,
                                 self.profile.passthrough)
            if why:
                report.fail(f"segment {report.segments} ({fault}) {outcome.tag}: {why}")
        # At rest: our server gives everything back.
        deadline = time.monotonic() + REST_TIMEOUT
        while True:
            text = (await asyncio.to_thread(_get, stack.metrics_url + "/metrics")).decode()
            rest = {name: _metric(text, name) for name in (
                "pd_extproc_inflight_requests", "pd_extproc_admission_slots_in_use", "pd_extproc_background_prefills")}
            if all(value == 0 for value in rest.values()) or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.2)
        for name, value in rest.items():
            if value != 0:
                report.fail(f"segment {report.segments} ({fault}): {name} is {value} at rest")
        # The leases the prefill worker granted run out (or were pulled).
        ledger_text = await self._leases_settled()
        sample = await self._sample(text, rest)
        base = self.baseline.get(sample.incarnation)
        for _ in range(5):  # a task or fd that is only slow to go (a closing connection) gets a few seconds
            if base is None or not self._over_baseline(sample, base):
                break
            await asyncio.sleep(1.0)
            text = (await asyncio.to_thread(_get, stack.metrics_url + "/metrics")).decode()
            sample = await self._sample(text, rest)
        report.samples.append(sample)
        self._check_resources(sample, fault)
        # The handoff ledger, from both emulators' records.
        prefill_records = await stack.prefill.control("requests")
        decode_records = await stack.decode.control("requests")
        if not same_prefill:
            prefill_records = granted_before_kill + prefill_records
        if self.args.dump_records:
            (self.stack.run_dir / f"records-{report.segments:03d}.json").write_text(
                json.dumps({"prefill": prefill_records, "decode": decode_records}, default=str))
        granted = [(tag, handoff) for r in prefill_records
                   if (tag := checks.tag_of(r)) and (handoff := self.profile.granted(r)) is not None]
        used = []
        for record in decode_records:
            tag = checks.tag_of(record)
            handoff, loaded = self.profile.used(record)
            if tag and handoff is not None:
                used.append((tag, handoff, loaded))
        by_tag = {o.tag: o for o in outcomes}
        ledger = checks.ledger(granted, used, by_tag, prefill_lost=not same_prefill)
        report.ledger.update({"granted": ledger.granted, "pulled": ledger.pulled, "unverifiable": ledger.unverifiable})
        report.unpulled_by_label.update(ledger.unpulled_by_label)
        for problem in ledger.crossed + ledger.orphaned + [f"{t}: two grants" for t in ledger.double_grants]:
            report.fail(f"segment {report.segments} ({fault}) ledger: {problem}")
        outstanding = _metric(ledger_text, self.profile.held_metric) if self.profile.held_metric else 0.0
        if outstanding and outstanding == outstanding:
            report.fail(f"segment {report.segments} ({fault}): {outstanding} KV leases still held after the lease time")
        # Counters: ours and Envoy's against the client's tally of this segment.
        tally = checks.client_tally(outcomes)
        outcomes_now = _by_label(text, "pd_extproc_requests_total", "outcome")
        if same_server and self.last_server_metrics:
            before = _by_label(self.last_server_metrics, "pd_extproc_requests_total", "outcome")
            delta = {k: v - before.get(k, 0.0) for k, v in outcomes_now.items()}
            problems = checks.compare_server(delta, tally)
            report.counter_checks["server_compared"] += 1
            for problem in problems:
                report.fail(f"segment {report.segments} ({fault}) counters: {problem}")
        else:
            report.counter_checks["server_skipped_restart"] += 1
        self.last_server_metrics = text
        envoy = await stack.envoy_stats()
        classes = {k: envoy.get(f"http.pd_ingress.downstream_rq_{k}", 0) for k in ("2xx", "4xx", "5xx")}
        if same_envoy and self.last_envoy:
            delta_envoy = {k: v - self.last_envoy.get(k, 0) for k, v in classes.items()}
            disconnects = sum(1 for o in outcomes if o.disconnected)
            for problem in checks.compare_envoy(delta_envoy, tally, disconnects):
                report.fail(f"segment {report.segments} ({fault}) envoy: {problem}")
            report.counter_checks["envoy_compared"] += 1
        else:
            report.counter_checks["envoy_skipped_restart"] += 1
        self.last_envoy = classes
        await stack.prefill.control("reset", {})
        await stack.decode.control("reset", {})
        print(f"segment {report.segments:3d} {fault:14s} t={sample.at:7.1f}s requests={len(outcomes):4d} "
              f"fds={sample.fds} rss={sample.rss / 2**20:.1f}MiB tasks={sample.loop_tasks:.0f} "
              f"pool={sample.idle_pool:.0f} leases granted={ledger.granted} pulled={ledger.pulled} "
              f"failures={len(report.failures)}", flush=True)

    async def _leases_settled(self) -> str:
        assert self.stack.prefill is not None
        deadline = time.monotonic() + self.args.lease + 5
        while True:
            text = await self.stack.prefill.metrics()
            # The emulator reaps expired leases when it next looks at them: a reset or request does.
            outstanding = _metric(text, self.profile.held_metric) if self.profile.held_metric else 0.0
            if not outstanding or outstanding != outstanding or time.monotonic() > deadline:
                return text
            await asyncio.sleep(0.5)

    async def _sample(self, text: str, rest: dict[str, float]) -> Sample:
        assert self.stack.server is not None
        pid = self.stack.server.pid
        return Sample(round(time.monotonic() - self.t0, 1), self.incarnation, open_fds(pid), rss_bytes(pid),
                      _metric(text, "pd_extproc_event_loop_tasks"),
                      _metric(text, "pd_extproc_prefill_idle_connections"), rest["pd_extproc_inflight_requests"],
                      rest["pd_extproc_admission_slots_in_use"], rest["pd_extproc_background_prefills"],
                      dict(tcp_connections(pid)))

    @staticmethod
    def _over_baseline(sample: Sample, base: Sample) -> bool:
        held = sum(count for key, count in sample.tcp.items() if not key.startswith("listen:"))
        return (sample.fds - sample.idle_pool > base.fds - base.idle_pool + FD_SLACK
                or sample.loop_tasks > base.loop_tasks + TASK_SLACK or held > sample.idle_pool + 1)

    def _check_resources(self, sample: Sample, fault: str) -> None:
        assert self.stack.prefill is not None
        port = self.stack.prefill.port
        held = sum(count for key, count in sample.tcp.items() if key.endswith(f":{port}"))
        if held > sample.idle_pool:  # a connection to the prefill worker that the pool does not own
            self.report.fail(f"segment {self.report.segments} ({fault}): {held} connections to the prefill worker "
                             f"at rest ({sample.tcp}), {sample.idle_pool:.0f} in the pool")
        base = self.baseline.get(sample.incarnation)
        if base is None:
            # The first rest of an incarnation that followed traffic is its baseline.
            self.baseline[sample.incarnation] = sample
            return
        fds = sample.fds - sample.idle_pool
        if fds > base.fds - base.idle_pool + FD_SLACK:
            self.report.fail(f"segment {self.report.segments} ({fault}): {sample.fds} fds at rest "
                             f"({sample.idle_pool:.0f} pooled), baseline {base.fds} ({base.idle_pool:.0f} pooled)")
        if sample.loop_tasks > base.loop_tasks + TASK_SLACK:
            self.report.fail(f"segment {self.report.segments} ({fault}): {sample.loop_tasks:.0f} event-loop tasks "
                             f"at rest, baseline {base.loop_tasks:.0f}")

    def slopes(self) -> None:
        for incarnation in sorted({s.incarnation for s in self.report.samples}):
            points = [s for s in self.report.samples if s.incarnation == incarnation]
            if len(points) < 3:
                continue
            span = points[-1].at - points[0].at
            self.report.slopes[f"incarnation {incarnation} ({span / 60:.1f} min, {len(points)} rests)"] = {
                "fds_per_hour": checks.slope_per_hour([(s.at, s.fds - s.idle_pool) for s in points]),
                "rss_mib_per_hour": _mib(checks.slope_per_hour([(s.at, s.rss) for s in points])),
                "loop_tasks_per_hour": checks.slope_per_hour([(s.at, s.loop_tasks) for s in points]),
                "idle_pool_per_hour": checks.slope_per_hour([(s.at, s.idle_pool) for s in points]),
                # After the first three rests (imports, pools and caches filled): what growth remains.
                "rss_mib_per_hour_warm": _mib(checks.slope_per_hour([(s.at, s.rss) for s in points[3:]])),
                "rss_mib_first": round(points[0].rss / 2**20, 1), "rss_mib_last": round(points[-1].rss / 2**20, 1),
            }

    # --- the run -------------------------------------------------------------------------------------------

    def schedule(self) -> list[str]:
        """The segments in order: --schedule, the short one, or the full cycle repeated (the run stops
        when the next segment would end after --minutes)."""
        if self.args.schedule:
            return self.args.schedule.split(",")
        if self.args.short:
            return list(SHORT_SCHEDULE)
        count = int(self.args.minutes * 60 / self.args.segment) + 1
        return [FULL_CYCLE[i % len(FULL_CYCLE)] for i in range(count)]

    async def run(self) -> Report:
        self.report.started_utc = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        await self.stack.start()
        assert self.stack.prefill is not None
        connector = aiohttp.TCPConnector(force_close=True, limit=0)
        timeout = aiohttp.ClientTimeout(total=60)
        stop = asyncio.Event()
        try:
            async with aiohttp.ClientSession(connector=connector, timeout=timeout, trust_env=False) as session:
                self.session = session
                self.load = Load(self.stack.url, self.stack.prefill.address, self.args.rate, self.rng,
                                 self.args.large_bytes, (2 << 20) + 4096, limit=self.args.max_requests)
                sender = asyncio.get_running_loop().create_task(self.load.run(session, stop))
                ends = self.t0 + self.args.minutes * 60
                for index, fault in enumerate(self.schedule()):
                    if stop.is_set() or (index and not self.args.schedule and not self.args.short
                                         and time.monotonic() + self.args.segment > ends):
                        break
                    await self.segment(fault)
                stop.set()
                self.load.running.set()
                await asyncio.wait_for(sender, 30)
        finally:
            await self.stack.stop()
        self.report.seconds = round(time.monotonic() - self.t0, 1)
        self.report.requests = len(self.load.outcomes) if self.load else 0
        self.slopes()
        return self.report


def _without_counters(report: Report) -> Report:
    """dataclasses.asdict rebuilds a Counter from (key, value) pairs, counting the pairs: plain dicts first."""
    for name in ("labels", "ledger", "unpulled_by_label", "counter_checks"):
        setattr(report, name, dict(getattr(report, name)))
    report.labels_by_kind = {kind: dict(counts) for kind, counts in report.labels_by_kind.items()}
    return report


def _mib(value: float | None) -> float | None:
    return None if value is None else round(value / 2**20, 2)


def _get(url: str) -> bytes:
    from bench.soak_procs import http_get

    return http_get(url)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.soak", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--engine", choices=sorted(PROFILES), default="vllm")
    p.add_argument("--minutes", type=float, default=60.0, help="run length (the schedule fits in it)")
    p.add_argument("--rate", type=float, default=6.0, help="requests per second (Poisson arrivals)")
    p.add_argument("--segment", type=float, default=40.0, help="seconds of load between checkpoints")
    p.add_argument("--seed", type=int, default=27)
    p.add_argument("--lease", type=float, default=4.0, help="the prefill emulator's KV lease (seconds)")
    p.add_argument("--prefill-deadline", type=float, default=3.0)
    p.add_argument("--large-bytes", type=int, default=768 << 10, help="the prompt size of the large-body kind")
    p.add_argument("--max-requests", type=int, default=0, help="stop after this many requests (0: no limit)")
    p.add_argument("--short", action="store_true", help="the one-minute schedule (fewer faults) of make test")
    p.add_argument("--schedule", default="", help="segments to run, comma-separated (quiet or a fault: "
                   + ", ".join(checks.FAULTS) + "); default: the full or short schedule")
    p.add_argument("--json", type=Path, help="write the report here")
    p.add_argument("--server-env", action="append", default=[], metavar="PD_EXTPROC_X=VALUE",
                   help="a setting of our server (repeatable; overrides the soak's own)")
    p.add_argument("--dump-records", action="store_true", help="write both emulators' records of every segment")
    p.add_argument("--keep", action="store_true", help="keep the run directory (logs)")
    p.add_argument("--envoy-bin", default=os.environ.get("PD_EXTPROC_ENVOY_BIN", "envoy"))
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.short:
        args.segment, args.lease, args.prefill_deadline, args.minutes = 7.0, 2.0, 2.0, 2.0
        args.rate = max(args.rate, 8.0)
    run_dir = Path(tempfile.mkdtemp(prefix="pd-extproc-soak-"))
    print(f"soak: {args.engine}, {args.rate}/s, seed {args.seed}, logs in {run_dir}", flush=True)
    report = asyncio.run(Soak(args, run_dir).run())
    data = asdict(_without_counters(report))
    if args.json:
        args.json.write_text(json.dumps(data, indent=1, default=str))
    print(json.dumps({k: data[k] for k in ("seconds", "requests", "labels", "ledger", "unpulled_by_label",
                                            "slopes", "counter_checks")}, indent=1, default=str))
    print(f"{len(report.failures)} failures" + (f"; logs in {run_dir}" if report.failures else ""))
    if not report.failures and not args.keep:
        import shutil

        shutil.rmtree(run_dir, ignore_errors=True)
    return 1 if report.failures else 0


if __name__ == "__main__":
    sys.exit(main())
