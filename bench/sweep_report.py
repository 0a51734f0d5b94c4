"""The size sweep's numbers (bench/run.py, phase 8): cost by prompt size, per byte, and how it grows.

Per (kind, size, system) the cell (bench/report.py's Cell: added latency paired with direct decode by
round, CPU per request of every process of the proxy over its whole process tree). From those:

- **cost per byte**, the marginal cost: (cost at S - cost at the smallest size) / (S - smallest size),
  so the fixed cost of a request does not hide the cost of its bytes; for CPU (all the proxy's
  processes: for pd-extproc its server and its Envoy) and for added p50 latency;
- **ratio against vllm-router** of those, at every size from RATIO_FROM_BYTES (the issue's target: at most
  TARGET_PER_BYTE_RATIO);
- **growth**: the exponent of a least-squares fit of log(marginal cost) on log(size) over the sizes from
  FIT_FROM_BYTES (1 = linear, 2 = quadratic); above SUPERLINEAR_EXPONENT the system is flagged. Sizes where
  the marginal cost is not positive (noise at small sizes) are left out of the fit; fewer than two left
  gives no exponent.

**Validity** (are the workers the bottleneck?) is judged at the workers, not by the headline's rule. The
headline asks direct decode for VALIDITY_FACTOR times the fastest P/D proxy's throughput: at high
concurrency that shows the workers' spare capacity. In the sweep (concurrency 1, bodies up to 8 MiB) direct
decode is bounded as much by the load generator writing the body and the kernel copying it as by the
worker (in a smoke run the worker was about half busy during direct points), and each P/D point is
compared with a separate direct point, so noise in either moves the ratio. So the sweep measures the
workers during every P/D point itself: each worker process's CPU (utime + stime from /proc, the kernel's
receive copy included) over the load's wall time must stay at or below WORKER_BUSY_BOUND = 1 /
VALIDITY_FACTOR. A worker busy b of the time could serve 1/b times the load it got, the headline's
headroom; and at concurrency 1 the proxy's time per request could shrink by at most b if the worker were
free, so the added cost is the proxy's. The headline's throughput ratio is still reported, as information.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

from bench.report import PD_SYSTEMS, WORKER_BUSY_BOUND, Cell, Verdict, busiest_worker, cells, validity

PHASE = "size-sweep"
PEER = "vllm-router"
OURS = "pd-extproc"
RATIO_FROM_BYTES = 1 << 20
FIT_FROM_BYTES = 256 << 10
TARGET_PER_BYTE_RATIO = 2.0
SUPERLINEAR_EXPONENT = 1.3
MIB = 1 << 20


@dataclass
class SweepRow:
    """One (kind, size, system)."""

    kind: str
    body_bytes: int
    system: str
    rounds: int
    requests: int
    added_p50_ms: float | None
    p50_ms: float
    cpu_us: float  # every process of the proxy, per request
    cpu_us_by_role: dict[str, float]
    cpu_us_over_smallest: float | None = None  # the cost of the bytes above the smallest size's
    added_ms_over_smallest: float | None = None
    cpu_us_per_mib: float | None = None  # marginal: the above over the MiB above the smallest size
    added_ms_per_mib: float | None = None
    problems: tuple[str, ...] = ()


@dataclass
class Growth:
    """How one system's marginal cost grows with the body, per kind."""

    kind: str
    system: str
    cpu_exponent: float | None
    latency_exponent: float | None
    superlinear: bool


def _body_meta(points: list[dict[str, Any]]) -> dict[str, tuple[str, int]]:
    return {p["body"]: (p["kind"], p["body_bytes"]) for p in points if p.get("phase") == PHASE}


def rows(points: list[dict[str, Any]]) -> list[SweepRow]:
    """Every cell of the sweep with its marginal per-byte costs, ordered by kind, size, system."""
    meta = _body_meta(points)
    table = [cell for cell in cells(points, PHASE) if cell.body in meta]
    found = [_row(cell, *meta[cell.body]) for cell in table]
    smallest: dict[tuple[str, str], SweepRow] = {}
    for row in sorted(found, key=lambda r: r.body_bytes):
        smallest.setdefault((row.kind, row.system), row)
    for row in found:
        base = smallest[(row.kind, row.system)]
        extra_mib = (row.body_bytes - base.body_bytes) / MIB
        if extra_mib <= 0:
            continue
        row.cpu_us_over_smallest = row.cpu_us - base.cpu_us
        row.cpu_us_per_mib = row.cpu_us_over_smallest / extra_mib
        if row.added_p50_ms is not None and base.added_p50_ms is not None:
            row.added_ms_over_smallest = row.added_p50_ms - base.added_p50_ms
            row.added_ms_per_mib = row.added_ms_over_smallest / extra_mib
    return sorted(found, key=lambda r: (r.kind, r.body_bytes, r.system))


def _row(cell: Cell, kind: str, body_bytes: int) -> SweepRow:
    return SweepRow(kind, body_bytes, cell.system, cell.rounds, cell.requests, cell.added_p50_ms, cell.p50_ms,
                    sum(cell.cpu_us_per_request.values()), dict(cell.cpu_us_per_request),
                    problems=tuple(cell.problems))


