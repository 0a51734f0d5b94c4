"""How many CPUs this process may use: ``PD_EXTPROC_WORKERS=auto`` (docs/workers.md).

The smallest of the cores it may run on (``os.sched_getaffinity``) and the CFS bandwidth quota of its
cgroup and every ancestor up to the mount (v2: ``cpu.max``; v1: ``cpu.cfs_quota_us`` over
``cpu.cfs_period_us``), rounded up, at least 1. A container limited to 1.5 CPUs gets 2 processes: the
quota caps their CPU together, and a half-used core still serves one more process's I/O waits.

The cgroup is read from files only (``/proc/self/cgroup``, ``/proc/self/mountinfo``): no cgroup library.
``available_cpus`` is the pure part, over a folder laid out as the kernel lays out /sys/fs/cgroup.
"""

from __future__ import annotations

import math
import os
from pathlib import Path, PurePosixPath

CGROUP_ROOT = Path("/sys/fs/cgroup")
V1_CONTROLLERS = ("cpu", "cpu,cpuacct", "cpuacct,cpu")


def quota_of(directory: Path) -> float | None:
    """The CPU quota set on one cgroup folder, in CPUs; None for none (``max``, -1) or no such file."""
    v2 = directory / "cpu.max"
    try:
        if v2.is_file():
            quota, _, period = v2.read_text().strip().partition(" ")
            if quota == "max":
                return None
            return int(quota) / int(period or "100000")
        quota_file, period_file = directory / "cpu.cfs_quota_us", directory / "cpu.cfs_period_us"
        if quota_file.is_file() and period_file.is_file():
            quota_us = int(quota_file.read_text().strip())
            return None if quota_us < 0 else quota_us / int(period_file.read_text().strip())
    except (OSError, ValueError, ZeroDivisionError):  # unreadable or malformed: no limit known
        return None
    return None


def cgroup_quota(mount: Path, own_path: str) -> float | None:
    """The tightest quota from ``mount``/``own_path`` up to ``mount`` itself (a parent's quota binds too)."""
    quotas = []
    parts = [part for part in PurePosixPath(own_path.strip() or "/").parts[1:] if part not in ("..", ".")]
    for depth in range(len(parts), -1, -1):
        quota = quota_of(mount.joinpath(*parts[:depth]))
        if quota is not None and quota > 0:
            quotas.append(quota)
    return min(quotas) if quotas else None


def available_cpus(cores: int, quota: float | None) -> int:
    """Processes to run: the cores, or the quota rounded up if lower; at least 1."""
    limit = cores if quota is None else min(cores, math.ceil(quota))
    return max(1, limit)


def own_cgroups(proc_self_cgroup: str) -> tuple[str | None, str | None]:
    """(v2 path, v1 cpu-controller path) of this process, from /proc/self/cgroup's text."""
    v2 = v1 = None
    for line in proc_self_cgroup.splitlines():
        hierarchy, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if hierarchy == "0" and controllers == "":
            v2 = path
        elif "cpu" in controllers.split(","):
            v1 = path
    return v2, v1


def cgroup_cpu_quota(root: Path = CGROUP_ROOT, proc_self_cgroup: str | None = None) -> float | None:
    """This process's CPU quota, v2 first, then v1; None when neither sets one.

    In a container with its own cgroup namespace /proc/self/cgroup says ``/`` and the mount is its own
    cgroup; on a host the path is below the root mount.
    """
    if proc_self_cgroup is None:
        try:
            proc_self_cgroup = Path("/proc/self/cgroup").read_text()
        except OSError:
            proc_self_cgroup = ""
    v2, v1 = own_cgroups(proc_self_cgroup)
    if v2 is not None and (root / "cgroup.controllers").is_file():
        return cgroup_quota(root, v2)
    if v1 is not None:
        for controller in V1_CONTROLLERS:
            if (root / controller).is_dir():
                return cgroup_quota(root / controller, v1)
    return None


def auto_workers() -> int:
    """``PD_EXTPROC_WORKERS=auto`` on this machine, in this container."""
    return available_cpus(len(os.sched_getaffinity(0)), cgroup_cpu_quota())
