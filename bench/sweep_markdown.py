"""RESULTS.md's size-sweep section, from the summary bench/sweep_report.py wrote."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

SYSTEMS = ("envoy", "pd-extproc", "vllm-router")  # direct decode is the floor every added latency is paired with
MIB = 1 << 20


def _size(body_bytes: int) -> str:
    return f"{body_bytes / MIB:g} MiB" if body_bytes >= MIB else f"{body_bytes >> 10} KiB"


def _table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    return ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|",
            *("| " + " | ".join(row) + " |" for row in rows)]


def _num(value: float | None, digits: int = 0) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _cell(row: dict[str, Any] | None) -> str:
    if row is None:
        return "-"
    flag = " ✗" if row["problems"] else ""
    return f"{_num(row['added_p50_ms'], 2)} ms / {_num(row['cpu_us'])} µs{flag}"


def _per_mib(row: dict[str, Any] | None) -> str:
    if row is None or row["cpu_us_per_mib"] is None:
        return "-"
    return f"{_num(row['added_ms_per_mib'], 2)} ms / {_num(row['cpu_us_per_mib'])} µs"


def render(sweep: dict[str, Any], options: dict[str, Any], placeholder: str = "") -> list[str]:
    """The section, or nothing when the run had no sweep. ``placeholder``: a note printed first, for figures
    pasted into another run's report (no plot link then: the plot is not kept)."""
    if not sweep:
        return []
    rows = sweep["rows"]
    index = {(r["kind"], r["body_bytes"], r["system"]): r for r in rows}
    keys = sorted({(r["kind"], r["body_bytes"]) for r in rows})
    cost = [[kind, _size(size), *(_cell(index.get((kind, size, s))) for s in SYSTEMS)] for kind, size in keys]
    marginal = [[kind, _size(size), *(_per_mib(index.get((kind, size, s))) for s in SYSTEMS)]
                for kind, size in keys if any(index.get((kind, size, s), {}).get("cpu_us_per_mib") is not None
                                              for s in SYSTEMS)]
    ratios = [[r["kind"], _size(r["body_bytes"]), _num(r["latency"], 2), _num(r["cpu"], 2)] for r in sweep["ratios"]]
    growth = [[g["kind"], g["system"], _num(g["latency_exponent"], 2), _num(g["cpu_exponent"], 2),
               "**super-linear**" if g["superlinear"] else "linear or below"] for g in sweep["growth"]
              if g["system"] != "direct"]
    verdicts = [[v["target"], v["measured"], "met" if v["met"] else "**missed**"] for v in sweep["verdicts"]]
    validity = [[c["workers"], "-" if c.get("busy") is None else f"{c['busy']:.0%}", c["where"],
                 "valid" if c["valid"] else "**INVALID**"] for c in sweep["validity"]]
    throughput = [[c["workers"], f"{c['ratio']:.1f}x", c["where"]] for c in sweep.get("throughput_ratio", [])]
    lines = ["## Cost by prompt size (cheap workers, non-streaming)", ""]
    if placeholder:
        lines += [placeholder, ""]
    lines += [
        f"Chat (one user message) and completions (`prompt`) bodies of exactly each size, plain prose; "
        f"concurrency {options['sweep_concurrency']}, {options['sweep_rounds']} round(s) of "
        f"{options['sweep_seconds']} s per point, systems in a rotated order. Each cell: added p50 over direct "
        "decode (paired by round) / CPU per request of all the proxy's processes and their children (ours: "
        "server, its inspection pool, its Envoy; vllm-router: its one process; Envoy alone: Envoy). "
        "✗ = a problem at that point (see the checks below).", "",
        *_table(["kind", "body", *SYSTEMS], cost), "",
        *([] if placeholder else ["![Cost by body size](size_sweep.png)", ""]),
        "Cost per MiB above the smallest body (marginal: the fixed cost of a request taken out), added p50 / CPU:",
        "", *_table(["kind", "body", *SYSTEMS], marginal), "",
        "pd-extproc's per-MiB cost over vllm-router's (the issue's bound: at most 2x from 1 MiB):", "",
        *_table(["kind", "body", "added p50", "CPU"], ratios), "",
        "Growth: the exponent of a least-squares fit of log(marginal cost) on log(size) from 256 KiB (1 = linear, "
        "2 = quadratic; flagged above 1.3):", "",
        *_table(["kind", "system", "added p50", "CPU", "growth"], growth), "",
        *_table(["target", "measured", "verdict"], verdicts), "",
        f"Validity: during every P/D point, each worker process's CPU (utime + stime) over the point's wall time "
        f"at most {sweep['worker_busy_bound']:.0%} (a worker with that headroom could serve 5x the load "
        "it got: the headline's margin, measured at the worker; docs/benchmarks.md says why the sweep judges the "
        "workers directly):", "",
        *_table(["workers", "busiest worker", "at", "verdict"], validity), "",
        "For information, the headline's ratio (direct decode's throughput over the fastest P/D proxy's, lowest "
        "point of the sweep):", "",
        *_table(["workers", "lowest direct / fastest P/D proxy", "at"], throughput), "",
    ]
    return lines
