"""A one-connection, one-request-at-a-time client for slow requests (the 20 MiB body).

wrk runs for a fixed number of seconds, so a request slower than the run is never counted. Here a
fixed number of requests is sent back to back on one keep-alive connection, each timed from the
first byte written to the last byte read, with a generous timeout. At concurrency 1 and requests of
tens of milliseconds or more, the client's own cost is a small share and is the same for every system.
"""

from __future__ import annotations

import http.client
import time
import urllib.parse
from collections.abc import Mapping

from bench.wrk import WrkResult


def _nearest_rank(sorted_values: list[float], percentile: float) -> float:
    if not sorted_values:
        return 0.0
    index = max(0, min(len(sorted_values) - 1, round(percentile / 100 * len(sorted_values) + 0.5) - 1))
    return sorted_values[index]


def _one(connection: http.client.HTTPConnection, path: str, body: bytes, headers: Mapping[str, str]) -> int:
    connection.request("POST", path, body=body, headers={"content-type": "application/json", **headers})
    response = connection.getresponse()
    response.read()
    return response.status


def run(url: str, path: str, body: bytes, headers: Mapping[str, str], count: int, timeout: float = 120.0) -> WrkResult:
    parsed = urllib.parse.urlsplit(url)
    connection = http.client.HTTPConnection(parsed.hostname or "127.0.0.1", parsed.port, timeout=timeout)
    latencies: list[float] = []
    errors = 0
    cpu_before = time.process_time()
    started = time.perf_counter()
    try:
        for _ in range(count):
            sent = time.perf_counter()
            try:
                status = _one(connection, path, body, headers)
            except (OSError, http.client.HTTPException):
                status = 0
                connection.close()  # the next request opens a new connection
            latencies.append(time.perf_counter() - sent)
            errors += 0 if 200 <= status < 400 else 1
    finally:
        connection.close()
    seconds = time.perf_counter() - started
    micros = sorted(value * 1e6 for value in latencies)
    return WrkResult(
        requests=len(latencies), seconds=seconds, errors=errors,
        p50_us=_nearest_rank(micros, 50), p90_us=_nearest_rank(micros, 90), p99_us=_nearest_rank(micros, 99),
        p999_us=_nearest_rank(micros, 99.9), mean_us=sum(micros) / len(micros) if micros else 0.0,
        max_us=micros[-1] if micros else 0.0, loadgen_cpu_seconds=time.process_time() - cpu_before,
    )
