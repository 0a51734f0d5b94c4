"""Prometheus metrics: what only this server can see (Envoy already counts requests and bytes).

Every metric is updated once per request, from its RequestRecord, when the request ends.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

from extproc._version import __version__
from extproc.observability.series import LoopCounter, LoopHistogram
from extproc.protocol.transport import ExchangeTimings

if TYPE_CHECKING:
    from extproc.observability.tracing import RequestTrace

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_OVERHEAD_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25)
_SIZE_BUCKETS = (1 << 10, 4 << 10, 16 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20, 32 << 20)


@dataclass(slots=True)
class RequestRecord:
    """One P/D request as the log line and the metrics see it. Never bodies or header values."""

    request_id: str
    adapter: str
    started: float
    api: str = "other"  # the generation API (openai_request.Endpoint.api), "other" for a path we do not serve
    outcome: str = "ok"
    status: int = 200
    prefill: ExchangeTimings = field(default_factory=ExchangeTimings)  # the prefill leg, as the transport saw it
    body_bytes: int | None = None
    handoff_problem: str | None = None  # PdError.handoff_reason: only handoff problems
    prefill_error: str | None = None  # the prefill engine's own message, when its error was relayed
    fallback_reason: str | None = None  # the prefill failure a fallback answered (an error code)
    decode_aborted: bool | None = None  # concurrent flow: a failed prefill's decode abort was accepted
    done: bool = False  # logged and counted
    trace: RequestTrace | None = None  # only with PD_EXTPROC_TRACING=otlp


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.build_info = Gauge("pd_extproc_build_info", "The running pd-extproc release (always 1).", ["version"],
                                registry=self.registry)
        self.build_info.labels(__version__).set(1)
        # What every request updates once, when it ends, on the event loop: lock-free (series.py).
        self.requests = LoopCounter(
            "pd_extproc_requests",
            "P/D requests by adapter and outcome (ok, answered_by_prefill, an error code, or cancelled).",
            ["adapter", "outcome"], registry=self.registry)
        self.requests_by_api = LoopCounter(
            "pd_extproc_api_requests",
            "P/D requests by adapter, generation API (chat, completions, messages, responses, generate) and outcome.",
            ["adapter", "api", "outcome"], registry=self.registry)
        self.prefill_seconds = LoopHistogram(
            "pd_extproc_prefill_seconds",
            "Prefill leg latency: connect (new connections only), response (until the response head), total.",
            ["adapter", "phase"], buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.processing_seconds = LoopHistogram(
            "pd_extproc_processing_seconds", "Time spent in this server per P/D request, excluding the prefill leg.",
            ["adapter"], buckets=_OVERHEAD_BUCKETS, registry=self.registry)
        self.handoff_failures = LoopCounter(
            "pd_extproc_handoff_failures", "Invalid prefill handoffs by reason (the offending field).",
            ["adapter", "reason"], registry=self.registry)
        self.background_failures = Counter(
            "pd_extproc_background_prefill_failures",
            "Concurrent-flow prefill requests that failed after decode had already started, by error code.",
            ["adapter", "reason"], registry=self.registry)
        self.inflight = Gauge("pd_extproc_inflight_requests", "P/D requests currently in this server.",
                              registry=self.registry)
        # What a request must give back when it ends (issue 27's soak reads them at rest: all 0 but the pool).
        self.admitted = Gauge("pd_extproc_admission_slots_in_use",
                              "Admission slots held (PD_EXTPROC_MAX_INFLIGHT counts these).", registry=self.registry)
        self.background_prefills = Gauge(
            "pd_extproc_background_prefills", "Concurrent-flow prefill tasks still running.", registry=self.registry)
        self.loop_tasks = Gauge("pd_extproc_event_loop_tasks", "Tasks on the server's event loop.",
                                registry=self.registry)
        self.inspections_waiting = Gauge(
            "pd_extproc_body_inspections_waiting",
            "Request bodies over 16 KiB being checked in, or waiting for, a worker process.", registry=self.registry)
        self.prefill_idle_connections = Gauge(
            "pd_extproc_prefill_idle_connections", "Idle keep-alive connections in the prefill pool.",
            registry=self.registry)
        self.prefill_retries = Counter(
            "pd_extproc_prefill_retries",
            "Requests of the prefill client sent again, once, on a new connection: the reused keep-alive "
            "connection ended before any byte of a response.", registry=self.registry)
        self.fallbacks = Counter(
            "pd_extproc_prefill_fallbacks",
            "P/D requests served whole by the decode worker, by reason: the prefill failure's code, or "
            "unsupported_pd_variant (PD_EXTPROC_UNSUPPORTED_VARIANTS=aggregated).",
            ["adapter", "reason"], registry=self.registry)
        self.decode_queue = Gauge(
            "pd_extproc_decode_queue_waiting",
            "Requests waiting on the local decode worker at the last reading (NaN: no fresh reading).",
            registry=self.registry)
        self.decode_queue.set(float("nan"))
        self.decode_queue_sheds = Counter(
            "pd_extproc_decode_queue_sheds",
            "P/D requests refused because the decode worker's queue was over the limit.", ["adapter"],
            registry=self.registry)
        self.decode_queue_failures = Counter(
            "pd_extproc_decode_queue_scrape_failures",
            "Readings of the decode worker's queue gauges that gave no value, by reason.", ["reason"],
            registry=self.registry)
        self.passthroughs = Counter(
            "pd_extproc_gateway_passthroughs",
            "Gateway mode: requests that were not P/D, let through (a tagged one once its body was read).",
            registry=self.registry)
        self.request_bytes = LoopHistogram(
            "pd_extproc_request_body_bytes", "Client request body sizes on the P/D route.", ["adapter"],
            buckets=_SIZE_BUCKETS, registry=self.registry)
        self.prefill_response_bytes = LoopHistogram(
            "pd_extproc_prefill_response_bytes", "Prefill response body sizes.", ["adapter"],
            buckets=_SIZE_BUCKETS, registry=self.registry)

    def finish(self, record: RequestRecord, total_seconds: float) -> None:
        """Count a request that ended. Only on the event loop's thread (series.py has no lock)."""
        adapter, outcome, prefill = record.adapter, record.outcome, record.prefill
        self.requests.inc((adapter, outcome))
        self.requests_by_api.inc((adapter, record.api, outcome))
        if prefill.connect_seconds is not None:
            self.prefill_seconds.observe((adapter, "connect"), prefill.connect_seconds)
        if prefill.response_seconds is not None:
            self.prefill_seconds.observe((adapter, "response"), prefill.response_seconds)
        if prefill.total_seconds is not None:
            self.prefill_seconds.observe((adapter, "total"), prefill.total_seconds)
        self.processing_seconds.observe((adapter,), max(0.0, total_seconds - (prefill.total_seconds or 0.0)))
        if record.handoff_problem is not None:
            self.handoff_failures.inc((adapter, record.handoff_problem))
        if record.body_bytes is not None:
            self.request_bytes.observe((adapter,), record.body_bytes)
        if prefill.response_bytes is not None:
            self.prefill_response_bytes.observe((adapter,), prefill.response_bytes)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