def fit_exponent(sizes: list[int], costs: list[float]) -> float | None:
    """Slope of log(cost) on log(size), least squares, over the positive costs; None below two of them."""
    pairs = [(math.log(size), math.log(cost)) for size, cost in zip(sizes, costs, strict=True) if cost > 0]
    if len(pairs) < 2:
        return None
    mean_x = sum(x for x, _ in pairs) / len(pairs)
    mean_y = sum(y for _, y in pairs) / len(pairs)
    spread = sum((x - mean_x) ** 2 for x, _ in pairs)
    return sum((x - mean_x) * (y - mean_y) for x, y in pairs) / spread if spread else None


def growth(table: list[SweepRow]) -> list[Growth]:
    """Per (kind, system): the exponent of the marginal cost over the sizes from FIT_FROM_BYTES."""
    found = []
    for kind, system in sorted({(r.kind, r.system) for r in table}):
        chosen = sorted((r for r in table if (r.kind, r.system) == (kind, system) and r.body_bytes >= FIT_FROM_BYTES),
                        key=lambda r: r.body_bytes)
        sizes = [r.body_bytes for r in chosen]
        cpu = fit_exponent(sizes, [r.cpu_us_over_smallest or 0.0 for r in chosen])
        latency = fit_exponent(sizes, [r.added_ms_over_smallest or 0.0 for r in chosen])
        flagged = any(exponent is not None and exponent > SUPERLINEAR_EXPONENT for exponent in (cpu, latency))
        found.append(Growth(kind, system, cpu, latency, flagged))
    return found


def per_byte_ratios(table: list[SweepRow]) -> list[dict[str, Any]]:
    """Ours over the peer's marginal cost per byte, at each (kind, size) from RATIO_FROM_BYTES."""
    found = []
    for ours in (r for r in table if r.system == OURS and r.body_bytes >= RATIO_FROM_BYTES):
        peer = next((r for r in table if (r.kind, r.body_bytes, r.system) == (ours.kind, ours.body_bytes, PEER)),
                    None)
        if peer is None:
            continue
        found.append({"kind": ours.kind, "body_bytes": ours.body_bytes,
                      "cpu": _ratio(ours.cpu_us_per_mib, peer.cpu_us_per_mib),
                      "latency": _ratio(ours.added_ms_per_mib, peer.added_ms_per_mib)})
    return found


def _ratio(ours: float | None, theirs: float | None) -> float | None:
    if ours is None or theirs is None or theirs <= 0:
        return None
    return ours / theirs


def verdicts(table: list[SweepRow]) -> list[Verdict]:
    """The issue's two: per-byte cost within 2x vllm-router's at 1 MiB and above, and nothing super-linear."""
    found = []
    ratios = per_byte_ratios(table)
    for measure, unit in (("cpu", "CPU"), ("latency", "added p50")):
        known = [r for r in ratios if r[measure] is not None]
        if not known:
            continue
        worst = max(known, key=lambda r: r[measure])
        met = all(r[measure] <= TARGET_PER_BYTE_RATIO for r in known)
        where = f"{worst['kind']} {worst['body_bytes'] / MIB:g} MiB"
        found.append(Verdict(
            f"size sweep: our {unit} per byte (marginal) <= {TARGET_PER_BYTE_RATIO:g}x {PEER}'s at 1 MiB and above",
            f"worst ratio {worst[measure]:.2f} ({where})", met,
            "met" if met else f"ratio {worst[measure]:.2f} for {TARGET_PER_BYTE_RATIO:g} ({where})"))
    ours = [g for g in growth(table) if g.system == OURS]
    if ours:
        flagged = [g for g in ours if g.superlinear]
        exponents = ", ".join(f"{g.kind} CPU {_exp(g.cpu_exponent)} latency {_exp(g.latency_exponent)}" for g in ours)
        found.append(Verdict(
            f"size sweep: nothing super-linear in pd-extproc (fitted exponent <= {SUPERLINEAR_EXPONENT:g})",
            exponents, not flagged, "met" if not flagged else "super-linear: " + ", ".join(g.kind for g in flagged)))
    return found


def _exp(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f}"


def worker_validity(points: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per cheap worker set: the busiest worker process during any P/D point of the sweep, against the bound.

    A P/D point without the workers' CPU (results from before it was measured) makes its set invalid: not
    measured is not shown to be below the bound.
    """
    checks = []
    chosen = [p for p in points if p.get("phase") == PHASE and p["system"] in PD_SYSTEMS
              and str(p.get("workers", "")).startswith("cheap")]
    for workers in sorted({p["workers"] for p in chosen}):
        busiest, unmeasured = busiest_worker(p for p in chosen if p["workers"] == workers)
        if unmeasured or busiest is None:
            checks.append({"workers": workers, "busy": None, "where": f"{unmeasured} P/D point(s) without the "
                           "workers' CPU", "valid": False})
            continue
        busy, point, role = busiest
        checks.append({"workers": workers, "busy": busy,
                       "where": f"{point['body']} {point['system']} round {point['round']}: {role} worker",
                       "valid": busy <= WORKER_BUSY_BOUND})
    return checks


def summary(points: list[dict[str, Any]]) -> dict[str, Any]:
    """What RESULTS.md and the plot read; empty when the run had no sweep."""
    table = rows(points)
    if not table:
        return {}
    return {
        "rows": [asdict(r) for r in table],
        "growth": [asdict(g) for g in growth(table)],
        "ratios": per_byte_ratios(table),
        "verdicts": [asdict(v) for v in verdicts(table)],
        "validity": worker_validity(points),
        "worker_busy_bound": WORKER_BUSY_BOUND,
        "throughput_ratio": validity(cells(points, PHASE)),  # the headline's rule, information only here
    }
