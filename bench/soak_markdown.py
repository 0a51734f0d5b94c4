"""A soak report (bench/soak.py --json) as the Markdown of bench/SOAK.md:
``python -m bench.soak_markdown report.json``."""

from __future__ import annotations

import json
import statistics
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any


def render(data: dict[str, Any]) -> str:
    lines = [
        f"**{data['engine']}**, started {data['started_utc']}: {data['seconds'] / 60:.1f} min, "
        f"{data['requests']:,} requests at {data['rate']}/s (Poisson, seed {data['seed']}), "
        f"{data['segments']} segments of {data['segment_seconds']:.0f} s, "
        f"{len(data['faults'])} faults; **{len(data['failures'])} failures**.",
        "",
        f"Command: `{data['command']}`",
        "",
        "| fault | injected | cleared after (s, median) | served again after (s): median / max |",
        "|---|---|---|---|",
    ]
    by_fault: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for fault in data["faults"]:
        by_fault[fault["fault"]].append(fault)
    for name, faults in sorted(by_fault.items()):
        recoveries = [f["recovery_seconds"] for f in faults if f["recovery_seconds"] is not None]
        cleared = statistics.median(f["cleared_after"] for f in faults)
        rec = f"{statistics.median(recoveries):.2f} / {max(recoveries):.2f}" if recoveries else "never"
        lines.append(f"| {name} | {len(faults)} | {cleared:.1f} | {rec} |")
    lines += ["", "| answer | count |", "|---|---|"]
    for label, count in sorted(data["labels"].items(), key=lambda item: -item[1]):
        lines.append(f"| `{label}` | {count:,} |")
    ledger = data["ledger"]
    unpulled = ", ".join(f"{label} {count}" for label, count in sorted(data["unpulled_by_label"].items()))
    lines += ["", f"KV ledger: {ledger.get('granted', 0):,} handoffs granted by the prefill worker, "
                  f"{ledger.get('pulled', 0):,} pulled by decode for the same request; not pulled (freed by the "
                  f"engine's lease or abort), by the client's answer: {unpulled or 'none'}; "
                  f"{ledger.get('unverifiable', 0)} decode pulls whose grant died with a killed prefill worker.",
              "", "| server process | fds (minus pooled) / h | RSS MiB / h | after 3 rests | RSS first → last (MiB) | "
                  "event-loop tasks / h | idle pooled connections / h |", "|---|---|---|---|---|---|---|"]
    for name, slope in data["slopes"].items():
        lines.append(f"| {name} | {_n(slope['fds_per_hour'])} | {_n(slope['rss_mib_per_hour'])} | "
                     f"{_n(slope.get('rss_mib_per_hour_warm'))} | "
                     f"{slope['rss_mib_first']} → {slope['rss_mib_last']} | {_n(slope['loop_tasks_per_hour'])} | "
                     f"{_n(slope['idle_pool_per_hour'])} |")
    checks = data["counter_checks"]
    samples = data["samples"]
    lines += ["", f"Counters compared with the client's tally: ours in {checks.get('server_compared', 0)} segments, "
                  f"Envoy's in {checks.get('envoy_compared', 0)} (the others span a restart of that process). "
                  f"At rest (all {len(samples)} checkpoints): in-flight, admission slots and background "
                  f"prefills {_all_zero(samples)}; fds {min(s['fds'] for s in samples)}–"
                  f"{max(s['fds'] for s in samples)}; event-loop tasks "
                  f"{min(s['loop_tasks'] for s in samples):.0f}–{max(s['loop_tasks'] for s in samples):.0f}."]
    if data["failures"]:
        lines += ["", "Failures:", ""] + [f"- {failure}" for failure in data["failures"][:30]]
    return "\n".join(lines) + "\n"


def _n(value: float | None) -> str:
    return "—" if value is None else f"{value:+.2f}"


def _all_zero(samples: list[dict[str, Any]]) -> str:
    zero = all(s["inflight"] == 0 and s["admitted"] == 0 and s["background"] == 0 for s in samples)
    return "0 every time" if zero else "NOT always 0"


if __name__ == "__main__":
    sys.stdout.write(render(json.loads(Path(sys.argv[1]).read_text())))
