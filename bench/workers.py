"""The workers every system of one worker set shares, and what the benchmark reads from them.

Two kinds:
  emulated  extproc's EmulatedWorker (vLLM NIXL emulator): a KV ledger (leases granted and freed,
            pulls by decode), so a point proves every handoff was really consumed; costs about as much
            per request as the proxies do, which hides part of their cost
  cheap     bench/cheap_worker.py: canned answers, no JSON parsing, one member scan per body; counts
            producer and consumer legs (and, for vLLM, that decode got the engine id prefill named), so
            the proxies are the bottleneck and the headline ratios come from it
"""

from __future__ import annotations

import dataclasses
import os
import sys
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import orjson

from bench.cheap_worker import DEFAULT_ENGINE_ID
from extproc import ready
from pd_extproc_lab.emulator.worker import EmulatedWorker, WorkerSpec
from pd_extproc_lab.process import Child

NIXL_TRANSFERS = "vllm:nixl_xfer_time_seconds_count"
NIXL_FAILED = "vllm:nixl_num_failed_transfers_total"
RECOMPUTED = "emulator_recomputed_prompts_total"
LEASES_GRANTED = "emulator_kv_leases_granted_total"
LEASES_FREED = "emulator_kv_leases_freed_total"
CHEAP_WORKER = Path(__file__).resolve().parent / "cheap_worker.py"
CHEAP_ENGINE_ID = DEFAULT_ENGINE_ID


class Worker(Protocol):
    """What the benchmark needs of a worker of either kind."""

    url: str
    child: Child

    @property
    def address(self) -> str: ...

    def start(self) -> None: ...

    def wait_ready(self, timeout: float) -> None: ...

    def stop(self, timeout: float = 10.0) -> int | None: ...

    def reset(self) -> None: ...


def emulated_vllm(role: str, log_dir: Path, prefix: str = "emulated") -> EmulatedWorker:
    """One of the two shared emulated workers (started by the caller: ``start()``, then ``wait_ready``)."""
    return EmulatedWorker(WorkerSpec(f"{prefix}-{role}", role), log_dir)


class CheapWorker:
    """bench/cheap_worker.py as a child process, on the project's interpreter (it has uvloop)."""

    def __init__(self, engine: str, role: str, log_dir: Path, name: str) -> None:
        self.engine, self.role, self.name = engine, role, name
        self.child = Child(name, [sys.executable, str(CHEAP_WORKER), "--engine", engine, "--role", role,
                                  "--engine-id", CHEAP_ENGINE_ID], os.environ, log_dir)
        self.url = ""

    @property
    def address(self) -> str:
        return self.url.split("://", 1)[1]

    def start(self) -> None:
        self.child.start()

    def wait_ready(self, timeout: float) -> None:
        self.url = ready.parse(self.child.wait_ready(timeout))["url"]

    def stop(self, timeout: float = 10.0) -> int | None:
        return self.child.stop(timeout)

    def counters(self) -> dict[str, int]:
        with urllib.request.urlopen(self.url + "/_cheap/counters", timeout=10) as answer:
            raw = orjson.loads(answer.read())
        return {key: int(value) for key, value in raw.items() if isinstance(value, int)}

    def reset(self) -> None:
        request = urllib.request.Request(self.url + "/_cheap/reset", data=b"{}", method="POST")
        with urllib.request.urlopen(request, timeout=10) as answer:
            answer.read()


def pid(worker: Worker) -> int:
    assert worker.child.process is not None
    return worker.child.process.pid


def metrics(worker: EmulatedWorker) -> dict[str, float]:
    """Every sample on /metrics by bare metric name (labels dropped: one engine per worker)."""
    samples = {}
    for line in worker.metrics_text().splitlines():
        if line and not line.startswith("#"):
            name_and_labels, value = line.rsplit(" ", 1)
            samples[name_and_labels.split("{", 1)[0]] = float(value)
    return samples


@dataclass(frozen=True, slots=True)
class LegCounters:
    """What the two workers counted so far; the difference of two snapshots is what one run did.

    The fields are the emulated workers' ledger; cheap workers fill them from their own counts
    (a producer leg is a lease granted, a consumer leg with the prefill's engine id a transfer, a plain
    request a recomputed prompt; they free no lease and fail no pull). ``distinct_handoffs`` is how many
    different handoff ids decode received (cheap vLLM workers only, -1 otherwise)."""

    prefill_leases_granted: float
    prefill_leases_freed: float
    prefill_recomputed: float
    decode_transfers: float
    decode_failed_transfers: float
    decode_recomputed: float
    distinct_handoffs: float = -1

    @classmethod
    def read(cls, prefill: Worker, decode: Worker) -> LegCounters:
        if isinstance(prefill, CheapWorker) and isinstance(decode, CheapWorker):
            p, d = prefill.counters(), decode.counters()
            distinct = d["handoff_ids"] if prefill.engine == "vllm" else -1
            return cls(p["producer"], p["producer"], p["plain"], d["consumer"], 0, d["plain"], distinct)
        assert isinstance(prefill, EmulatedWorker) and isinstance(decode, EmulatedWorker)
        pm, dm = metrics(prefill), metrics(decode)
        return cls(pm[LEASES_GRANTED], pm[LEASES_FREED], pm[RECOMPUTED], dm[NIXL_TRANSFERS], dm[NIXL_FAILED],
                   dm[RECOMPUTED])

    def minus(self, before: LegCounters) -> LegCounters:
        # distinct_handoffs is not cumulative: the cheap worker's set is emptied by reset(), before each point
        cumulative = {f.name: getattr(self, f.name) - getattr(before, f.name) for f in dataclasses.fields(self)
                      if f.name != "distinct_handoffs"}
        return LegCounters(**cumulative, distinct_handoffs=self.distinct_handoffs)

    def as_dict(self) -> dict[str, int]:
        return {item.name: int(getattr(self, item.name)) for item in dataclasses.fields(self)}
