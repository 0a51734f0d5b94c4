"""What every paired A/B harness in bench/ shares (bench/servicer_ab.py, bench/logwriter_ab.py,
bench/metrics_ab.py): one measurement in a fresh process importing one checkout's ``extproc``, runs in
the order A, B, A' so that A' - A is the harness's own noise beside B - A, and the summary of the two as
medians with quartiles."""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path


def run_in_tree(script: str, tree: Path, argv: Sequence[str]) -> float:
    """``script`` run as __main__ with ``argv`` in ``tree`` (its ``extproc`` is the one imported); the one
    number it prints."""
    code = f"import runpy, sys; sys.argv = {list(argv)!r}; runpy.run_path({script!r}, run_name='__main__')"
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, "PYTHONPATH": str(tree)},
                         capture_output=True, text=True, check=True, cwd=tree).stdout
    return float(out.strip())


@dataclass(frozen=True)
class Paired:
    old: list[float]
    new: list[float]
    again: list[float]  # A' : the old tree measured once more, after B

    def summary(self) -> str:
        diff = [b - a for a, b in zip(self.old, self.new, strict=True)]
        noise = [c - a for a, c in zip(self.old, self.again, strict=True)]
        return (f"new - old median {statistics.median(diff):+.1f} (IQR {quartiles(diff)}), "
                f"A/A median {statistics.median(noise):+.1f} (IQR {quartiles(noise)}); {len(diff)} runs")


def paired(measure: Callable[[Path], float], old: Path, new: Path, runs: int) -> Paired:
    """``runs`` rounds of A, B, A' (``measure`` of the old tree, the new, the old again)."""
    rounds = [(measure(old), measure(new), measure(old)) for _ in range(runs)]
    return Paired([r[0] for r in rounds], [r[1] for r in rounds], [r[2] for r in rounds])


def quartiles(values: list[float]) -> str:
    low, _, high = statistics.quantiles(values, n=4)
    return f"{low:+.1f}..{high:+.1f}"
