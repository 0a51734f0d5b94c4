"""The two emulated vLLM workers every system shares, and a small client for their control API."""

from __future__ import annotations

import dataclasses
import os
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

from extproc import stack

NIXL_TRANSFERS = "vllm:nixl_xfer_time_seconds_count"
NIXL_FAILED = "vllm:nixl_num_failed_transfers_total"
RECOMPUTED = "emulator_recomputed_prompts_total"
LEASES_GRANTED = "emulator_kv_leases_granted_total"
LEASES_FREED = "emulator_kv_leases_freed_total"


def _fetch(request: urllib.request.Request, timeout: float, attempts: int = 3) -> bytes:
    """The response body; a worker starved of CPU by other processes gets more time, then more tries."""
    for attempt in range(1, attempts + 1):
        try:
            with urllib.request.urlopen(request, timeout=timeout * attempt) as response:
                return bytes(response.read())
        except (TimeoutError, ConnectionError):
            if attempt == attempts:
                raise
    raise AssertionError("unreachable")


def http_json(url: str, payload: Any = None, timeout: float = 30.0) -> Any:
    """GET (or POST ``payload`` as JSON) and parse the JSON answer."""
    data = None if payload is None else orjson.dumps(payload)
    request = urllib.request.Request(url, data=data, method="GET" if data is None else "POST",
                                     headers={"content-type": "application/json"})
    return orjson.loads(_fetch(request, timeout) or b"null")


class Worker:
    """One ``pd-extproc emulate`` process; ``url`` is ``http://host:port`` once ready."""

    def __init__(self, role: str, log_dir: Path) -> None:
        self.role = role
        self.child = stack.python_child(f"emulated-{role}", [
            "emulate", "--engine", "vllm", "--role", role, "--listen", "127.0.0.1:0", "--worker-id", f"bench-{role}",
        ], os.environ, log_dir)
        self.url = ""

    def start(self) -> None:
        self.child.start()

    def wait_ready(self) -> None:
        self.url = self.child.wait_ready(30).split()[1]

    @property
    def address(self) -> str:
        return self.url.removeprefix("http://")

    @property
    def pid(self) -> int:
        assert self.child.process is not None
        return self.child.process.pid

    def reset(self) -> None:
        http_json(self.url + "/_emulator/reset", {})

    def script(self, behaviours: list[dict[str, Any]]) -> None:
        http_json(self.url + "/_emulator/script", {"behaviours": behaviours})

    def requests(self) -> list[dict[str, Any]]:
        records: list[dict[str, Any]] = http_json(self.url + "/_emulator/requests")
        return records

    def metrics(self) -> dict[str, float]:
        """Every sample on /metrics by bare metric name (labels dropped: one engine per worker)."""
        text = _fetch(urllib.request.Request(self.url + "/metrics"), timeout=30).decode()
        samples = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                name_and_labels, value = line.rsplit(" ", 1)
                samples[name_and_labels.split("{", 1)[0]] = float(value)
        return samples

    def stop(self) -> None:
        self.child.stop()


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
        p, d = prefill.metrics(), decode.metrics()
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
