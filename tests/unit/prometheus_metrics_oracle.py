"""The oracle for tests/unit/test_metrics_exposition.py: extproc/observability/metrics.py as it was
with prometheus_client's own Counter and Histogram for the per-request series, kept only to compare
the exposition of the lock-free series (extproc/observability/series.py) with it.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from extproc._version import __version__
from extproc.observability.metrics import RequestRecord

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_OVERHEAD_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25)
_SIZE_BUCKETS = (1 << 10, 4 << 10, 16 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20, 32 << 20)


class PrometheusClientMetrics:
    """Metrics as it was before series.py: prometheus_client's Counter and Histogram (with their locks)."""

    def __init__(self) -> None:
        # Labelled series looked up once each (labels() takes a lock and builds a key on every call); a
        # series still appears only once it is first used, as with labels().
        self._outcomes: dict[tuple[str, str], Counter] = {}
        self._histograms: dict[tuple[object, ...], Histogram] = {}
        self.registry = CollectorRegistry(auto_describe=True)
        self.build_info = Gauge("pd_extproc_build_info", "The running pd-extproc release (always 1).", ["version"],
                                registry=self.registry)
        self.build_info.labels(__version__).set(1)
        self.requests = Counter(
            "pd_extproc_requests",
            "P/D requests by adapter and outcome (ok, answered_by_prefill, an error code, or cancelled).",
            ["adapter", "outcome"], registry=self.registry)
        self.requests_by_api = Counter(
            "pd_extproc_api_requests",
            "P/D requests by adapter, generation API (chat, completions, messages, responses, generate) and outcome.",
            ["adapter", "api", "outcome"], registry=self.registry)
        self.prefill_seconds = Histogram(
            "pd_extproc_prefill_seconds",
            "Prefill leg latency: connect (new connections only), response (until the response head), total.",
            ["adapter", "phase"], buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.processing_seconds = Histogram(
            "pd_extproc_processing_seconds", "Time spent in this server per P/D request, excluding the prefill leg.",
            ["adapter"], buckets=_OVERHEAD_BUCKETS, registry=self.registry)
        self.handoff_failures = Counter(
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
        self.request_bytes = Histogram(
            "pd_extproc_request_body_bytes", "Client request body sizes on the P/D route.", ["adapter"],
            buckets=_SIZE_BUCKETS, registry=self.registry)
        self.prefill_response_bytes = Histogram(
            "pd_extproc_prefill_response_bytes", "Prefill response body sizes.", ["adapter"],
            buckets=_SIZE_BUCKETS, registry=self.registry)

    def _histogram(self, metric: Histogram, *labels: str) -> Histogram:
        key = (id(metric), *labels)
        child = self._histograms.get(key)
        if child is None:
            child = self._histograms[key] = metric.labels(*labels)
        return child

    def finish(self, record: RequestRecord, total_seconds: float) -> None:
        adapter = record.adapter
        key = (adapter, record.outcome)
        outcome = self._outcomes.get(key)
        if outcome is None:
            outcome = self._outcomes[key] = self.requests.labels(*key)
        outcome.inc()
        self.requests_by_api.labels(adapter, record.api, record.outcome).inc()
        if record.prefill.connect_seconds is not None:
            self._histogram(self.prefill_seconds, adapter, "connect").observe(record.prefill.connect_seconds)
        if record.prefill.response_seconds is not None:
            self._histogram(self.prefill_seconds, adapter, "response").observe(record.prefill.response_seconds)
        if record.prefill.total_seconds is not None:
            self._histogram(self.prefill_seconds, adapter, "total").observe(record.prefill.total_seconds)
        self._histogram(self.processing_seconds, adapter).observe(
            max(0.0, total_seconds - (record.prefill.total_seconds or 0.0)))
        if record.handoff_problem is not None:
            self.handoff_failures.labels(adapter, record.handoff_problem).inc()
        if record.body_bytes is not None:
            self._histogram(self.request_bytes, adapter).observe(record.body_bytes)
        if record.prefill.response_bytes is not None:
            self._histogram(self.prefill_response_bytes, adapter).observe(record.prefill.response_bytes)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
