"""From results.json to the numbers the issue asks for: per-point summaries, target verdicts, RESULTS.md.

Added latency is paired by round: in round r, system S at (mode, concurrency) minus direct decode at
the same (mode, concurrency) in the same round; the table shows the median over rounds. Throughput is
all completed requests over all measured seconds. CPU per request is a process's utime+stime over the
requests it handled (counted by the workers, so requests wrk abandoned at the end of a run count too).
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

KIB = 1024
MIB = 1 << 20
TARGET_RSS_PER_REQUEST = 64 * KIB
TARGET_PASSTHROUGH_TOLERANCE = 0.05
PD_SYSTEMS = ("pd-extproc", "vllm-router")


@dataclass
class Cell:
    """One (system, body, concurrency) over all its rounds."""

    system: str
    body: str
    concurrency: int
    rounds: int
    p50_ms: float
    p99_ms: float
    max_ms: float
    requests: int
    rps: float
    errors: int
    added_p50_ms: float | None = None
    added_p99_ms: float | None = None
    cpu_us_per_request: dict[str, float] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)
    worst_foreign_cpu_share: float = 0.0
    loadgen_cpu_share: float = 0.0  # wrk's CPU over the run's wall time (1.0 = one core)


def _median(values: Iterable[float]) -> float:
    items = list(values)
    return statistics.median(items) if items else float("nan")


def _key(point: dict[str, Any]) -> tuple[str, str, int]:
    return point["system"], point["body"], point["concurrency"]


def cells(points: list[dict[str, Any]], phase: str) -> list[Cell]:
    selected = [p for p in points if p.get("phase") == phase]
    groups: dict[tuple[str, str, int], list[dict[str, Any]]] = {}
    for point in selected:
        groups.setdefault(_key(point), []).append(point)
    floor = {(p["body"], p["concurrency"], p["round"]): p for p in selected if p["system"] == "direct"}
    return [_cell(key, group, floor) for key, group in groups.items()]


def _cell(key: tuple[str, str, int], group: list[dict[str, Any]],
          floor: dict[tuple[str, int, int], dict[str, Any]]) -> Cell:
    system, body, concurrency = key
    seconds = sum(p["seconds"] for p in group)
    cell = Cell(
        system, body, concurrency, len(group),
        p50_ms=_median(p["p50_us"] for p in group) / 1e3,
        p99_ms=_median(p["p99_us"] for p in group) / 1e3,
        max_ms=max(p["max_us"] for p in group) / 1e3,
        requests=sum(p["requests"] for p in group),
        rps=sum(p["requests"] for p in group) / seconds if seconds else 0.0,
        errors=sum(p["errors"] for p in group),
        problems=sorted({problem for p in group for problem in p["problems"]}),
        worst_foreign_cpu_share=max(p["foreign_cpu_share"] for p in group),
        loadgen_cpu_share=sum(p["loadgen_cpu_seconds"] for p in group) / seconds if seconds else 0.0,
    )
    pairs = [(p, floor.get((body, concurrency, p["round"]))) for p in group]
    paired = [(p, f) for p, f in pairs if f is not None]
    if paired and system != "direct":
        cell.added_p50_ms = _median(p["p50_us"] - f["p50_us"] for p, f in paired) / 1e3
        cell.added_p99_ms = _median(p["p99_us"] - f["p99_us"] for p, f in paired) / 1e3
    handled = sum(p["requests_handled"] for p in group)
    for role in group[0]["proxy_cpu_seconds"]:
        cpu = sum(p["proxy_cpu_seconds"][role] for p in group)
        cell.cpu_us_per_request[role] = cpu / handled * 1e6 if handled else float("nan")
    return cell


def find(table: list[Cell], system: str, body: str, concurrency: int) -> Cell | None:
    for cell in table:
        if (cell.system, cell.body, cell.concurrency) == (system, body, concurrency):
            return cell
    return None


# --- targets -------------------------------------------------------------------------------------------


@dataclass
class Verdict:
    target: str
    measured: str
    met: bool
    by: str  # how far from the target, in words


def _ratio(ours: float, theirs: float) -> float:
    return ours / theirs if theirs else float("inf")


def target_latency(table: list[Cell], body: str) -> Verdict | None:
    ours, theirs = find(table, "pd-extproc", body, 1), find(table, "vllm-router", body, 1)
    if ours is None or theirs is None or ours.added_p50_ms is None or theirs.added_p50_ms is None:
        return None
    ratio = _ratio(ours.added_p50_ms, theirs.added_p50_ms)
    met = ours.added_p50_ms <= theirs.added_p50_ms
    return Verdict(
        f"P/D added p50 at c=1 ({body}) <= vllm-router's",
        f"pd-extproc {ours.added_p50_ms:.3f} ms vs vllm-router {theirs.added_p50_ms:.3f} ms (ratio {ratio:.2f})",
        met, "met" if met else f"{ours.added_p50_ms - theirs.added_p50_ms:+.3f} ms ({ratio - 1:+.0%}) over",
    )


def target_throughput(table: list[Cell], body: str) -> Verdict | None:
    ours, theirs = find(table, "pd-extproc", body, 64), find(table, "vllm-router", body, 64)
    if ours is None or theirs is None:
        return None
    ratio = _ratio(ours.rps, theirs.rps)
    met = ours.rps >= theirs.rps
    return Verdict(
        f"P/D throughput at c=64 ({body}) >= vllm-router's",
        f"pd-extproc {ours.rps:.0f} req/s vs vllm-router {theirs.rps:.0f} req/s (ratio {ratio:.2f})",
        met, "met" if met else f"{ratio - 1:.0%} short",
    )


def target_passthrough(table: list[Cell]) -> Verdict | None:
    """Every (mode, concurrency): passthrough's p50 within +5 % and throughput within -5 % of plain Envoy."""
    worst_latency, worst_rps = 0.0, float("inf")
    where_latency = where_rps = ""
    for cell in table:
        if cell.system != "passthrough":
            continue
        plain = find(table, "envoy", cell.body, cell.concurrency)
        if plain is None:
            continue
        latency, rps = _ratio(cell.p50_ms, plain.p50_ms), _ratio(cell.rps, plain.rps)
        if latency > worst_latency:
            worst_latency, where_latency = latency, f"{cell.body} c={cell.concurrency}"
        if rps < worst_rps:
            worst_rps, where_rps = rps, f"{cell.body} c={cell.concurrency}"
    if not where_latency:
        return None
    tolerance = TARGET_PASSTHROUGH_TOLERANCE
    met = worst_latency <= 1 + tolerance and worst_rps >= 1 - tolerance
    return Verdict(
        "passthrough within 5 % of Envoy alone (p50 latency and throughput, every point)",
        f"worst p50 ratio {worst_latency:.3f} ({where_latency}); worst throughput ratio {worst_rps:.3f} ({where_rps})",
        met, "met" if met else f"latency {worst_latency - 1:+.1%}, throughput {worst_rps - 1:+.1%} at the worst points",
    )


