"""From results.json to the numbers the issue asks for: per-point summaries, target verdicts, RESULTS.md.

Cells are per worker set (bench/systems.py); the targets are judged on the cheap set, where the workers
are not the bottleneck, and a run is valid only if there direct decode reached at least
VALIDITY_FACTOR times the throughput of the fastest P/D proxy at every (mode, concurrency), or, at a point
where it did not (concurrency 1: the load generator's round trip bounds direct decode), no worker process
was more than WORKER_BUSY_BOUND busy during any P/D proxy's run there.

Added latency is paired by round: in round r, system S at (mode, concurrency) minus direct decode at
the same (mode, concurrency) in the same round, on the same workers; the table shows the median over
rounds. Throughput is all completed requests over all measured seconds. CPU per request is a process's
utime+stime over the requests it handled (counted by the workers, so requests wrk abandoned at the end
of a run count too).
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

KIB = 1024
MIB = 1 << 20
TARGET_RSS_PER_REQUEST = 64 * KIB
TARGET_PASSTHROUGH_TOLERANCE = 0.05
TARGET_SERVER_CPU_US = 500.0  # our server's CPU per P/D request at c=64 (issue 17)
TARGET_OWN_WORK_US = 250.0  # our server's CPU above the grpc.aio floor's, per P/D request at c=64 (issue 28)
TARGET_OVER_AIO_FLOOR = 1.6  # our server's CPU per P/D request / the grpc.aio floor's, at c=64 (issue 28)
TARGET_ADDED_P50_MS = 1.5  # P/D added p50 at c=1 (issue 28)
TARGET_THROUGHPUT_VS_ROUTER = 0.4  # P/D throughput at c=64 / vllm-router's (issue 28)
TARGET_ENVOY_OVER_FLOOR_US = 30.0  # Envoy's CPU per P/D request above floor-aio's Envoy, at c=64 (issue 36)
FLOOR_AIO, FLOOR_CXX = "floor-aio", "floor-cxx"
# Envoy's share A/B: floor-aio, its variants (bench/floor/aio.py) and ours, behind the same Envoy bootstrap.
ENVOY_SHARE_SYSTEMS = (FLOOR_AIO, "floor-aio-shape", "floor-aio-delay", "floor-aio-burn", "floor-h2", "pd-extproc")
ENVOY_SHARE_POINT = ("non-stream", 64)
VALIDITY_FACTOR = 5.0
PD_SYSTEMS = ("pd-extproc", "pd-extproc-x2", "vllm-router", "smg")
# A worker process busier than this (its CPU over the load's wall time) during a P/D point could not have
# served VALIDITY_FACTOR times the load it got: the same margin, measured at the worker.
WORKER_BUSY_BOUND = 1 / VALIDITY_FACTOR
HEADLINE = "cheap"


@dataclass
class Cell:
    """One (system, body, concurrency) over all its rounds."""

    workers: str
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


def _workers(point: dict[str, Any]) -> str:
    return str(point.get("workers", "emulated"))  # results from before worker sets: all emulated


def _key(point: dict[str, Any]) -> tuple[str, str, str, int]:
    return _workers(point), point["system"], point["body"], point["concurrency"]


def cells(points: list[dict[str, Any]], phase: str) -> list[Cell]:
    selected = [p for p in points if p.get("phase") == phase]
    groups: dict[tuple[str, str, str, int], list[dict[str, Any]]] = {}
    for point in selected:
        groups.setdefault(_key(point), []).append(point)
    floor = {(_workers(p), p["body"], p["concurrency"], p["round"]): p for p in selected if p["system"] == "direct"}
    return [_cell(key, group, floor) for key, group in groups.items()]


def _cell(key: tuple[str, str, str, int], group: list[dict[str, Any]],
          floor: dict[tuple[str, str, int, int], dict[str, Any]]) -> Cell:
    workers, system, body, concurrency = key
    seconds = sum(p["seconds"] for p in group)
    cell = Cell(
        workers, system, body, concurrency, len(group),
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
    pairs = [(p, floor.get((workers, body, concurrency, p["round"]))) for p in group]
    paired = [(p, f) for p, f in pairs if f is not None]
    if paired and system != "direct":
        cell.added_p50_ms = _median(p["p50_us"] - f["p50_us"] for p, f in paired) / 1e3
        cell.added_p99_ms = _median(p["p99_us"] - f["p99_us"] for p, f in paired) / 1e3
    handled = sum(p["requests_handled"] for p in group)
    for role in group[0]["proxy_cpu_seconds"]:
        cpu = sum(p["proxy_cpu_seconds"][role] for p in group)
        cell.cpu_us_per_request[role] = cpu / handled * 1e6 if handled else float("nan")
    return cell


def find(table: list[Cell], system: str, body: str, concurrency: int, workers: str = HEADLINE) -> Cell | None:
    for cell in table:
        if (cell.workers, cell.system, cell.body, cell.concurrency) == (workers, system, body, concurrency):
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


def target_latency(table: list[Cell], body: str, peer: str = "vllm-router", factor: float = 1.0,
                   workers: str = HEADLINE) -> Verdict | None:
    ours, theirs = find(table, "pd-extproc", body, 1, workers), find(table, peer, body, 1, workers)
    if ours is None or theirs is None or ours.added_p50_ms is None or theirs.added_p50_ms is None:
        return None
    ratio = _ratio(ours.added_p50_ms, theirs.added_p50_ms)
    met = ratio <= factor
    bound = f"{factor:g}x {peer}'s" if factor != 1 else f"{peer}'s"
    return Verdict(
        f"P/D added p50 at c=1 ({body}, {workers} workers) <= {bound}",
        f"pd-extproc {ours.added_p50_ms:.3f} ms vs {peer} {theirs.added_p50_ms:.3f} ms (ratio {ratio:.2f})",
        met, "met" if met else f"{ours.added_p50_ms - factor * theirs.added_p50_ms:+.3f} ms over "
                               f"(ratio {ratio:.2f} for {factor:g})",
    )


def target_throughput(table: list[Cell], body: str, peer: str = "vllm-router", factor: float = 1.0,
                      workers: str = HEADLINE) -> Verdict | None:
    ours, theirs = find(table, "pd-extproc", body, 64, workers), find(table, peer, body, 64, workers)
    if ours is None or theirs is None:
        return None
    ratio = _ratio(ours.rps, theirs.rps)
    met = ratio >= factor
    bound = f"{factor:g}x {peer}'s" if factor != 1 else f"{peer}'s"
    return Verdict(
        f"P/D throughput at c=64 ({body}, {workers} workers) >= {bound}",
        f"pd-extproc {ours.rps:.0f} req/s vs {peer} {theirs.rps:.0f} req/s (ratio {ratio:.2f})",
        met, "met" if met else f"ratio {ratio:.2f}, {ratio / factor - 1:.0%} short of {factor:g}",
    )


def target_server_cpu(table: list[Cell], body: str = "non-stream") -> Verdict | None:
    ours = find(table, "pd-extproc", body, 64)
    if ours is None or "pd-extproc" not in ours.cpu_us_per_request:
        return None
    cpu = ours.cpu_us_per_request["pd-extproc"]
    met = cpu <= TARGET_SERVER_CPU_US
    return Verdict(
        f"our server's CPU per P/D request at c=64 ({body}, cheap workers) <= {TARGET_SERVER_CPU_US:.0f} µs",
        f"pd-extproc {cpu:.0f} µs + its Envoy {ours.cpu_us_per_request.get('envoy', float('nan')):.0f} µs",
        met, "met" if met else f"{cpu - TARGET_SERVER_CPU_US:+.0f} µs ({cpu / TARGET_SERVER_CPU_US - 1:+.0%}) over",
    )


def _server_cpu(cell: Cell) -> float:
    """The ext_proc server's (or router's) own CPU per request: every role but Envoy."""
    return sum(us for role, us in cell.cpu_us_per_request.items() if role != "envoy")


def _total_cpu(cell: Cell) -> float:
    return sum(cell.cpu_us_per_request.values())


def floors(table: list[Cell], workers: str = HEADLINE) -> list[dict[str, Any]]:
    """Per (mode, concurrency) of the cheap set: our server against the two floors and the peer.

    "Our own work" is our server's CPU per P/D request minus the grpc.aio floor's (the same transport doing
    nothing); totals are server + its Envoy, against the compiled floor's server + its Envoy and the peer
    router's one process."""
    rows = []
    for ours in (c for c in table if c.workers == workers and c.system == "pd-extproc"):
        aio, cxx = (find(table, name, ours.body, ours.concurrency, workers) for name in (FLOOR_AIO, FLOOR_CXX))
        peer = find(table, "vllm-router", ours.body, ours.concurrency, workers)
        if aio is None or cxx is None:
            continue
        server, total = _server_cpu(ours), _total_cpu(ours)
        row: dict[str, Any] = {
            "body": ours.body, "concurrency": ours.concurrency,
            "server_us": server, "floor_aio_server_us": _server_cpu(aio), "own_work_us": server - _server_cpu(aio),
            "floor_cxx_server_us": _server_cpu(cxx), "total_us": total, "floor_cxx_total_us": _total_cpu(cxx),
            "total_over_cxx": _ratio(total, _total_cpu(cxx)), "server_over_aio": _ratio(server, _server_cpu(aio)),
            "rps_over_cxx": _ratio(ours.rps, cxx.rps), "added_p50_ms": ours.added_p50_ms,
            "floor_cxx_added_p50_ms": cxx.added_p50_ms, "floor_aio_added_p50_ms": aio.added_p50_ms,
        }
        if peer is not None:
            row.update(peer_total_us=_total_cpu(peer), total_over_peer=_ratio(total, _total_cpu(peer)),
                       rps_over_peer=_ratio(ours.rps, peer.rps))
        rows.append(row)
    return sorted(rows, key=lambda r: (r["body"], r["concurrency"]))


