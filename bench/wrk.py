"""The load generator: wrk (Debian package), closed loop, one connection per concurrent client.

wrk keeps ``concurrency`` keep-alive connections busy for a fixed duration and times each request
from the first byte written to the last byte of the response (for a stream: the end of the stream).
Connection setup is not timed. A Lua script sets the body (read from a file), the headers, and
prints one JSON line of results that this module parses.
"""

from __future__ import annotations

import resource
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import orjson

WRK = "wrk"
_RESULT_PREFIX = "BENCH-RESULT "
_PERCENTILES = (50, 90, 99, 99.9)

_SCRIPT = """\
local body_file = io.open(%(body_path)s, "rb")
wrk.method = "POST"
wrk.body = body_file:read("*a")
body_file:close()
%(headers)s
done = function(summary, latency, requests)
  local e = summary.errors
  io.write(string.format(
    '%(prefix)s{"requests":%%d,"duration_us":%%d,"status_errors":%%d,"connect_errors":%%d,' ..
    '"read_errors":%%d,"write_errors":%%d,"timeouts":%%d,"mean_us":%%.1f,"max_us":%%d,' ..
    '"percentiles_us":{%(percentile_format)s}}\\n',
    summary.requests, summary.duration, e.status, e.connect, e.read, e.write, e.timeout,
    latency.mean, latency.max, %(percentile_calls)s))
end
"""


def _lua_string(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def lua_script(body_path: Path, headers: Mapping[str, str]) -> str:
    every_header = {"content-type": "application/json", **headers}
    header_lines = "\n".join(f"wrk.headers[{_lua_string(k)}] = {_lua_string(v)}" for k, v in every_header.items())
    return _SCRIPT % {
        "body_path": _lua_string(str(body_path)),
        "headers": header_lines,
        "prefix": _RESULT_PREFIX,
        "percentile_format": ",".join(f'"{p}":%d' for p in _PERCENTILES),
        "percentile_calls": ", ".join(f"latency:percentile({p})" for p in _PERCENTILES),
    }


@dataclass(frozen=True, slots=True)
class WrkResult:
    requests: int
    seconds: float
    errors: int  # non-2xx/3xx answers plus connect/read/write errors and timeouts
    p50_us: float
    p90_us: float
    p99_us: float
    p999_us: float
    mean_us: float
    max_us: float
    loadgen_cpu_seconds: float  # wrk's own user + system time

    @property
    def rps(self) -> float:
        return self.requests / self.seconds if self.seconds else 0.0


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def run(url: str, script: Path, concurrency: int, seconds: int, timeout: int = 10) -> WrkResult:
    """One closed-loop run of whole ``seconds`` (wrk takes no fractions); raises RuntimeError if wrk fails
    or prints no result line."""
    threads = min(2, concurrency)
    cpu_before = _children_cpu()
    try:
        completed = subprocess.run(
            [WRK, "-t", str(threads), "-c", str(concurrency), "-d", f"{seconds}s", "--timeout", f"{timeout}s",
             "-s", str(script), url],
            capture_output=True, text=True, timeout=seconds + timeout + 30, check=False,
        )
    except subprocess.TimeoutExpired as expired:  # run() has killed wrk
        raise RuntimeError(f"wrk did not finish a {seconds}s run within {expired.timeout:.0f}s "
                           "(is the machine starved of CPU?)") from None
    loadgen_cpu = _children_cpu() - cpu_before
    for line in completed.stdout.splitlines():
        if line.startswith(_RESULT_PREFIX):
            return _parse(orjson.loads(line[len(_RESULT_PREFIX):]), loadgen_cpu)
    output = (completed.stderr + completed.stdout).strip()
    raise RuntimeError(f"wrk failed (exit {completed.returncode}): {output[-800:]}")


def _parse(raw: dict[str, object], loadgen_cpu: float) -> WrkResult:
    def number(key: str) -> float:
        value = raw[key]
        assert isinstance(value, int | float)
        return float(value)

    percentiles = raw["percentiles_us"]
    assert isinstance(percentiles, dict)
    errors = sum(int(number(k)) for k in ("status_errors", "connect_errors", "read_errors", "write_errors",
                                          "timeouts"))
    return WrkResult(
        requests=int(number("requests")), seconds=number("duration_us") / 1e6, errors=errors,
        p50_us=float(percentiles["50"]), p90_us=float(percentiles["90"]), p99_us=float(percentiles["99"]),
        p999_us=float(percentiles["99.9"]), mean_us=number("mean_us"), max_us=number("max_us"),
        loadgen_cpu_seconds=loadgen_cpu,
    )
