"""What the benchmark ran on, and how busy the machine was with work that was not the benchmark's."""

from __future__ import annotations

import os
import platform
import resource
import subprocess
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from bench import procs

_CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def busy_cpu_seconds() -> float:
    """CPU seconds the whole machine spent not idle since boot, all cores together."""
    fields = [int(v) for v in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    user, nice, system, _idle, _iowait, irq, softirq, steal = fields[:8]
    return (user + nice + system + irq + softirq + steal) / _CLOCK_TICKS


def own_cpu_seconds(pids: Iterable[int]) -> float:
    """CPU of the benchmark: this process, its waited-for children (wrk), and the running fleet."""
    mine = resource.getrusage(resource.RUSAGE_SELF)
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    total = mine.ru_utime + mine.ru_stime + children.ru_utime + children.ru_stime
    for pid in pids:
        try:
            total += procs.cpu_seconds(pid)
        except OSError:
            continue
    return total


@dataclass(frozen=True, slots=True)
class LoadSnapshot:
    busy: float
    own: float

    @classmethod
    def take(cls, pids: Iterable[int]) -> LoadSnapshot:
        return cls(busy_cpu_seconds(), own_cpu_seconds(pids))

    def foreign_share(self, before: LoadSnapshot, wall_seconds: float) -> float:
        """Share of the machine's capacity (all cores) used by other processes between two snapshots."""
        capacity = wall_seconds * (os.cpu_count() or 1)
        foreign = (self.busy - before.busy) - (self.own - before.own)
        return max(0.0, foreign / capacity) if capacity else 0.0


def wait_for_quiet(pids: Iterable[int], threshold: float, max_wait: float, window: float = 2.0) -> tuple[float, float]:
    """Wait (at most ``max_wait`` seconds) until other processes use less than ``threshold`` of the machine
    over one ``window``; return (seconds waited, the last window's foreign share)."""
    started = time.monotonic()
    pid_list = list(pids)
    while True:
        before, window_started = LoadSnapshot.take(pid_list), time.monotonic()
        time.sleep(window)
        share = LoadSnapshot.take(pid_list).foreign_share(before, time.monotonic() - window_started)
        waited = time.monotonic() - started
        if share < threshold or waited >= max_wait:
            return waited, share


def _first_line(argv: list[str]) -> str:
    try:
        completed = subprocess.run(argv, capture_output=True, text=True, timeout=30, check=False)
    except OSError as error:
        return f"unavailable ({error.strerror})"
    text = (completed.stdout or completed.stderr).strip()
    return text.splitlines()[0] if text else "unknown"


def _cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


def _memory_gib() -> float:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemTotal:"):
            return int(line.split()[1]) / (1 << 20)
    return 0.0


def source_version(repo: Path) -> str:
    """The commit measured, and whether extproc/ had uncommitted changes at the time."""
    commit = _first_line(["git", "-C", str(repo), "rev-parse", "--short", "HEAD"])
    dirty = _first_line(["git", "-C", str(repo), "status", "--porcelain", "--", "extproc"]) not in ("unknown", "")
    return commit + (" + uncommitted changes in extproc/" if dirty else "")


def describe(envoy: str, vllm_router_python: str, repo: Path) -> dict[str, str]:
    os_release = dict(
        line.split("=", 1) for line in Path("/etc/os-release").read_text().splitlines() if "=" in line
    )
    return {
        "pd-extproc source": source_version(repo),
        "nproc": str(os.cpu_count()),
        "niceness of the bench processes": str(os.nice(0)),
        "cpu": _cpu_model(),
        "memory": f"{_memory_gib():.1f} GiB",
        "kernel": platform.release(),
        "os": os_release.get("PRETTY_NAME", "unknown").strip('"'),
        "python": platform.python_version(),
        "envoy": _first_line([envoy, "--version"]).split("version:")[-1].strip(),
        "wrk": _first_line(["wrk", "--version"]).split(" [")[0],
        "vllm-router": _first_line([vllm_router_python, "-c",
                                    "import importlib.metadata as m; print(m.version('vllm-router'))"]),
        "smg": _first_line([vllm_router_python, "-c", "import importlib.metadata as m; print(m.version('smg'))"]),
        "grpc++ (floor-cxx)": _first_line(["dpkg-query", "-W", "-f", "${Version}", "libgrpc++-dev"]),
    }
