"""The two emulated vLLM workers every system shares (extproc's EmulatedWorker), and what the benchmark
reads from them."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

from extproc.emulator.worker import EmulatedWorker, WorkerSpec

NIXL_TRANSFERS = "vllm:nixl_xfer_time_seconds_count"
NIXL_FAILED = "vllm:nixl_num_failed_transfers_total"
RECOMPUTED = "emulator_recomputed_prompts_total"
LEASES_GRANTED = "emulator_kv_leases_granted_total"
LEASES_FREED = "emulator_kv_leases_freed_total"


Worker = EmulatedWorker


def emulated_vllm(role: str, log_dir: Path) -> EmulatedWorker:
    """One of the two shared workers (started by the caller: ``start()``, then ``wait_ready``)."""
    return EmulatedWorker(WorkerSpec(f"emulated-{role}", role), log_dir)


def pid(worker: EmulatedWorker) -> int:
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
    """What the two workers counted so far; the difference of two snapshots is what one run did."""

    prefill_leases_granted: float
    prefill_leases_freed: float
    prefill_recomputed: float
    decode_transfers: float
    decode_failed_transfers: float
    decode_recomputed: float

    @classmethod
    def read(cls, prefill: Worker, decode: Worker) -> LegCounters:
        p, d = metrics(prefill), metrics(decode)
        return cls(p[LEASES_GRANTED], p[LEASES_FREED], p[RECOMPUTED], d[NIXL_TRANSFERS], d[NIXL_FAILED],
                   d[RECOMPUTED])

    def minus(self, before: LegCounters) -> LegCounters:
        return LegCounters(
            self.prefill_leases_granted - before.prefill_leases_granted,
            self.prefill_leases_freed - before.prefill_leases_freed,
            self.prefill_recomputed - before.prefill_recomputed,
            self.decode_transfers - before.decode_transfers,
            self.decode_failed_transfers - before.decode_failed_transfers,
            self.decode_recomputed - before.decode_recomputed,
        )

    def as_dict(self) -> dict[str, int]:
        return {item.name: int(getattr(self, item.name)) for item in dataclasses.fields(self)}
