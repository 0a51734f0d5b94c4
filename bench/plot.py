"""Plot added latency vs concurrency per system from results.json's summary, and the size sweep's cost by body
size when the run had one.

Run with the bench virtualenv's Python (it has matplotlib): ``python bench/plot.py RESULTS_JSON PNG [SWEEP_PNG]``.
It imports nothing from the project, so the project's own environment needs no plotting libraries.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # after use(): the backend must be chosen first

SYSTEMS = {  # name -> (label, colour, marker)
    "envoy": ("Envoy alone", "tab:gray", "s"),
    "passthrough": ("our Envoy, passthrough", "tab:blue", "o"),
    "floor-cxx": ("our Envoy + a compiled do-nothing ext_proc (the design's floor)", "black", "."),
    "floor-aio": ("our Envoy + a grpc.aio do-nothing ext_proc (grpc.aio's floor)", "tab:brown", "."),
    "pd-extproc": ("pd-extproc P/D", "tab:red", "D"),
    "pd-extproc-x2": ("pd-extproc P/D, 2 server processes", "tab:orange", "d"),
    "vllm-router": ("vllm-router 0.1.17 P/D", "tab:green", "^"),
    "smg": ("smg 1.13 P/D (SGLang-shaped workers)", "tab:purple", "v"),
    "direct-prefill": ("direct prefill (reference)", "tab:olive", "x"),
}
PANELS = (("non-stream", "added_p50_ms", "p50"), ("stream", "added_p50_ms", "p50"),
          ("non-stream", "added_p99_ms", "p99"), ("stream", "added_p99_ms", "p99"))


def _series(cells: list[dict[str, Any]], system: str, body: str, key: str) -> tuple[list[int], list[float]]:
    """The cheap workers' cells (smg and pd-extproc's sglang adapter run on the cheap-sglang set; only smg is
    drawn from it)."""
    workers = "cheap-sglang" if system == "smg" else "cheap"
    chosen = sorted((c for c in cells if c["system"] == system and c["body"] == body and c[key] is not None
                     and c.get("workers", "emulated") == workers), key=lambda c: c["concurrency"])
    return [c["concurrency"] for c in chosen], [c[key] for c in chosen]


def plot(results: dict[str, Any], output: Path) -> None:
    cells = results["summary"]["latency"]
    figure, axes = plt.subplots(2, 2, figsize=(12, 9), sharex=True)
    for axis, (body, key, label) in zip(axes.flat, PANELS, strict=True):
        for system, (name, colour, marker) in SYSTEMS.items():
            x, y = _series(cells, system, body, key)
            if x:
                axis.plot(x, y, label=name, color=colour, marker=marker)
        axis.set_xscale("log", base=2)
        axis.set_yscale("symlog", linthresh=1.0)
        axis.set_title(f"{body}: added {label} latency over direct decode (cheap workers)")
        axis.set_ylabel("ms (symlog)")
        axis.grid(True, which="both", alpha=0.3)
        levels = results["options"]["concurrency"]
        axis.set_xticks(levels, [str(level) for level in levels])
    for axis in axes[1]:
        axis.set_xlabel("concurrent clients")
    axes[0][0].legend(loc="upper left", fontsize=9)
    machine = results["machine"]
    figure.suptitle(f"pd-extproc benchmark, {machine['nproc']} cores ({machine['cpu']}), {results['started']} UTC",
                    fontsize=11)
    figure.tight_layout()
    figure.savefig(output, dpi=110)


SWEEP_SYSTEMS = ("envoy", "pd-extproc", "vllm-router")
SWEEP_PANELS = (("chat", "added_p50_ms", "added p50 over direct decode (ms)"),
                ("completions", "added_p50_ms", "added p50 over direct decode (ms)"),
                ("chat", "cpu_us", "CPU per request, all proxy processes (µs)"),
                ("completions", "cpu_us", "CPU per request, all proxy processes (µs)"))


def plot_sweep(results: dict[str, Any], output: Path) -> None:
    rows = results["summary"]["size_sweep"]["rows"]
    figure, axes = plt.subplots(2, 2, figsize=(12, 9), sharex=True)
    for axis, (kind, key, label) in zip(axes.flat, SWEEP_PANELS, strict=True):
        for system in SWEEP_SYSTEMS:
            name, colour, marker = SYSTEMS[system]
            chosen = sorted((r for r in rows if r["kind"] == kind and r["system"] == system and r[key] is not None
                             and r[key] > 0), key=lambda r: r["body_bytes"])
            if chosen:
                axis.plot([r["body_bytes"] / 1024 for r in chosen], [r[key] for r in chosen], label=name,
                          color=colour, marker=marker)
        axis.set_xscale("log", base=2)
        axis.set_yscale("log")
        axis.set_xticks([1, 16, 256, 1024, 8192], ["1 KiB", "16 KiB", "256 KiB", "1 MiB", "8 MiB"])
        axis.set_title(f"{kind}: {label}", fontsize=10)
        axis.grid(True, which="both", alpha=0.3)
    for axis in axes[1]:
        axis.set_xlabel("request body (KiB)")
    axes[0][0].legend(loc="upper left", fontsize=9)
    figure.suptitle(f"pd-extproc cost by body size (cheap workers, c={results['options']['sweep_concurrency']}), "
                    f"{results['started']} UTC", fontsize=11)
    figure.tight_layout()
    figure.savefig(output, dpi=110)


def main(argv: list[str]) -> int:
    results = json.loads(Path(argv[1]).read_text())
    if results["summary"].get("latency"):
        plot(results, Path(argv[2]))
    if len(argv) > 3 and results["summary"].get("size_sweep"):
        plot_sweep(results, Path(argv[3]))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
