"""Where a server's CPU goes, thread by thread, under P/D load: ``python -m bench.thread_cpu SYSTEM...``.

Starts the cheap worker set and its systems (as ``make bench`` does), then for each named system (e.g.
``floor-aio pd-extproc floor-aio-burn``) runs wrk at concurrency 64 for 6 s (after a 2 s warm-up) with
the non-streaming chat body, and prints the CPU per request of each of the system's processes, split by
thread name (bench/procs.py ``thread_cpu_seconds``): for a grpc.aio server the event loop's thread
(``python``) and grpc's own threads (``event_engine``); for Envoy its workers. docs/benchmarks.md reads
one run of it.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from bench import wrk
from bench.procs import thread_cpu_seconds
from bench.systems import default_tools, running_fleet
from bench.workload import CHAT_PATH, write_bodies

CONCURRENCY = 64
SECONDS = 6


def per_request(before: dict[str, float], after: dict[str, float], requests: int) -> dict[str, float]:
    """µs per request of each thread name between two readings (a thread born meanwhile counts from 0)."""
    return {name: (value - before.get(name, 0.0)) / requests * 1e6 for name, value in after.items()}


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.thread_cpu", description=__doc__.split("\n", 1)[0])
    parser.add_argument("systems", nargs="+")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="pd-thread-cpu-"))
    bodies = write_bodies(work)
    with running_fleet(default_tools(), work, ("cheap",)) as fleet:
        systems = {system.name: system for system in fleet.systems() if system.workers == "cheap"}
        for name in args.systems:
            system = systems[name]
            script = work / f"{name}.lua"
            script.write_text(wrk.lua_script(bodies["non-stream"], system.headers))
            wrk.run(system.url + CHAT_PATH, script, CONCURRENCY, 2)
            before = {role: thread_cpu_seconds(pid) for role, pid in system.processes.items()}
            result = wrk.run(system.url + CHAT_PATH, script, CONCURRENCY, SECONDS)
            after = {role: thread_cpu_seconds(pid) for role, pid in system.processes.items()}
            print(f"{name}: {result.rps:.0f} req/s, {result.errors} errors")
            for role in system.processes:
                split = per_request(before[role], after[role], result.requests)
                shown = ", ".join(f"{thread} {us:.0f}" for thread, us in sorted(split.items(), key=lambda kv: -kv[1])
                                  if us >= 1)
                print(f"  {role}: {sum(split.values()):.0f} µs/request ({shown})")


if __name__ == "__main__":
    main()
