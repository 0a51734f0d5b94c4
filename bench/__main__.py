"""``python -m bench``: run the whole benchmark and write RESULTS.md, the plot and bench/out/results.json."""

from __future__ import annotations

import argparse
import dataclasses
import shutil
import subprocess
import sys
import time
from pathlib import Path

import orjson

from bench import machine, markdown, report, sweep_report
from bench.run import Options, Run, execute
from bench.systems import REPO, WORKER_SETS, default_tools, running_fleet
from pd_extproc_lab.process import StackError

BENCH_DIR = REPO / "bench"
QUICK = {"rounds": 1, "seconds": 1, "warmup_seconds": 1, "large_body_rounds": 1, "large_body_requests": 1,
         "inflight_requests": 200, "inflight_delay": 2.0, "profile_seconds": 3, "quiet_max_wait": 5.0,
         "stage_requests": 300, "stage_repeats": 1,
         "beside_seconds": 4, "loop_stall_mib": 2, "sweep_rounds": 1, "sweep_seconds": 1}


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="a short smoke run (numbers not meaningful)")
    parser.add_argument("--rounds", type=int, help="interleaved rounds per point")
    parser.add_argument("--seconds", type=int, help="whole seconds per measured point")
    parser.add_argument("--concurrency", type=int, nargs="+", help="concurrency levels of the cheap set")
    parser.add_argument("--size-sweep-only", action="store_true",
                        help="check every system, then run only the size sweep (cheap set)")
    parser.add_argument("--profile-only", action="store_true",
                        help="check every system, then only profile our server under P/D load (make profile): "
                             "a flame graph SVG in --out")
    parser.add_argument("--profile-concurrency", type=int, help="concurrency of the profiled load")
    parser.add_argument("--out", type=Path, default=BENCH_DIR / "out", help="work directory (logs, results.json)")
    parser.add_argument("--results", type=Path,
                        help="where to write the report (default: bench/RESULTS.md; --out for a partial run)")
    parser.add_argument("--plot", type=Path, help="where to write the PNG (default: bench/added_latency.png; "
                                                  "--out for a partial run)")
    parser.add_argument("--sweep-plot", type=Path,
                        help="where to write the size sweep's PNG (default: bench/size_sweep.png; --out for a "
                             "partial run)")
    parser.add_argument("--bench-python", default=str(REPO / ".venv-bench" / "bin" / "python"),
                        help="Python with matplotlib (runs bench/plot.py)")
    parser.add_argument("--command", default="make bench", help="the command named in RESULTS.md")
    parser.add_argument("--sets", nargs="+", choices=WORKER_SETS, default=list(WORKER_SETS),
                        help="worker sets to run (default: all; the memory and 20 MiB phases need emulated)")
    return parser


def _options(args: argparse.Namespace, py_spy: str) -> Options:
    values: dict[str, object] = dict(QUICK) if args.quick else {}
    if args.rounds is not None:
        values["rounds"] = args.rounds
    if args.seconds is not None:
        values["seconds"] = args.seconds
    if args.concurrency:
        values["concurrency"] = tuple(args.concurrency)
    if args.size_sweep_only:
        values["size_sweep_only"] = True
    if args.profile_only:
        values["profile_only"] = True
    if args.profile_concurrency is not None:
        values["profile_concurrency"] = args.profile_concurrency
    return dataclasses.replace(Options(py_spy=py_spy), **values)  # type: ignore[arg-type]


def _log(message: str) -> None:
    sys.stdout.write(f"[{time.strftime('%H:%M:%S')}] {message}\n")
    sys.stdout.flush()


def _utc_now() -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime())


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    # A partial run writes its report and plots beside its results.json, never over the full run's.
    home = args.out if args.size_sweep_only or args.profile_only else BENCH_DIR
    args.results = args.results or home / "RESULTS.md"
    args.plot = args.plot or home / "added_latency.png"
    args.sweep_plot = args.sweep_plot or home / "size_sweep.png"
    tools = default_tools()
    py_spy = str(Path(args.bench_python).parent / "py-spy")
    options = _options(args, py_spy if Path(py_spy).exists() else "")
    shutil.rmtree(args.out, ignore_errors=True)
    log_dir = args.out / "logs"
    log_dir.mkdir(parents=True)
    run = Run(options=dataclasses.asdict(options), machine=machine.describe(tools.envoy, args.bench_python, REPO),
              started=_utc_now())
    _log(f"machine: {run.machine}")
    try:
        with running_fleet(tools, log_dir, tuple(args.sets)) as fleet:
            _log("started: " + ", ".join(f"{s.workers}/{s.name} {s.url}" for s in fleet.systems()))
            execute(fleet, options, args.out, run, _log)
    except StackError as error:
        _log(f"could not start the fleet: {error}")
        return 1
    except (RuntimeError, OSError) as error:  # keep what was measured, and say the run is incomplete
        run.incomplete = f"{type(error).__name__}: {error}"
        _log(f"run stopped early: {run.incomplete}")
    run.finished = _utc_now()
    results = dataclasses.asdict(run)
    results["summary"] = report.summary(results)
    results["summary"]["size_sweep"] = sweep_report.summary(results["points"])
    results_json = args.out / "results.json"
    results_json.write_bytes(orjson.dumps(results, option=orjson.OPT_INDENT_2 | orjson.OPT_NON_STR_KEYS))
    subprocess.run([args.bench_python, str(BENCH_DIR / "plot.py"), str(results_json), str(args.plot),
                    str(args.sweep_plot)], check=True)
    written = orjson.loads(results_json.read_bytes())
    args.results.write_text(markdown.render(written, written["summary"], args.command))
    written_files = [args.results, *(path for path in (args.plot, args.sweep_plot) if path.exists()), results_json]
    _log("wrote " + ", ".join(str(path) for path in written_files))
    for verdict in results["summary"]["verdicts"]:
        _log(f"target {'met' if verdict['met'] else 'MISSED'}: {verdict['target']}: {verdict['measured']}")
    for verdict in results["summary"]["size_sweep"].get("verdicts", []):
        _log(f"target {'met' if verdict['met'] else 'MISSED'}: {verdict['target']}: {verdict['measured']}")
    return 1 if run.incomplete else 0


if __name__ == "__main__":
    sys.exit(main())