def envoy_share(table: list[Cell], workers: str = HEADLINE) -> list[dict[str, Any]]:
    """Per ENVOY_SHARE_SYSTEMS system at ENVOY_SHARE_POINT: the CPU per request of its Envoy and of its server,
    its throughput, and its Envoy's CPU minus floor-aio's Envoy's (None without a floor-aio cell)."""
    body, concurrency = ENVOY_SHARE_POINT
    floor = find(table, FLOOR_AIO, body, concurrency, workers)
    floor_envoy = floor.cpu_us_per_request.get("envoy") if floor is not None else None
    rows = []
    for name in ENVOY_SHARE_SYSTEMS:
        cell = find(table, name, body, concurrency, workers)
        if cell is None:
            continue
        envoy = cell.cpu_us_per_request.get("envoy", float("nan"))
        rows.append({"system": name, "envoy_us": envoy, "server_us": _server_cpu(cell), "rps": cell.rps,
                     "envoy_over_floor_us": None if floor_envoy is None else envoy - floor_envoy,
                     "problems": cell.problems, "noisy": cell.worst_foreign_cpu_share})
    return rows


def target_envoy_share(table: list[Cell]) -> Verdict | None:
    """Envoy's CPU per P/D request in front of our server within TARGET_ENVOY_OVER_FLOOR_US of floor-aio's."""
    rows = {row["system"]: row for row in envoy_share(table)}
    ours, floor = rows.get("pd-extproc"), rows.get(FLOOR_AIO)
    if ours is None or floor is None:
        return None
    over = ours["envoy_over_floor_us"]
    met = over <= TARGET_ENVOY_OVER_FLOOR_US
    return Verdict(
        f"Envoy's CPU per P/D request within {TARGET_ENVOY_OVER_FLOOR_US:.0f} µs of floor-aio's (c=64)",
        f"pd-extproc's Envoy {ours['envoy_us']:.0f} µs - floor-aio's Envoy {floor['envoy_us']:.0f} µs = {over:+.0f} µs",
        met, "met" if met else f"{over - TARGET_ENVOY_OVER_FLOOR_US:+.0f} µs over")


