"""Optional OpenTelemetry spans for our stages (PD_EXTPROC_TRACING=otlp). Off by default: then this
module is never imported and requests carry the client's trace context to prefill unchanged.

When on, each P/D request gets a server span ``pd.request`` (child of the client's ``traceparent``)
and a client span ``pd.prefill`` around the prefill call; the prefill worker receives the
``pd.prefill`` span as its parent, so the engine's spans nest under ours. Spans are exported as
OTLP/HTTP JSON (the protobuf exporter's ``opentelemetry/proto`` package collides with the one
xds-protos ships, so we post JSON ourselves; any OTLP collector accepts it on /v1/traces).
"""

from __future__ import annotations

import logging
import urllib.request
from collections.abc import Sequence
from typing import Any

import orjson
from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult
from opentelemetry.trace import Span, SpanKind, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from extproc.observability.outcomes import SERVED_OUTCOMES

log = logging.getLogger("extproc.tracing")
_PROPAGATOR = TraceContextTextMapPropagator()
_KINDS = {SpanKind.INTERNAL: 1, SpanKind.SERVER: 2, SpanKind.CLIENT: 3, SpanKind.PRODUCER: 4,
          SpanKind.CONSUMER: 5}
_STATUS = {StatusCode.UNSET: 0, StatusCode.OK: 1, StatusCode.ERROR: 2}


def _value(value: Any) -> dict[str, Any]:
    if isinstance(value, bool):
        return {"boolValue": value}
    if isinstance(value, int):
        return {"intValue": str(value)}
    if isinstance(value, float):
        return {"doubleValue": value}
    return {"stringValue": str(value)}


def otlp_json(spans: Sequence[ReadableSpan], service_name: str) -> bytes:
    """The OTLP/JSON body (protobuf JSON mapping: hex ids, nanosecond strings) for ``spans``."""
    encoded = []
    for span in spans:
        context = span.get_span_context()
        assert context is not None
        entry: dict[str, Any] = {
            "traceId": format(context.trace_id, "032x"),
            "spanId": format(context.span_id, "016x"),
            "name": span.name,
            "kind": _KINDS.get(span.kind, 1),
            "startTimeUnixNano": str(span.start_time or 0),
            "endTimeUnixNano": str(span.end_time or 0),
            "attributes": [{"key": k, "value": _value(v)} for k, v in (span.attributes or {}).items()],
            "status": {"code": _STATUS.get(span.status.status_code, 0)},
        }
        if span.parent is not None:
            entry["parentSpanId"] = format(span.parent.span_id, "016x")
        encoded.append(entry)
    return orjson.dumps({"resourceSpans": [{
        "resource": {"attributes": [{"key": "service.name", "value": {"stringValue": service_name}}]},
        "scopeSpans": [{"scope": {"name": "pd-extproc"}, "spans": encoded}],
    }]})


class OtlpJsonExporter(SpanExporter):
    def __init__(self, endpoint: str, service_name: str) -> None:
        self._endpoint = endpoint
        self._service_name = service_name

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        request = urllib.request.Request(self._endpoint, data=otlp_json(spans, self._service_name),  # noqa: S310
                                         headers={"content-type": "application/json"}, method="POST")
        try:
            with urllib.request.urlopen(request, timeout=5) as response:  # noqa: S310
                response.read()
        except OSError as exc:
            log.warning("span export failed", extra={"error": type(exc).__name__})
            return SpanExportResult.FAILURE
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        return None


class RequestTrace:
    """The spans of one P/D request."""

    def __init__(self, tracer: trace.Tracer, parent: Context) -> None:
        self._tracer = tracer
        self.request: Span = tracer.start_span("pd.request", context=parent, kind=SpanKind.SERVER)
        self.prefill: Span | None = None

    def start_prefill(self, headers: list[tuple[str, str]]) -> list[tuple[str, str]]:
        """Open the pd.prefill span; return the prefill headers with it as their trace parent."""
        self.prefill = self._tracer.start_span("pd.prefill", context=trace.set_span_in_context(self.request),
                                               kind=SpanKind.CLIENT)
        carrier: dict[str, str] = {}
        _PROPAGATOR.inject(carrier, context=trace.set_span_in_context(self.prefill))
        kept = [(k, v) for k, v in headers if k not in carrier]
        return kept + list(carrier.items())

    def end_prefill(self, status: int | None) -> None:
        if self.prefill is not None:
            if status is not None:
                self.prefill.set_attribute("http.response.status_code", status)
            self.prefill.end()

    def finish(self, adapter: str, outcome: str, status: int, api: str = "other") -> None:
        self.request.set_attribute("pd.adapter", adapter)
        self.request.set_attribute("pd.api", api)
        self.request.set_attribute("pd.outcome", outcome)
        self.request.set_attribute("http.response.status_code", status)
        if outcome not in SERVED_OUTCOMES:
            self.request.set_status(StatusCode.ERROR)
        self.request.end()


class Tracing:
    def __init__(self, endpoint: str, service_name: str = "pd-extproc") -> None:
        self._provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
        self._provider.add_span_processor(BatchSpanProcessor(OtlpJsonExporter(endpoint, service_name)))
        self._tracer = self._provider.get_tracer("pd-extproc")

    def begin(self, headers: Sequence[tuple[str, str]]) -> RequestTrace:
        carrier = {k: v for k, v in headers if k in ("traceparent", "tracestate")}
        return RequestTrace(self._tracer, _PROPAGATOR.extract(carrier))

    def shutdown(self) -> None:
        self._provider.shutdown()
