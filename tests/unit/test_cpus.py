"""``PD_EXTPROC_WORKERS=auto``: the CPUs a process may use, over fake cgroup trees laid out as the kernel's."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from extproc import cpus
from extproc.config import ConfigError, load_settings
from extproc.cpus import available_cpus, cgroup_cpu_quota, own_cgroups

V2_SELF = "0::/kubepods/pod1/ctr\n"
V1_SELF = "12:memory:/docker/abc\n4:cpu,cpuacct:/docker/abc\n1:name=systemd:/docker/abc\n"


def _write(root: Path, relative: str, text: str) -> None:
    path = root / relative
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def _v2_tree(root: Path) -> Path:
    _write(root, "cgroup.controllers", "cpuset cpu io memory pids\n")
    return root


@pytest.mark.parametrize("cores,quota,expected", [
    (8, None, 8),  # no quota: the cores
    (8, 2.0, 2),  # a quota below the cores wins
    (8, 1.5, 2),  # rounded up
    (8, 0.2, 1),  # at least 1
    (2, 16.0, 2),  # a quota above the cores: the cores
    (1, None, 1),
])
def test_the_count_is_the_smaller_of_cores_and_quota_at_least_one(cores: int, quota: float | None,
                                                                   expected: int) -> None:
    assert available_cpus(cores, quota) == expected


def test_v2_quota_of_the_own_cgroup(tmp_path: Path) -> None:
    _write(_v2_tree(tmp_path), "kubepods/pod1/ctr/cpu.max", "250000 100000\n")
    assert cgroup_cpu_quota(tmp_path, V2_SELF) == 2.5


def test_v2_a_parents_tighter_quota_binds(tmp_path: Path) -> None:
    _v2_tree(tmp_path)
    _write(tmp_path, "kubepods/pod1/ctr/cpu.max", "max 100000\n")
    _write(tmp_path, "kubepods/pod1/cpu.max", "150000 100000\n")
    _write(tmp_path, "kubepods/cpu.max", "800000 100000\n")
    assert cgroup_cpu_quota(tmp_path, V2_SELF) == 1.5


def test_v2_max_everywhere_is_no_quota(tmp_path: Path) -> None:
    _write(_v2_tree(tmp_path), "kubepods/pod1/ctr/cpu.max", "max 100000\n")
    assert cgroup_cpu_quota(tmp_path, V2_SELF) is None


def test_v2_in_a_cgroup_namespace_the_mount_is_the_own_cgroup(tmp_path: Path) -> None:
    _write(_v2_tree(tmp_path), "cpu.max", "300000 100000\n")
    assert cgroup_cpu_quota(tmp_path, "0::/\n") == 3.0


def test_v2_a_path_outside_the_mount_falls_back_to_the_mount(tmp_path: Path) -> None:
    _write(_v2_tree(tmp_path), "cpu.max", "100000 50000\n")
    assert cgroup_cpu_quota(tmp_path, "0::/../../elsewhere\n") == 2.0


def test_v1_quota_over_period(tmp_path: Path) -> None:
    _write(tmp_path, "cpu,cpuacct/docker/abc/cpu.cfs_quota_us", "200000\n")
    _write(tmp_path, "cpu,cpuacct/docker/abc/cpu.cfs_period_us", "100000\n")
    assert cgroup_cpu_quota(tmp_path, V1_SELF) == 2.0


def test_v1_minus_one_is_no_quota(tmp_path: Path) -> None:
    _write(tmp_path, "cpu/docker/abc/cpu.cfs_quota_us", "-1\n")
    _write(tmp_path, "cpu/docker/abc/cpu.cfs_period_us", "100000\n")
    assert cgroup_cpu_quota(tmp_path, V1_SELF) is None


def test_malformed_or_missing_files_are_no_quota(tmp_path: Path) -> None:
    _write(_v2_tree(tmp_path), "kubepods/pod1/ctr/cpu.max", "lots\n")
    assert cgroup_cpu_quota(tmp_path, V2_SELF) is None
    assert cgroup_cpu_quota(tmp_path / "absent", V2_SELF) is None
    assert cgroup_cpu_quota(tmp_path, "") is None


def test_own_cgroups_reads_both_hierarchies() -> None:
    assert own_cgroups(V2_SELF) == ("/kubepods/pod1/ctr", None)
    assert own_cgroups(V1_SELF) == (None, "/docker/abc")


def test_auto_resolves_to_a_count_at_load(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cpus, "cgroup_cpu_quota", lambda: 3.0)
    monkeypatch.setattr(os, "sched_getaffinity", lambda _pid: {0, 1, 2, 3, 4, 5, 6, 7})
    settings = load_settings({"PD_EXTPROC_WORKERS": "auto", "PD_EXTPROC_GRPC_LISTEN": "unix:/run/x.sock"}, {})
    assert settings.workers == 3


def test_auto_on_one_cpu_is_todays_single_process(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cpus, "cgroup_cpu_quota", lambda: 0.5)
    assert load_settings({"PD_EXTPROC_WORKERS": "AUTO"}, {}).workers == 1


def test_a_word_other_than_auto_is_refused() -> None:
    with pytest.raises(ConfigError, match="PD_EXTPROC_WORKERS: expected a positive integer or auto"):
        load_settings({"PD_EXTPROC_WORKERS": "all"}, {})