def targets_issue28(table: list[Cell]) -> list[Verdict]:
    """Issue 28's targets on the cheap vLLM set, non-streaming, ratios within this run."""
    found: list[Verdict] = []
    ours = find(table, "pd-extproc", "non-stream", 64)
    aio = find(table, FLOOR_AIO, "non-stream", 64)
    if ours is not None and aio is not None:
        own = _server_cpu(ours) - _server_cpu(aio)
        met = own <= TARGET_OWN_WORK_US
        found.append(Verdict(
            f"our own work per P/D request at c=64 (server CPU above the grpc.aio floor's) "
            f"<= {TARGET_OWN_WORK_US:.0f} µs",
            f"pd-extproc {_server_cpu(ours):.0f} µs - floor-aio {_server_cpu(aio):.0f} µs = {own:.0f} µs",
            met, "met" if met else f"{own - TARGET_OWN_WORK_US:+.0f} µs over"))
        ratio = _ratio(_server_cpu(ours), _server_cpu(aio))
        met = ratio <= TARGET_OVER_AIO_FLOOR
        found.append(Verdict(
            f"server CPU per P/D request at c=64 <= {TARGET_OVER_AIO_FLOOR:g}x the grpc.aio floor's",
            f"ratio {ratio:.2f}", met, "met" if met else f"ratio {ratio:.2f} for {TARGET_OVER_AIO_FLOOR:g}"))
    one = find(table, "pd-extproc", "non-stream", 1)
    if one is not None and one.added_p50_ms is not None:
        met = one.added_p50_ms <= TARGET_ADDED_P50_MS
        found.append(Verdict(f"P/D added p50 at c=1 <= {TARGET_ADDED_P50_MS:g} ms", f"{one.added_p50_ms:.3f} ms",
                             met, "met" if met else f"{one.added_p50_ms - TARGET_ADDED_P50_MS:+.3f} ms over"))
    throughput = target_throughput(table, "non-stream", factor=TARGET_THROUGHPUT_VS_ROUTER)
    if throughput is not None:
        found.append(throughput)
    return found


