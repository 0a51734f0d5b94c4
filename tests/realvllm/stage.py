"""The real-engine stage: a real vLLM prefill and decode worker, our server and Envoy in front of decode,
started once per test run, plus the ledger of every KV handoff the tests deliver to decode.

The ledger is what the transfer-counter check compares against: every request that hands a
prefill's kv_transfer_params to the decode worker is counted here when it is sent, whether it went
through Envoy (the product path) or as two direct legs (the fidelity and shape checks). Requests
that must not reach decode (passthrough, our 4xx/5xx) are sent without counting.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import orjson

from extproc.protocol.units import parse_address
from tests.harness import Stack, running_stack
from tests.realvllm import engine
from tests.realvllm.engine import Engine, EngineStartError, NixlCounters
from tests.realvllm.wire import prefill_leg_body

# Lines for the terminal summary (conftest prints them at the end of the run).
REPORT: list[str] = []


@dataclass
class Ledger:
    through_envoy: int = 0
    direct: int = 0
    deliberate_load_failures: int = 0

    @property
    def handoffs(self) -> int:
        return self.through_envoy + self.direct


@dataclass
class Timings:
    launched: float = field(default_factory=time.monotonic)
    workers_healthy: float = 0.0
    front_ready: float = 0.0


class StallWatch:
    """Notices when the whole machine stops running this process for seconds (a VM paused by its host,
    seen on shared 2-core machines under load). Nothing is retried or excused because of it: a failing
    test's report just says that the machine stalled while it ran, and the summary prints the longest."""

    def __init__(self, threshold: float = 2.0, interval: float = 0.05) -> None:
        self.threshold = threshold
        self.interval = interval
        self.stalls: list[tuple[float, float]] = []  # (wall-clock end, seconds lost)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="stall-watch", daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        last = time.monotonic()
        while not self._stop.wait(self.interval):
            now = time.monotonic()
            lost = now - last - self.interval
            if lost > self.threshold:
                self.stalls.append((time.time(), lost))
            last = now

    def between(self, start: float, stop: float) -> list[float]:
        return [lost for end, lost in self.stalls if start <= end <= stop + 1.0]

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)


@dataclass(frozen=True)
class Reply:
    status: int
    headers: httpx.Headers
    body: bytes

    def json(self) -> Any:
        return orjson.loads(self.body)

    @property
    def media_type(self) -> str:
        return str(self.headers.get("content-type", "")).split(";")[0].strip()


def send(client: httpx.Client, path: str, body: dict[str, Any] | bytes,
         headers: Mapping[str, str] | None = None) -> Reply:
    """POST and read the whole body, streamed or not, exactly as sent."""
    content = body if isinstance(body, bytes) else orjson.dumps(body)
    with client.stream("POST", path, content=content,
                       headers={"content-type": "application/json", **(headers or {})}) as response:
        raw = b"".join(response.iter_raw())
    return Reply(response.status_code, response.headers, raw)


@dataclass
class RealPd:
    prefill: Engine
    decode: Engine
    front: Stack
    model: str
    baseline: NixlCounters
    ledger: Ledger = field(default_factory=Ledger)
    launched_here: bool = True
    stalls: StallWatch | None = None

    def envoy(self) -> httpx.Client:
        return self.front.client(timeout=120)

    def pd(self, path: str, body: dict[str, Any], **headers: str) -> Reply:
        """A P/D request through Envoy (header names the real prefill worker); counted in the ledger."""
        self.ledger.through_envoy += 1
        with self.envoy() as client:
            return send(client, path, body, {"x-prefiller-host-port": self.prefill.address, **headers})

    def through_envoy(self, path: str, body: dict[str, Any] | bytes, headers: Mapping[str, str]) -> Reply:
        """A request through Envoy that must not deliver a handoff to decode (not counted)."""
        with self.envoy() as client:
            return send(client, path, body, headers)

    def direct_pd(self, path: str, body: dict[str, Any]) -> tuple[Reply, Reply]:
        """The two legs by hand, as our server does them: prefill, then decode with the handoff verbatim.
        Every prefill leg is followed by its decode leg, so no lease is left to expire."""
        prefill = send(self.prefill.http, path, prefill_leg_body(path, body))
        assert prefill.status == 200, prefill.body[:300]
        handoff = prefill.json()["kv_transfer_params"]
        self.ledger.direct += 1
        decode = send(self.decode.http, path, {**body, "kv_transfer_params": handoff})
        return prefill, decode

    def aggregated(self, worker: Engine, path: str, body: dict[str, Any]) -> Reply:
        """The request served whole by one worker (no kv_transfer_params): the reference output."""
        return send(worker.http, path, body)

    def counters(self) -> NixlCounters:
        return NixlCounters.read(self.prefill, self.decode)

    def logs(self) -> str:
        return "\n".join([f"----- vLLM prefill (last 80 lines)\n{self.prefill.log_tail()}",
                          f"----- vLLM decode (last 80 lines)\n{self.decode.log_tail()}", self.front.logs()])


