"""One HTTP request's P/D decision: head checks, prefill leg, handoff, decode body. No engine knowledge.

The processor sequences the pure steps (prefill_target, openai_request, the adapter) around the I/O
steps (target resolution and the prefill HTTP call) and turns every outcome into an ext_proc
response. It is the single place a PdError becomes a client-visible reply and the single place a
request is logged and counted.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import re
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from extproc import envoy_messages as msg
from extproc.adapters.base import Adapter, AnswerDirectly, Flow, Plan, PrefillReply
from extproc.errors import Code, PdError
from extproc.headers import prefill_headers
from extproc.metrics import Metrics, RequestRecord
from extproc.openai_request import ClientRequest, parse_client_request
from extproc.prefill_target import HEADER, PrefillTarget, parse_prefill_target
from extproc.upstream import PrefillClient, ResolvedTarget

if TYPE_CHECKING:
    from extproc.tracing import Tracing

log = logging.getLogger("extproc.request")

# A request id is logged as is only if it looks like an id (hex, dashes); anything else is logged as
# a digest, so a caller cannot put text of their choosing into our logs.
_ID_SHAPE = re.compile(r"[0-9a-fA-F-]{1,64}")
_PREFILL_RESPONSE_PROBLEMS = frozenset({
    Code.PREFILL_RESPONSE_NOT_JSON, Code.PREFILL_RESPONSE_TRUNCATED, Code.PREFILL_RESPONSE_STREAMED,
    Code.PREFILL_RESPONSE_TOO_LARGE,
})


def loggable_request_id(value: str | None) -> str:
    if not value:
        return "-"
    if _ID_SHAPE.fullmatch(value):
        return value
    return "sha256:" + hashlib.sha256(value.encode("utf-8", "replace")).hexdigest()[:16]


def handoff_reason(param: str | None) -> str:
    """A metric label from an invalid_prefill_handoff param ("kv_transfer_params.tp_size is invalid")."""
    return (param or "unknown").rsplit(".", 1)[-1].replace(" is ", "_").replace(" ", "_")


@dataclass
class Admission:
    """Counts in-flight P/D requests against a cap; beyond it requests are shed, never queued."""

    limit: int
    inflight: int = 0
    draining: bool = False
    idle: asyncio.Event = field(default_factory=asyncio.Event)

    def enter(self) -> None:
        if self.draining:
            raise PdError(Code.PD_SHUTTING_DOWN)
        if self.full:
            raise PdError(Code.PD_OVERLOADED)
        self.inflight += 1
        self.idle.clear()

    @property
    def full(self) -> bool:
        return self.inflight >= self.limit

    def leave(self) -> None:
        self.inflight -= 1
        if self.inflight == 0:
            self.idle.set()


@dataclass(slots=True)
class Pending:
    """What the headers phase learned, for the body phase of the same stream."""

    record: RequestRecord
    target: ResolvedTarget


class PdProcessor:
    def __init__(
        self,
        adapter: Adapter | None,
        prefill: PrefillClient,
        max_request_bytes: int,
        admission: Admission,
        metrics: Metrics,
        tracing: Tracing | None = None,
        nonce: Callable[[], int] = lambda: secrets.randbits(63),
    ) -> None:
        self._tracing = tracing
        self._adapter = adapter
        self._prefill = prefill
        self._max_request_bytes = max_request_bytes
        self._admission = admission
        self._metrics = metrics
        self._nonce = nonce
        self._adapter_name = adapter.name if adapter is not None else "none"

    def _record(self, head: msg.RequestHead) -> RequestRecord:
        record = RequestRecord(loggable_request_id(head.first("x-request-id")), self._adapter_name,
                               time.perf_counter())
        if self._tracing is not None:
            record.trace = self._tracing.begin(head.headers)
        return record

    async def _post_prefill(self, head: msg.RequestHead, request: ClientRequest, target: ResolvedTarget,
                            body: bytes, record: RequestRecord) -> PrefillReply:
        headers = prefill_headers(head.headers)
        if record.trace is None:
            return await self._prefill.post(target, request.path, headers, body, record)
        headers = record.trace.start_prefill(headers)
        try:
            return await self._prefill.post(target, request.path, headers, body, record)
        finally:
            record.trace.end_prefill(record.prefill_status)

    async def on_headers(self, head: msg.RequestHead) -> Pending | pb.ProcessingResponse:
        """Everything that needs only the head: the kill switch, draining, the cap, the target and its policy.
        Returns the state for the body phase, or the reply that ends the request now."""
        record = self._record(head)
        try:
            if self._adapter is None:
                raise PdError(Code.PD_ADAPTER_UNAVAILABLE)
            if self._admission.draining:
                raise PdError(Code.PD_SHUTTING_DOWN)
            if self._admission.full:  # shed before Envoy buffers the body (on_body checks again)
                raise PdError(Code.PD_OVERLOADED)
            target = await self._prefill.resolve(parse_prefill_target(head.values(HEADER)))
        except PdError as error:
            return self._refuse(record, error)
        except asyncio.CancelledError:
            self._finish(record, "cancelled", 499)
            raise
        return Pending(record, target)

    def refuse_now(self, pending: Pending, code: Code) -> pb.ProcessingResponse:
        return self._refuse(pending.record, PdError(code))

    async def on_body(self, head: msg.RequestHead, pending: Pending,
                      body: bytes) -> tuple[pb.ProcessingResponse, asyncio.Task[None] | None]:
        """The reply for the body phase, and for CONCURRENT adapters the prefill still running in the
        background (the caller cancels it if the stream is reset before decode answers)."""
        record = pending.record
        record.body_bytes = len(body)
        try:
            assert self._adapter is not None
            request = parse_client_request(head.path, head.first("content-type"), body, self._max_request_bytes)
            self._admission.enter()
            self._metrics.inflight.inc()
            try:
                if self._adapter.flow is Flow.CONCURRENT:
                    return await self._start_concurrent(self._adapter, head, request, pending.target, record)
                response = await self._run_sequential(self._adapter, head, request, pending.target, record)
            finally:
                if self._adapter.flow is Flow.SEQUENTIAL:
                    self._leave()
        except PdError as error:
            return self._refuse(record, error), None
        except asyncio.CancelledError:
            self._finish(record, "cancelled", 499)
            raise
        except Exception:
            log.exception("bug in the P/D processor", extra={"request_id": record.request_id})
            return self._refuse(record, PdError(Code.INTERNAL_ERROR)), None
        self._finish(record, record.outcome, record.status)
        return response, None

    def _leave(self) -> None:
        self._admission.leave()
        self._metrics.inflight.dec()

    async def _plan(self, adapter: Adapter, request: ClientRequest, target: ResolvedTarget) -> Plan:
        server_info = None
        if adapter.server_info_path is not None:
            server_info = await self._prefill.server_info(target, adapter.server_info_path)
        # The adapter sees the address we checked, not the name: an engine that dials the prefill host
        # itself (SGLang's bootstrap) must not resolve the name again to another address.
        checked = PrefillTarget(host=str(target.ip), port=target.target.port, ip=target.ip)
        return adapter.plan(request, checked, self._nonce(), server_info)

    async def _start_concurrent(self, adapter: Adapter, head: msg.RequestHead, request: ClientRequest,
                                target: ResolvedTarget, record: RequestRecord
                                ) -> tuple[pb.ProcessingResponse, asyncio.Task[None]]:
        """Both legs at once (the engines rendezvous by themselves): decode gets its body now, the
        prefill request runs in the background and is drained; its failure is logged and counted."""
        try:
            plan = await self._plan(adapter, request, target)
        except BaseException:
            self._leave()
            raise
        assert plan.decode_body is not None
        task = asyncio.create_task(self._background_prefill(adapter, head, request, target, record, plan))
        return msg.replace_body(plan.decode_body), task

    async def _background_prefill(self, adapter: Adapter, head: msg.RequestHead, request: ClientRequest,
                                  target: ResolvedTarget, record: RequestRecord, plan: Plan) -> None:
        try:
            adapter.check_background(await self._post_prefill(head, request, target, plan.prefill_body, record))
        except PdError as error:
            record.handoff_problem = error.code.value
            self._metrics.background_failures.labels(record.adapter, error.code.value).inc()
            self._finish(record, error.code.value, error.status)
            return
        except asyncio.CancelledError:
            self._finish(record, "cancelled", 499)
            raise
        except Exception:
            log.exception("bug in the P/D processor", extra={"request_id": record.request_id})
            self._finish(record, Code.INTERNAL_ERROR.value, 500)
            return
        finally:
            self._leave()
        self._finish(record, "ok", 200)

    async def _run_sequential(self, adapter: Adapter, head: msg.RequestHead, request: ClientRequest,
                              target: ResolvedTarget, record: RequestRecord) -> pb.ProcessingResponse:
        plan = await self._plan(adapter, request, target)
        reply = await self._post_prefill(head, request, target, plan.prefill_body, record)
        decision = adapter.decide(request, reply)
        if isinstance(decision, AnswerDirectly):
            record.outcome = "answered_by_prefill"
            return msg.immediate(decision.status, decision.body, "pd_answered_by_prefill",
                                 content_type=decision.content_type.encode())
        return msg.replace_body(decision.body)

    def _refuse(self, record: RequestRecord, error: PdError) -> pb.ProcessingResponse:
        if error.code is Code.INVALID_PREFILL_HANDOFF:
            record.handoff_problem = handoff_reason(error.param)
        elif error.code in _PREFILL_RESPONSE_PROBLEMS:
            record.handoff_problem = error.code.value
        self._finish(record, error.code.value, error.status)
        extra = [("retry-after", b"1")] if error.code is Code.PD_OVERLOADED else []
        return msg.error_reply(error.code, error.status, error.param, extra)

    def _finish(self, record: RequestRecord, outcome: str, status: int) -> None:
        record.outcome, record.status = outcome, status
        total = time.perf_counter() - record.started
        self._metrics.finish(record, total)
        if record.trace is not None:
            record.trace.finish(record.adapter, outcome, status)
        log.info("pd_request", extra={
            "request_id": record.request_id,
            "adapter": record.adapter,
            "outcome": outcome,
            "status": status,
            "prefill_status": record.prefill_status,
            "prefill_ms": _ms(record.prefill_seconds),
            "total_ms": _ms(total),
            "body_bytes": record.body_bytes,
        })


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1e3, 3)