def validity(table: list[Cell], points: Sequence[dict[str, Any]] = ()) -> list[dict[str, Any]]:
    """Per cheap worker set: direct decode's throughput over the fastest P/D proxy's, at every point. Where
    that ratio is below VALIDITY_FACTOR (at concurrency 1 direct decode is bound by the load generator's
    round trip, not by the worker), the point is judged at the workers instead: valid if, during every P/D
    point there, no worker process was more than WORKER_BUSY_BOUND busy (``points``' ``worker_busy``: its
    CPU over the load's wall time); a P/D point without that measurement leaves it invalid."""
    checks = []
    for workers in sorted({c.workers for c in table if c.workers.startswith("cheap")}):
        worst: tuple[float, str] | None = None
        judged: list[str] = []  # points under the ratio, judged at the workers
        valid = True
        for direct in (c for c in table if c.workers == workers and c.system == "direct"):
            proxies = [c for c in table if c.workers == workers and c.system in PD_SYSTEMS
                       and (c.body, c.concurrency) == (direct.body, direct.concurrency)]
            if not proxies:
                continue
            fastest = max(proxies, key=lambda c: c.rps)
            ratio = _ratio(direct.rps, fastest.rps)
            where = (f"{direct.body} c={direct.concurrency}: direct {direct.rps:.0f} req/s, "
                     f"{fastest.system} {fastest.rps:.0f}")
            if worst is None or ratio < worst[0]:
                worst = (ratio, where)
            if ratio >= VALIDITY_FACTOR:
                continue
            busiest, unmeasured = busiest_worker(
                p for p in points if p.get("phase") == "latency" and p.get("workers") == workers
                and p.get("system") in PD_SYSTEMS and p.get("body") == direct.body
                and p.get("concurrency") == direct.concurrency)
            if unmeasured or busiest is None:
                valid = False
                judged.append(f"{direct.body} c={direct.concurrency}: workers' CPU not measured")
                continue
            busy, point, role = busiest
            valid = valid and busy <= WORKER_BUSY_BOUND
            judged.append(f"{direct.body} c={direct.concurrency}: {busy:.0%} ({point['system']} round "
                          f"{point['round']}: {role} worker)")
        if worst is not None:
            checks.append({"workers": workers, "ratio": worst[0], "where": worst[1], "judged_at_workers": judged,
                           "valid": valid})
    return checks


def busiest_worker(points: Iterable[dict[str, Any]]) -> tuple[tuple[float, dict[str, Any], str] | None, int]:
    """The busiest worker process during ``points`` (its busy share: CPU over the load's wall time, the point,
    the worker's role), and how many of the points lack that measurement."""
    busiest: tuple[float, dict[str, Any], str] | None = None
    unmeasured = 0
    for point in points:
        busy = point.get("worker_busy") or {}
        if not busy:
            unmeasured += 1
            continue
        role = max(busy, key=busy.__getitem__)
        if busiest is None or busy[role] > busiest[0]:
            busiest = (busy[role], point, role)
    return busiest, unmeasured


def target_passthrough(table: list[Cell]) -> Verdict | None:
    """Every (mode, concurrency): passthrough's p50 within +5 % and throughput within -5 % of plain Envoy."""
    worst_latency, worst_rps = 0.0, float("inf")
    where_latency = where_rps = ""
    for cell in table:
        if cell.system != "passthrough" or cell.workers != HEADLINE:
            continue
        plain = find(table, "envoy", cell.body, cell.concurrency, cell.workers)
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
        "passthrough within 5 % of Envoy alone (p50 latency and throughput, every point, cheap workers)",
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
    """Issue 36's Envoy share, issue 28's targets, then issue 17's in its order: each "first" step, then the
    final one."""
    found: list[Verdict | None] = [target_envoy_share(table), *targets_issue28(table), target_server_cpu(table)]
    for body in ("non-stream", "stream"):
        found += [target_latency(table, body, factor=2.0), target_latency(table, body)]
    for body in ("non-stream", "stream"):
        found += [target_throughput(table, body, factor=0.45), target_throughput(table, body)]
    found += [target_passthrough(table)]
    for body in ("non-stream", "stream"):
        found += [target_latency(table, body, "smg", workers="cheap-sglang"),
                  target_throughput(table, body, "smg", workers="cheap-sglang")]
    found += [target_rss(inflight)]
    return [v for v in found if v is not None]


def summary(results: dict[str, Any]) -> dict[str, Any]:
    """What plot.py and the Markdown report read: latency and large-body cells, and verdicts."""
    latency = cells(results["points"], "latency")
    return {
        "latency": [asdict(c) for c in latency],
        "large_body": [asdict(c) for c in cells(results["points"], "large-body")],
        "profile_run": [asdict(c) for c in cells(results["points"], "profile")],
        "verdicts": [asdict(v) for v in verdicts(latency, results["inflight"])],
        "floors": floors(latency),
        "envoy_share": envoy_share(latency),
        "validity": validity(latency, results["points"]),
    }
