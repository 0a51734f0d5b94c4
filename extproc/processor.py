"""One HTTP request's P/D decision: head checks, prefill leg, handoff, decode body. No engine knowledge.

The processor sequences pure steps (openai_request, prefill_target, the adapter) around the one I/O
step (the prefill HTTP call) and turns every outcome into an ext_proc response. It is the single
place a PdError becomes a client-visible reply and the single place a request is logged.
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

from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from extproc import envoy_messages as msg
from extproc.adapters.base import Adapter, AnswerDirectly, Flow
from extproc.errors import Code, PdError
from extproc.headers import prefill_headers
from extproc.openai_request import ClientRequest, parse_client_request
from extproc.prefill_target import HEADER, PrefillTarget, parse_prefill_target
from extproc.upstream import PrefillClient

log = logging.getLogger("extproc.request")

# Request ids are logged only if they look like ids; anything else is logged as a digest so a
# caller cannot put arbitrary text into our logs.
_ID_SHAPE = re.compile(r"[0-9A-Za-z][0-9A-Za-z_.:-]{0,63}")
_ID_ALPHABET = re.compile(r"[0-9a-fA-F-]+")


def loggable_request_id(value: str | None) -> str:
    if value and _ID_SHAPE.fullmatch(value) and _ID_ALPHABET.fullmatch(value):
        return value
    if not value:
        return "-"
    return "sha256:" + hashlib.sha256(value.encode("utf-8", "replace")).hexdigest()[:16]


@dataclass
class Admission:
    """Counts in-flight P/D requests against a cap; no queue."""

    limit: int
    inflight: int = 0
    draining: bool = False
    rejected: int = field(default=0)

    def enter(self) -> None:
        if self.draining:
            raise PdError(Code.PD_SHUTTING_DOWN)
        if self.inflight >= self.limit:
            self.rejected += 1
            raise PdError(Code.PD_OVERLOADED)
        self.inflight += 1

    def leave(self) -> None:
        self.inflight -= 1


@dataclass(slots=True)
class RequestRecord:
    """What the one log line per request says. Never bodies or header values."""

    request_id: str
    adapter: str
    outcome: str = "ok"
    status: int = 200
    prefill_status: int | None = None
    prefill_seconds: float | None = None
    started: float = field(default_factory=time.perf_counter)


class PdProcessor:
    def __init__(
        self,
        adapter: Adapter | None,
        prefill: PrefillClient,
        max_request_bytes: int,
        admission: Admission,
        nonce: Callable[[], int] = lambda: secrets.randbits(63),
    ) -> None:
        self._adapter = adapter
        self._prefill = prefill
        self._max_request_bytes = max_request_bytes
        self._admission = admission
        self._nonce = nonce
        self._adapter_name = adapter.name if adapter is not None else "none"

    def check_head(self, head: msg.RequestHead) -> PrefillTarget:
        """Checks that need only the request head; run as early as the head is known."""
        if self._adapter is None:
            raise PdError(Code.PD_ADAPTER_UNAVAILABLE)
        if self._admission.draining:
            raise PdError(Code.PD_SHUTTING_DOWN)
        return parse_prefill_target(head.values(HEADER))

    def refuse_head(self, head: msg.RequestHead) -> pb.ProcessingResponse | None:
        """An immediate error for a bad head, or None to continue to the body."""
        try:
            self.check_head(head)
        except PdError as error:
            record = RequestRecord(loggable_request_id(head.first("x-request-id")), self._adapter_name)
            return self._refuse(record, error)
        return None

    async def on_body(self, head: msg.RequestHead, body: bytes) -> pb.ProcessingResponse:
        record = RequestRecord(loggable_request_id(head.first("x-request-id")), self._adapter_name)
        try:
            target = self.check_head(head)
            assert self._adapter is not None
            request = parse_client_request(head.path, head.first("content-type"), body,
                                           self._max_request_bytes)
            self._admission.enter()
            try:
                response = await self._run_legs(self._adapter, head, request, target, record)
            finally:
                self._admission.leave()
        except PdError as error:
            return self._refuse(record, error)
        except asyncio.CancelledError:
            record.outcome, record.status = "cancelled", 499
            self._log(record)
            raise
        except Exception:
            log.exception("bug in the P/D processor", extra={"request_id": record.request_id})
            return self._refuse(record, PdError(Code.INTERNAL_ERROR))
        self._log(record)
        return response

    async def _run_legs(self, adapter: Adapter, head: msg.RequestHead, request: ClientRequest,
                        target: PrefillTarget, record: RequestRecord) -> pb.ProcessingResponse:
        plan = adapter.plan(request, target, self._nonce())
        if adapter.flow is Flow.CONCURRENT:  # pragma: no cover - no concurrent adapter yet
            raise PdError(Code.PD_ADAPTER_UNAVAILABLE)
        started = time.perf_counter()
        try:
            reply = await self._prefill.post(target, request.path, prefill_headers(head.headers),
                                             plan.prefill_body)
        finally:
            record.prefill_seconds = time.perf_counter() - started
        record.prefill_status = reply.status
        decision = adapter.decide(request, reply)
        if isinstance(decision, AnswerDirectly):
            record.outcome = "answered_by_prefill"
            return msg.immediate(decision.status, decision.body, "pd_answered_by_prefill",
                                 content_type=decision.content_type.encode())
        return msg.replace_body(decision.body)

    def _refuse(self, record: RequestRecord, error: PdError) -> pb.ProcessingResponse:
        record.outcome, record.status = error.code.value, error.status
        self._log(record)
        extra = [("retry-after", b"1")] if error.code is Code.PD_OVERLOADED else []
        return msg.error_reply(error.code, error.status, error.param, extra)

    def _log(self, record: RequestRecord) -> None:
        total = time.perf_counter() - record.started
        log.info(
            "pd_request",
            extra={
                "request_id": record.request_id,
                "adapter": record.adapter,
                "outcome": record.outcome,
                "status": record.status,
                "prefill_status": record.prefill_status,
                "prefill_ms": None if record.prefill_seconds is None else round(record.prefill_seconds * 1e3, 3),
                "total_ms": round(total * 1e3, 3),
            },
        )
