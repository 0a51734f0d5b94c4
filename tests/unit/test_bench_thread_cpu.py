"""bench/thread_cpu.py: each thread's CPU read from /proc (bench/procs.py), split per request by thread name."""

from __future__ import annotations

import os
from pathlib import Path

from bench.procs import thread_cpu_seconds
from bench.thread_cpu import per_request


def _task(root: Path, tid: int, name: str, utime: int, stime: int) -> None:
    fields = ["S", *["0"] * 10, str(utime), str(stime), *["0"] * 30]  # state, then fields 4..13, utime, stime
    task = root / "42" / "task" / str(tid)
    task.mkdir(parents=True)
    (task / "stat").write_text(f"{tid} ({name}) {' '.join(fields)}\n")


def test_threads_of_one_name_are_summed_and_names_with_spaces_and_parens_kept(tmp_path: Path) -> None:
    tick = os.sysconf("SC_CLK_TCK")
    _task(tmp_path, 42, "python", 3 * tick, tick)
    _task(tmp_path, 43, "event_engine", tick, 0)
    _task(tmp_path, 44, "event_engine", 0, tick)
    _task(tmp_path, 45, "odd (name) x", 2 * tick, 0)
    assert thread_cpu_seconds(42, tmp_path) == {"python": 4.0, "event_engine": 2.0, "odd (name) x": 2.0}


def test_this_process_has_its_main_thread() -> None:
    assert thread_cpu_seconds(os.getpid())  # the real /proc: at least one named thread


def test_per_request_counts_a_new_thread_from_zero() -> None:
    assert per_request({"python": 1.0}, {"python": 1.5, "event_engine": 0.25}, 1000) == {
        "python": 500.0, "event_engine": 250.0}