def target_rss(inflight: list[dict[str, Any]]) -> Verdict | None:
    for case in inflight:
        if case["system"] == "pd-extproc" and case["slow_leg"] == "prefill":
            memory = case["memory"]["pd-extproc"]
            held = case["in_flight_at_slow_worker"] or case["sent"]
            per_request = (memory["peak_bytes"] - memory["baseline_bytes"]) / held
            met = per_request < TARGET_RSS_PER_REQUEST
            return Verdict(
                "pd-extproc RSS growth per in-flight request < 64 KiB (slow prefill: requests held in our server)",
                f"{per_request / KIB:.1f} KiB/request ({memory['baseline_bytes'] / MIB:.1f} -> "
                f"{memory['peak_bytes'] / MIB:.1f} MiB with {held} in flight)",
                met, "met" if met else f"{per_request / TARGET_RSS_PER_REQUEST - 1:+.0%} over",
            )
    return None


def verdicts(table: list[Cell], inflight: list[dict[str, Any]]) -> list[Verdict]:
    found = [target_latency(table, "non-stream"), target_latency(table, "stream"),
             target_throughput(table, "non-stream"), target_throughput(table, "stream"),
             target_passthrough(table), target_rss(inflight)]
    return [v for v in found if v is not None]


def summary(results: dict[str, Any]) -> dict[str, Any]:
    """What plot.py and the Markdown report read: latency and large-body cells, and verdicts."""
    latency = cells(results["points"], "latency")
    return {
        "latency": [asdict(c) for c in latency],
        "large_body": [asdict(c) for c in cells(results["points"], "large-body")],
        "profile_run": [asdict(c) for c in cells(results["points"], "profile")],
        "verdicts": [asdict(v) for v in verdicts(latency, results["inflight"])],
    }
