"""`make stress`: the tests that run real processes, N rounds in a row under a CPU-bound competitor, with
every failure counted per test (docs/testing.md has the target and its last count).

    python -m tests.stress --rounds 10 --out .cache/stress [pytest paths and options...]

Each round runs pytest once over the paths (default: tests/e2e, which holds tests/e2e/test_workers.py,
tests/gateway and tests/soak) with a JUnit report; a failed round never stops the next one. A busy-loop
Python process (``--hogs``, default 1) competes for the CPU for the whole run: it is started here and
killed here, by its own process id. The summary (summary.md and summary.json in ``--out``, rewritten after
each round) lists each test that failed at least once with its count and the rounds it failed in, and how
long each round took. The exit status is 1 when any round had a failure, so a CI job can run it too.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import signal
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from collections.abc import Iterator, Sequence
from pathlib import Path

DEFAULT_PATHS = ("tests/e2e", "tests/gateway", "tests/soak")
BUSY_LOOP = "while True: pass"


@dataclasses.dataclass
class Round:
    index: int
    seconds: float
    exit_status: int
    tests: int
    failed: list[str]


def node_id(case: ET.Element) -> str:
    """pytest's node id from a JUnit testcase (module-level tests: ``classname`` is the dotted module)."""
    classname, name = case.get("classname", ""), case.get("name", "")
    return f"{classname.replace('.', '/')}.py::{name}"


def read_report(path: Path) -> tuple[int, list[str]]:
    """How many tests ran and which failed (a failure or an error, in setup, call or teardown)."""
    root = ET.parse(path).getroot()  # noqa: S314 (pytest's own report, written by this run)
    cases = list(root.iter("testcase"))
    failed = [node_id(case) for case in cases if case.find("failure") is not None or case.find("error") is not None]
    return len(cases), sorted(set(failed))


@contextlib.contextmanager
def cpu_hogs(count: int) -> Iterator[list[int]]:
    """``count`` busy-loop processes for the duration of the block, killed by their own ids after it."""
    hogs = [subprocess.Popen([sys.executable, "-c", BUSY_LOOP], stdin=subprocess.DEVNULL) for _ in range(count)]
    try:
        yield [hog.pid for hog in hogs]
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()


def run_round(index: int, out: Path, pytest_args: Sequence[str]) -> Round:
    report = out / f"round-{index}.xml"
    log = out / f"round-{index}.log"
    started = time.monotonic()
    with log.open("w") as sink:
        status = subprocess.call([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                                  f"--junitxml={report}", *pytest_args], stdout=sink, stderr=subprocess.STDOUT)
    seconds = time.monotonic() - started
    if not report.exists():
        return Round(index, seconds, status, 0, [f"(pytest exited {status} without a report: {log})"])
    tests, failed = read_report(report)
    if status != 0 and not failed:
        failed = [f"(pytest exited {status}: {log})"]
    return Round(index, seconds, status, tests, failed)


def summary_markdown(rounds: Sequence[Round], hogs: int, pytest_args: Sequence[str]) -> str:
    counts: dict[str, list[int]] = {}
    for done in rounds:
        for test in done.failed:
            counts.setdefault(test, []).append(done.index)
    durations = ", ".join(f"{done.seconds / 60:.1f}" for done in rounds)
    lines = [f"`python -m tests.stress {' '.join(pytest_args)}`: {len(rounds)} rounds under {hogs} busy-loop "
             f"process(es); {rounds[0].tests if rounds else 0} tests a round; minutes per round: {durations}.", ""]
    if not counts:
        lines.append("No failure in any round.")
    else:
        lines += ["| test | failed | rounds |", "|---|---|---|"]
        for test, which in sorted(counts.items(), key=lambda item: (-len(item[1]), item[0])):
            lines.append(f"| `{test}` | {len(which)} of {len(rounds)} | {', '.join(map(str, which))} |")
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.stress", description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=10, help="how many times to run the tests (STRESS_N)")
    parser.add_argument("--hogs", type=int, default=1, help="busy-loop processes competing for the CPU")
    parser.add_argument("--out", type=Path, default=Path(".cache/stress"), help="reports, logs and the summary")
    args, pytest_args = parser.parse_known_args(argv)
    pytest_args = pytest_args or list(DEFAULT_PATHS)
    if args.rounds < 1 or args.hogs < 0:
        parser.error("--rounds must be positive and --hogs not negative")
    args.out.mkdir(parents=True, exist_ok=True)
    # SIGTERM ends the run like Ctrl-C: the round's pytest and the busy loops are stopped on the way out.
    signal.signal(signal.SIGTERM, lambda _signum, _frame: sys.exit(128 + signal.SIGTERM))
    rounds: list[Round] = []
    with cpu_hogs(args.hogs) as pids:
        print(f"stress: {args.rounds} rounds of pytest {' '.join(pytest_args)}; busy loops {pids}", flush=True)
        for index in range(1, args.rounds + 1):
            done = run_round(index, args.out, pytest_args)
            rounds.append(done)
            print(f"stress: round {index}: {done.tests} tests, {len(done.failed)} failed, "
                  f"{done.seconds / 60:.1f} min" + "".join(f"\n  {test}" for test in done.failed), flush=True)
            write_summary(args.out, rounds, args.hogs, pytest_args)  # after each round: a cut-short run keeps it
    print((args.out / "summary.md").read_text(), end="")
    return 1 if any(done.failed for done in rounds) else 0


def write_summary(out: Path, rounds: Sequence[Round], hogs: int, pytest_args: Sequence[str]) -> None:
    (out / "summary.md").write_text(summary_markdown(rounds, hogs, pytest_args))
    (out / "summary.json").write_text(json.dumps(
        {"hogs": hogs, "pytest_args": list(pytest_args), "rounds": [dataclasses.asdict(r) for r in rounds]},
        indent=2))


if __name__ == "__main__":
    sys.exit(main())
