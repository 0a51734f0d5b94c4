"""Paired A/B of ``Metrics.finish`` alone (what a request's end costs in metrics), between two checkouts
of this repository: ``python -m bench.metrics_ab OLD_TREE NEW_TREE [--runs 12]``.

A request as the P/D path ends it: ``ok``, chat, a reused prefill connection (response and total
timings, no connect), the client body's and the prefill response's sizes. The figure is the least
thread-CPU µs per call over 8 batches of 20,000, in a fresh process importing one tree's ``extproc``
(PYTHONPATH). Runs go A, B, A' in turn: A' - A is the harness's own noise. This file imports only
``extproc`` names both trees have.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

from bench.paired_ab import paired, run_in_tree


def one_run(batches: int = 8, per_batch: int = 20_000) -> float:
    from extproc.observability.metrics import Metrics, RequestRecord
    from extproc.protocol.transport import ExchangeTimings

    metrics = Metrics()
    record = RequestRecord("abc-1", "vllm_nixl", 0.0, api="chat", outcome="ok", body_bytes=1400,
                           prefill=ExchangeTimings(200, None, 0.0021, 0.0024, 900))
    finish = metrics.finish
    for _ in range(2000):  # warm-up
        finish(record, 0.0031)
    best = float("inf")
    for _ in range(batches):
        started = time.thread_time()
        for _ in range(per_batch):
            finish(record, 0.0031)
        best = min(best, (time.thread_time() - started) / per_batch * 1e6)
    return best


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.metrics_ab", description=__doc__.split("\n", 1)[0])
    parser.add_argument("old", type=Path, nargs="?")
    parser.add_argument("new", type=Path, nargs="?")
    parser.add_argument("--runs", type=int, default=12)
    parser.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.one:
        print(f"{one_run():.3f}")
        return 0
    if args.old is None or args.new is None:
        parser.error("give the two trees")
    result = paired(lambda tree: run_in_tree(__file__, tree, ["metrics_ab", "--one"]), args.old, args.new, args.runs)
    print(f"Metrics.finish: old {statistics.median(result.old):.2f} µs, new {statistics.median(result.new):.2f} µs "
          f"per request; {result.summary()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