def _allow_rule(address: str) -> str:
    parsed = parse_address(address)
    try:
        ip = ipaddress.ip_address(parsed.host)
    except ValueError:
        return f"{parsed.host}:{parsed.port}"
    return f"[{ip}]/128:{parsed.port}" if ip.version == 6 else f"{ip}/32:{parsed.port}"


def _served_model(worker: Engine) -> str:
    models = worker.http.get("/v1/models").json()["data"]
    if not models:
        raise EngineStartError(f"{worker.address} serves no model")
    return str(models[0]["id"])


@contextlib.contextmanager
def running_stage() -> Iterator[RealPd]:
    timings = Timings()
    stalls = StallWatch()
    log_dir = Path(tempfile.mkdtemp(prefix="pd-extproc-realvllm-"))
    keep_logs = os.environ.get(engine.ENV_KEEP_LOGS) is not None
    workers: list[Engine] = []
    try:
        external = engine.external_endpoints()
        if external is None:
            engine.check_host_can_run_vllm_cpu()
            workers.append(engine.launch("vllm-prefill", engine.PRODUCER_CONFIG, 0, log_dir))
            workers.append(engine.launch("vllm-decode", engine.CONSUMER_CONFIG, 1, log_dir))
        else:
            workers.extend([Engine("prefill", external[0]), Engine("decode", external[1])])
        prefill, decode = workers
        engine.wait_healthy(workers, engine.startup_timeout())
        engine.check_progress_delay_applied(workers)
        timings.workers_healthy = time.monotonic()
        model = os.environ.get(engine.ENV_MODEL) or (_served_model(decode) if external else engine.TINY_MODEL_NAME)
        front_env = {"PD_EXTPROC_DECODE": decode.address}
        if external is not None:  # loopback stays allowed for the unreachable-prefill check
            front_env["PD_EXTPROC_PREFILL_ALLOW"] = "127.0.0.0/8:*," + _allow_rule(prefill.address)
        with running_stack(front_env, workers=()) as front:
            timings.front_ready = time.monotonic()
            real = RealPd(prefill, decode, front, model, NixlCounters.read(prefill, decode),
                          launched_here=external is None, stalls=stalls)
            yield real
            _report_counters(real, real.counters())
    except Exception:
        keep_logs = True
        raise
    finally:
        for worker in workers:
            worker.close()
        stopped = time.monotonic()
        stalls.stop()
        _report(timings, stopped, log_dir if keep_logs else None)
        worst = max((lost for _, lost in stalls.stalls), default=0.0)
        REPORT.append(f"machine stalls over {stalls.threshold:g}s while the stage ran: {len(stalls.stalls)}"
                      + (f", longest {worst:.1f}s" if stalls.stalls else ""))
        if not keep_logs:
            shutil.rmtree(log_dir, ignore_errors=True)


def _report(timings: Timings, stopped: float, kept_logs: Path | None) -> None:
    if timings.workers_healthy:
        REPORT.append(f"vLLM prefill + decode healthy {timings.workers_healthy - timings.launched:.1f}s after launch")
    if timings.front_ready:
        REPORT.append(f"pd-extproc + Envoy ready {timings.front_ready - timings.workers_healthy:.1f}s later")
    REPORT.append(f"real-vLLM stage wall time {stopped - timings.launched:.1f}s "
                  "(first worker launch to last worker stopped)")
    if kept_logs is not None:
        REPORT.append(f"vLLM logs kept in {kept_logs}")


def _report_counters(real: RealPd, final: NixlCounters) -> None:
    ledger, before = real.ledger, real.baseline
    REPORT.append(
        f"decode {engine.TRANSFERS}: {before.transfers:g} -> {final.transfers:g} "
        f"(+{final.transfers - before.transfers:g}) for {ledger.handoffs} P/D requests "
        f"({ledger.through_envoy} through Envoy + {ledger.direct} direct prefill/decode leg pairs)")
    REPORT.append(
        f"decode {engine.FAILED_TRANSFERS}: {before.failed_on_decode:g} -> {final.failed_on_decode:g} "
        f"({ledger.deliberate_load_failures} deliberate KV-load failures); prefill {engine.EXPIRED_LEASES}: "
        f"{before.expired_leases:g} -> {final.expired_leases:g}; prefill {engine.NOTIFICATIONS_AFTER_EXPIRY}: "
        f"{before.notifications_after_expiry:g} -> {final.notifications_after_expiry:g}")
