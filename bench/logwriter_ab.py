"""Paired A/B of the log writer thread's CPU per request line, between two checkouts of this repository:
``python -m bench.logwriter_ab OLD_TREE NEW_TREE [--runs 10] [--gap-us 150]``.

One line per request (``logs.info``, the direct path), ``--gap-us`` apart (a busy wait on the caller's
thread: a request's pace), into a pipe a ``cat`` drains (as into a log collector). The figure is the CPU of
every thread but the caller's (the writer's) per line, the least over 6 batches of 2,000, in a fresh process
importing one tree's ``extproc`` (PYTHONPATH). Runs go A, B, A' in turn: A' - A is the harness's own noise.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import subprocess
import sys
import time
from pathlib import Path

from bench.paired_ab import paired, run_in_tree

FIELDS = {"request_id": "abc-1", "adapter": "vllm_nixl", "outcome": "ok", "status": 200, "prefill_ms": 0.2,
          "total_ms": 0.6}


def one_run(gap_us: float, batches: int = 6, per_batch: int = 2000) -> float:
    from extproc.observability import logs

    drain = subprocess.Popen(["cat"], stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
    assert drain.stdin is not None
    logs.configure("info", drain.stdin)
    logger = logging.getLogger("extproc.request")
    best = float("inf")
    for _ in range(batches):
        logs.flush()
        process, thread = time.process_time(), time.thread_time()
        for _ in range(per_batch):
            logs.info(logger, "pd_request", FIELDS)
            end = time.perf_counter() + gap_us * 1e-6
            while time.perf_counter() < end:
                pass
        logs.flush()
        writer = (time.process_time() - process) - (time.thread_time() - thread)
        best = min(best, writer / per_batch * 1e6)
    logs.stop()
    drain.stdin.close()
    drain.wait()
    return best


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.logwriter_ab", description=__doc__.split("\n", 1)[0])
    parser.add_argument("old", type=Path, nargs="?")
    parser.add_argument("new", type=Path, nargs="?")
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--gap-us", type=float, default=150.0)
    parser.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.one:
        print(f"{one_run(args.gap_us):.3f}")
        return 0
    if args.old is None or args.new is None:
        parser.error("give the two trees")
    argv = ["logwriter_ab", "--one", "--gap-us", str(args.gap_us)]
    result = paired(lambda tree: run_in_tree(__file__, tree, argv), args.old, args.new, args.runs)
    print(f"writer CPU per line, {args.gap_us:g} us apart: old {statistics.median(result.old):.1f} µs, new "
          f"{statistics.median(result.new):.1f} µs; {result.summary()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
