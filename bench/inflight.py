"""Memory with 1,000 requests in flight: which process holds them depends on which leg is slow.

A slow prefill keeps each P/D request inside ``pd-extproc serve`` (one gRPC stream and one prefill
HTTP call per request); a slow decode keeps it inside Envoy (or the router) after our server has
answered. The slow worker is scripted to delay each of the next N requests; the client (aiohttp, in
this process) sends N requests at once; RSS is sampled while they wait and the kernel's own peak
(VmHWM, reset first) is read at the end.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field

import aiohttp

from bench import procs
from bench.systems import System
from bench.workload import CHAT_PATH
from pd_extproc_lab.emulator.worker import EmulatedWorker


@dataclass
class ProcessMemory:
    baseline_bytes: int
    peak_bytes: int

    def growth_per_request(self, in_flight: int) -> float:
        return (self.peak_bytes - self.baseline_bytes) / in_flight if in_flight else 0.0


@dataclass
class InflightResult:
    system: str
    slow_leg: str
    sent: int
    ok: int
    statuses: dict[int, int]
    in_flight_at_slow_worker: int  # requests waiting at the slow worker halfway through its delay
    memory: dict[str, ProcessMemory] = field(default_factory=dict)
    seconds: float = 0.0


class _RssSampler(threading.Thread):
    """Polls VmRSS of some processes until stopped, keeping the highest value of each."""

    def __init__(self, pids: Mapping[str, int], interval: float = 0.02) -> None:
        super().__init__(daemon=True)
        self.pids = dict(pids)
        self.highest = {role: procs.rss_bytes(pid) for role, pid in self.pids.items()}
        self._interval = interval
        self._stop_event = threading.Event()

    def run(self) -> None:
        while not self._stop_event.wait(self._interval):
            for role, pid in self.pids.items():
                self.highest[role] = max(self.highest[role], procs.rss_bytes(pid))

    def finish(self) -> dict[str, int]:
        self._stop_event.set()
        self.join()
        return self.highest


async def _send_all(url: str, headers: Mapping[str, str], body: bytes, count: int, patience: float) -> list[int]:
    connector = aiohttp.TCPConnector(limit=0, force_close=True)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=patience)) as session:
        async def one() -> int:
            try:
                async with session.post(url, data=body, headers={"content-type": "application/json",
                                                                 **headers}) as response:
                    await response.read()
                    return response.status
            except (aiohttp.ClientError, TimeoutError):
                return 0
        return list(await asyncio.gather(*(one() for _ in range(count))))


def _count_waiting(worker: EmulatedWorker) -> int:
    return sum(1 for r in worker.requests() if r["target"].startswith("/v1/") and r["outcome"] == "pending")


def measure(system: System, slow: EmulatedWorker, role: str, body: bytes, count: int = 1000,
            delay: float = 5.0) -> InflightResult:
    """Hold ``count`` requests in flight for ``delay`` seconds at ``slow``; report each process's memory."""
    slow.reset()
    slow.script(*[{"delay": delay}] * count)
    baselines = {role: procs.rss_bytes(pid) for role, pid in system.processes.items()}
    peak_was_reset = {role: procs.reset_peak_rss(pid) for role, pid in system.processes.items()}
    sampler = _RssSampler(system.processes)
    sampler.start()
    counted: list[int] = []
    counter = threading.Timer(delay / 2, lambda: counted.append(_count_waiting(slow)))
    counter.start()
    started = time.monotonic()
    try:
        statuses = asyncio.run(_send_all(system.url + CHAT_PATH, system.headers, body, count, delay + 60))
    finally:
        counter.join()
        sampled = sampler.finish()
        slow.reset()
    result = InflightResult(system.name, role, count, statuses.count(200), _histogram(statuses),
                            counted[0] if counted else 0, seconds=time.monotonic() - started)
    for role, pid in system.processes.items():
        kernel_peak = procs.peak_rss_bytes(pid) if peak_was_reset[role] else 0  # else: the lifetime peak
        result.memory[role] = ProcessMemory(baselines[role], max(sampled[role], kernel_peak))
    return result


def _histogram(statuses: list[int]) -> dict[int, int]:
    counts: dict[int, int] = {}
    for status in statuses:
        counts[status] = counts.get(status, 0) + 1
    return counts
