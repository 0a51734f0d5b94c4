"""The allocator thresholds (extproc/malloc.py): large blocks reused instead of faulted in again, and the
operator's own glibc settings left alone."""

from __future__ import annotations

import ctypes
import subprocess
import sys

import pytest

from extproc import malloc

GLIBC = hasattr(ctypes.CDLL(None), "gnu_get_libc_version")

# Four rounds of freeing 16 MiB of large blocks, then the minor faults of 50 more such rounds.
_CHURN = """
import resource, sys
from extproc import malloc
if sys.argv[1] == "keep":
    assert malloc.keep_large_blocks(32 << 20)

def churn() -> None:
    blocks = [bytes(2 << 20) for _ in range(8)]
    del blocks

for _ in range(4):
    churn()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(50):
    churn()
print((resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 50)
"""


def faults_per_round(mode: str) -> float:
    done = subprocess.run([sys.executable, "-c", _CHURN, mode], capture_output=True, text=True, timeout=60,
                          check=True, env={"PATH": "/usr/bin:/bin", "PYTHONPATH": ":".join(sys.path)})
    return float(done.stdout)


@pytest.mark.skipif(not GLIBC, reason="the thresholds are glibc's")
def test_freed_large_blocks_are_reused_instead_of_faulted_in_again() -> None:
    default, kept = faults_per_round("default"), faults_per_round("keep")
    assert kept * 2 < default, (kept, default)


@pytest.mark.parametrize("environ", [{"MALLOC_MMAP_THRESHOLD_": "131072"}, {"MALLOC_TRIM_THRESHOLD_": "0"},
                                     {"GLIBC_TUNABLES": "glibc.cpu.x86_shstk=off:glibc.malloc.trim_threshold=0"}])
def test_the_operators_own_allocator_settings_win(environ: dict[str, str]) -> None:
    assert malloc.keep_large_blocks(32 << 20, environ) is False


def test_the_heap_kept_is_four_of_the_largest_bodies_and_at_least_the_mmap_threshold() -> None:
    assert malloc.trim_threshold(32 << 20) == 128 << 20
    assert malloc.trim_threshold(1 << 20) == malloc.MMAP_THRESHOLD_BYTES


def test_a_c_library_that_is_not_glibc_is_left_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    class Musl:
        def __init__(self, name: object) -> None:
            self.mallopt = lambda *args: pytest.fail("mallopt called on a C library that is not glibc")

    monkeypatch.setattr(ctypes, "CDLL", Musl)
    assert malloc.keep_large_blocks(32 << 20, {}) is False
