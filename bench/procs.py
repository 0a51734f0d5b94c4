"""Reading a process's CPU time and memory from /proc, and picking free loopback ports."""

from __future__ import annotations

import contextlib
import os
import socket
from pathlib import Path

_CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
_KIB = 1024


def _cpu_of(stat: str) -> float:
    """utime + stime, in seconds, of a /proc ``stat`` line (a process's or one thread's)."""
    # The command name (field 2) may hold spaces; the fields after its closing parenthesis do not.
    fields = stat.rsplit(")", 1)[1].split()
    user_ticks, system_ticks = int(fields[11]), int(fields[12])
    return (user_ticks + system_ticks) / _CLOCK_TICKS


def cpu_seconds(pid: int) -> float:
    """utime + stime of the whole process (every thread), in seconds."""
    return _cpu_of(Path(f"/proc/{pid}/stat").read_text())


def thread_cpu_seconds(pid: int, proc: Path = Path("/proc")) -> dict[str, float]:
    """utime + stime of each thread of ``pid`` so far, in seconds, summed by thread name."""
    seconds: dict[str, float] = {}
    for task in (proc / str(pid) / "task").iterdir():
        try:
            stat = (task / "stat").read_text()
        except OSError:  # the thread ended meanwhile
            continue
        name = stat[stat.index("(") + 1:stat.rindex(")")]
        seconds[name] = seconds.get(name, 0.0) + _cpu_of(stat)
    return seconds


def tree_cpu_seconds(pid: int) -> float:
    """utime + stime of a process, its live descendants and the children it has reaped (cutime + cstime):
    a server's own worker processes (the inspection pool, spawned on the first large body) count too."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:  # exited since it was listed
        return 0.0
    total = sum(int(value) for value in fields[11:15]) / _CLOCK_TICKS
    return total + sum(tree_cpu_seconds(child) for child in children(pid))


def children(pid: int) -> list[int]:
    found: list[int] = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        with contextlib.suppress(OSError):
            found += [int(child) for child in (task / "children").read_text().split()]
    return found


def _status_kib(pid: int, key: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    raise KeyError(key)


def rss_bytes(pid: int) -> int:
    """The resident set size now."""
    return _status_kib(pid, "VmRSS") * _KIB


def peak_rss_bytes(pid: int) -> int:
    """The highest resident set size since start or since reset_peak_rss (VmHWM)."""
    return _status_kib(pid, "VmHWM") * _KIB


def reset_peak_rss(pid: int) -> bool:
    """Restart VmHWM from the current RSS (needs root or the same user); False if refused."""
    try:
        Path(f"/proc/{pid}/clear_refs").write_text("5")
    except OSError:
        return False
    return True


def free_port(host: str = "127.0.0.1") -> int:
    """A port nobody listens on right now. Only for programs that cannot bind port 0 themselves and
    report it; the caller must retry if the program then fails to bind."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind((host, 0))
        return int(probe.getsockname()[1])


def alive(pid: int) -> bool:
    with contextlib.suppress(OSError):
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    return False
