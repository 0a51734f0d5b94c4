"""One HTTP request's P/D decision: head checks, prefill leg, handoff, decode body. No engine knowledge.

The processor sequences the pure steps (prefill_target, openai_request, the adapter) around the I/O
steps, which it asks of two ``Transport``s: the prefill client (target resolution, the prefill call,
discovery) and the decode control client (a decode abort). It turns every outcome into a plain decision
(decisions.py: decode's body, or a local reply) that extproc/envoy/ turns into Envoy's reply. It is the
single place a PdError becomes a client-visible reply and the single place a request is logged and
counted.

Sequential engines: prefill, then ``decide``, then the body mutation (or a direct answer).
Concurrent engines: the decode body goes back at once and the prefill request runs in the background,
owned by ``BackgroundPrefills``; if it fails, the adapter's abort request ends the waiting decode.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import re
import secrets
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from extproc.adapters.base import (
    Adapter,
    AnswerDirectly,
    ConcurrentAdapter,
    ConcurrentPlan,
    DecodeWith,
    Disabled,
    PlanInput,
    SequentialAdapter,
)
from extproc.clock import Clock
from extproc.observability import logs
from extproc.observability.metrics import Metrics, RequestRecord
from extproc.pipeline.admission import Admission
from extproc.pipeline.background import BackgroundPrefill, BackgroundPrefills, Task
from extproc.pipeline.decisions import LocalReply, SendToDecode
from extproc.pipeline.inspector import Inspector
from extproc.protocol import error_shapes
from extproc.protocol.errors import Code, PdError
from extproc.protocol.headers import prefill_headers
from extproc.protocol.inspection import Rules
from extproc.protocol.openai_request import ClientRequest, Endpoint, paths_of, refuse_unsupported
from extproc.protocol.prefill_target import HEADER, PrefillTargets
from extproc.protocol.request_head import RequestHead
from extproc.protocol.steering import STEERING_HEADER_NAMES
from extproc.protocol.transport import Bounds, ResolvedTarget, Transport, WorkerAddress, WorkerReply
from extproc.upstream.decode_queue import QueueLimit
from extproc.upstream.decode_target import DecodeTarget, resolved
from extproc.upstream.discovery import ServerInfoCache

if TYPE_CHECKING:
    from extproc.observability.tracing import Tracing

log = logging.getLogger("extproc.request")

# A request id is logged as is only if it looks like an id (hex, dashes); anything else is logged as
# a digest, so a caller cannot put text of their choosing into our logs.
_ID_SHAPE = re.compile(r"[0-9a-fA-F-]{1,64}")


def loggable_request_id(value: str | None) -> str:
    if not value:
        return "-"
    if _ID_SHAPE.fullmatch(value):
        return value
    return "sha256:" + hashlib.sha256(value.encode("utf-8", "replace")).hexdigest()[:16]


@dataclass(slots=True)
class Pending:
    """What the headers phase learned, for the body phase of the same stream."""

    record: RequestRecord
    # The checked target, or (with fallback on) a failure of the prefill worker already known from
    # the head, such as a name that did not resolve: the body phase serves that request whole.
    target: ResolvedTarget | PdError


@dataclass(frozen=True, slots=True)
class BodyOutcome:
    """The decision for the body message, and for concurrent engines the prefill still running (the stream
    cancels it if Envoy ends the stream before decode answers)."""

    decision: SendToDecode | LocalReply
    background: BackgroundPrefill | None = None


# A lost abort (one that reaches SGLang's scheduler before the request itself) is forgotten, so the
# abort is sent again after each of these waits until decode has answered (it is idempotent).
ABORT_RETRY_WAITS = (0.25, 0.5, 1.0, 2.0, 4.0)
# How long a failed decode answer waits for the prefill leg's own outcome (see on_decode_answer).
DECODE_ERROR_GRACE = 2.0


class PdProcessor:
    def __init__(
        self,
        adapter: Adapter | Disabled,
        prefill: Transport,
        *,
        decode_control: Transport,
        clock: Clock,
        max_request_bytes: int,
        admission: Admission,
        metrics: Metrics,
        background: BackgroundPrefills,
        decode: ResolvedTarget | DecodeTarget,
        decode_queue: QueueLimit | None = None,
        fallback: bool = False,
        serve_unsupported: bool = False,
        tracing: Tracing | None = None,
        inspector: Inspector | None = None,
        nonce: Callable[[], int] = lambda: secrets.randbits(63),
        strip_before_decode: Iterable[str] = (),
    ) -> None:
        """``strip_before_decode``: headers every decode request loses besides the adapter's and the steering
        ones (gateway mode: the endpoint picker's, which the gateway's route may not remove itself)."""
        self._adapter = adapter
        self._prefill = prefill
        self._decode_control = decode_control  # the local decode worker's abort requests
        self._clock = clock
        self._now = clock.now
        self._admission = admission
        self._metrics = metrics
        self._background = background
        self._decode = decode
        self._decode_queue = decode_queue
        self._fallback = fallback
        self._serve_unsupported = serve_unsupported
        self._tracing = tracing
        self._nonce = nonce
        self._targets = PrefillTargets()
        # The gauge reads the admission count, its one owner, at scrape time (no lock per request).
        metrics.inflight.set_function(lambda: admission.inflight)
        self._adapter_name = adapter.name
        # What the adapter's route owns, once for the processor's life: the headers no leg receives from a
        # client (its fields are the inspection's rules).
        self._stripped_headers = adapter.reserved_headers | STEERING_HEADER_NAMES
        self._stripped_sorted = tuple(sorted(self._stripped_headers | frozenset(strip_before_decode)))
        self.inspector = inspector or Inspector(self.inspection_rules(adapter, max_request_bytes))
        # The paths the adapter serves P/D (gateway mode passes every other request through).
        self.pd_paths = paths_of(adapter.endpoints)
        self._server_info = ServerInfoCache(prefill, adapter.discovery_headers, keep=adapter.server_info_keys,
                                            clock=clock)

    @staticmethod
    def inspection_rules(adapter: Adapter | Disabled, max_request_bytes: int) -> Rules:
        """What the body's inspection refuses for this adapter (the steering check skips its own fields)."""
        return Rules(max_request_bytes, tuple(adapter.reserved_fields),
                     frozenset(field.name for field in adapter.reserved_fields), adapter.endpoints)

    # --- the two ext_proc phases -------------------------------------------------------------------

    async def on_headers(self, head: RequestHead) -> Pending | LocalReply:
        """Everything that needs only the head: the kill switch, draining, the cap, the target and its policy.
        Returns the state for the body phase, or the reply that ends the request now."""
        record = self._record(head)
        try:
            if isinstance(self._adapter, Disabled):
                raise PdError(Code.PD_ADAPTER_UNAVAILABLE)
            self._admission.check()  # shed before Envoy buffers the body (on_body checks again)
            if self._decode_queue is not None and self._decode_queue.over_limit():
                self._metrics.decode_queue_sheds.labels(self._adapter_name).inc()
                raise PdError(Code.PD_OVERLOADED)  # before any prefill: its KV would wait past the lease
            target: ResolvedTarget | PdError = await self._prefill.resolve(self._targets.parse(head.values(HEADER)))
        except PdError as error:
            if not (self._fallback and error.allows_fallback):
                return self._refuse(record, error)
            target = error
        except asyncio.CancelledError:
            self._finish(record, "cancelled", 499)
            raise
        except Exception:
            return self._refuse(record, _bug(record))
        return Pending(record, target)

    def refuse_now(self, pending: Pending, code: Code) -> LocalReply:
        return self._refuse(pending.record, PdError(code))

    async def on_body(self, head: RequestHead, pending: Pending, body: bytes) -> BodyOutcome:
        record = pending.record
        record.body_bytes = len(body)
        adapter = self._adapter
        try:
            if isinstance(adapter, Disabled):  # refused at the head already; a body never gets here
                raise PdError(Code.PD_ADAPTER_UNAVAILABLE)
            request = await self.inspector.inspect(head.path, head.first("content-type"), body)
            if request.unsupported is not None:
                if not (self._serve_unsupported and isinstance(adapter, SequentialAdapter)):
                    refuse_unsupported(request)
                error = PdError(Code.UNSUPPORTED_PD_VARIANT, field=request.unsupported)
                whole = self._fall_back(adapter, request, record, error, adapter_body=False)
                self._finish(record, record.outcome, record.status)
                return BodyOutcome(whole)
            target = pending.target
            if isinstance(target, PdError) and isinstance(adapter, ConcurrentAdapter):
                raise target  # only a sequential flow can serve a request whole
            self._admission.enter()
            if isinstance(adapter, ConcurrentAdapter):
                assert not isinstance(target, PdError)
                return await self._start_concurrent(adapter, head, request, target, record)
            try:
                if isinstance(target, PdError):
                    raise target
                decision = await self._run_sequential(adapter, head, request, target, record)
            except PdError as error:
                if not (self._fallback and error.allows_fallback):
                    raise
                decision = self._fall_back(adapter, request, record, error)
            finally:
                self._leave()
        except PdError as error:
            return BodyOutcome(self._refuse(record, error))
        except asyncio.CancelledError:
            self._finish(record, "cancelled", 499)
            raise
        except Exception:
            return BodyOutcome(self._refuse(record, _bug(record)))
        self._finish(record, record.outcome, record.status)
        return BodyOutcome(decision)

    # --- the flows ---------------------------------------------------------------------------------

    async def _run_sequential(self, adapter: SequentialAdapter, head: RequestHead, request: ClientRequest,
                              target: ResolvedTarget, record: RequestRecord) -> SendToDecode | LocalReply:
        prefill_body = adapter.prefill_body(request, await self._plan_input(adapter, target))
        reply = await self._post_prefill(head, request, target, prefill_body, record)
        decision = adapter.decide(request, reply)
        if isinstance(decision, AnswerDirectly):
            record.outcome = "answered_by_prefill"
            return LocalReply(decision.status, decision.body, "pd_answered_by_prefill",
                              content_type=decision.content_type.encode())
        return self._decode_reply(decision)

    def _fall_back(self, adapter: Adapter, request: ClientRequest, record: RequestRecord,
                   error: PdError, adapter_body: bool = True) -> SendToDecode:
        """The local decode worker serves the request whole; Envoy marks the response (x-pd-fallback,
        with the reason). An unsupported variant goes exactly as sent (``adapter_body=False``)."""
        reason = error.code.value
        record.outcome, record.fallback_reason = "prefill_fallback", reason
        self._metrics.fallbacks.labels(record.adapter, reason).inc()
        decision = adapter.aggregated(request) if adapter_body else DecodeWith(request.raw)
        return self._decode_reply(decision, metadata={"fallback": f"aggregated; reason={reason}"})

    async def _start_concurrent(self, adapter: ConcurrentAdapter, head: RequestHead, request: ClientRequest,
                                target: ResolvedTarget, record: RequestRecord) -> BodyOutcome:
        """Both legs at once (the engines rendezvous by themselves): decode gets its body now, the
        prefill request runs in the background; from here its slot is released by the owner."""
        try:
            plan = adapter.plan(request, await self._plan_input(adapter, target))
        except BaseException:
            self._leave()
            raise
        handle = self._background.start(
            lambda handle: self._background_prefill(adapter, head, request, target, record, plan, handle),
            lambda finished: self._background_done(finished, record))
        return BodyOutcome(self._decode_reply(plan.decode), handle)

    async def on_decode_answer(self, handle: BackgroundPrefill, status: int) -> LocalReply | None:
        """Decode's response headers arrived. If the prefill leg failed, the client gets that error
        (decode's own answer is dropped: it only says it was aborted, or could not reach the prefill
        engine); otherwise decode's answer goes on (None). When decode fails while our prefill request is still out,
        the prefill's outcome is awaited for a moment: both usually fail for the same reason."""
        handle.decode_answered.set()
        if status >= 400 and handle.failure is None and not handle.task.done():
            with contextlib.suppress(TimeoutError):
                async with self._clock.timeout(DECODE_ERROR_GRACE):
                    await asyncio.shield(handle.task)
        if handle.failure is not None:
            return error_reply(handle.failure)
        if status >= 400 and not handle.task.done():
            # Decode failed and its answer goes to the client: nobody will claim what the prefill holds,
            # and it would wait for a claim until its engine's bootstrap timeout (SGLang: 300 s) with our
            # admission slot, a prefill connection and its KV. Closing our request aborts it there.
            handle.task.cancel()
        handle.decode_answer_relayed = status
        return None

    async def _background_prefill(self, adapter: ConcurrentAdapter, head: RequestHead, request: ClientRequest,
                                  target: ResolvedTarget, record: RequestRecord, plan: ConcurrentPlan,
                                  handle: BackgroundPrefill) -> None:
        try:
            reply = await self._post_prefill(head, request, target, plan.prefill_body, record,
                                             Bounds(adapter.prefill_deadline, adapter.prefill_deadline))
            adapter.check_prefill(reply)
        except asyncio.CancelledError:
            # Ended by us after decode's answer went to the client (decode's error: abandoned; or a
            # drain): that answer is the outcome, as with the sequential engines.
            if handle.decode_answer_relayed is not None:
                self._finish(record, "ok", handle.decode_answer_relayed)
            else:
                self._finish(record, "cancelled", 499)
            raise
        except Exception as exc:
            # A bug fails the prefill like any PdError: decode waits for this prefill's KV, so it is
            # aborted whatever ended the prefill, and the failure is counted and answered.
            await self._background_failed(exc if isinstance(exc, PdError) else _bug(record), plan, record, handle)
            return
        self._finish(record, "ok", 200)

    async def _background_failed(self, error: PdError, plan: ConcurrentPlan, record: RequestRecord,
                                 handle: BackgroundPrefill) -> None:
        self._metrics.background_failures.labels(record.adapter, error.code.value).inc()
        record.handoff_problem = error.handoff_reason
        if error.relayed is not None:
            record.prefill_error = error.relayed.reason
        handle.failure = error
        if handle.decode_answer_relayed is not None:  # too late to be the answer: the client has decode's
            self._finish(record, "ok", handle.decode_answer_relayed)
            return
        if plan.abort is not None and not handle.decode_answered.is_set():
            record.decode_aborted = await self._abort_decode(plan, record, handle.decode_answered)
        self._finish(record, error.code.value, error.status)

    def _background_done(self, task: Task, record: RequestRecord) -> None:
        self._leave()
        if not record.done:  # cancelled before its first step: nothing inside the task ran
            self._finish(record, "cancelled", 499)

    async def _abort_decode(self, plan: ConcurrentPlan, record: RequestRecord, decode_answered: asyncio.Event) -> bool:
        """End the decode request that waits for this prefill: the abort request, again after each wait
        until decode has answered. True once decode answered after an accepted abort."""
        assert plan.abort is not None
        headers = [*plan.abort.headers, ("content-type", "application/json")]
        accepted = False
        for wait in (*ABORT_RETRY_WAITS, None):
            try:
                reply = await self._decode_control.post(resolved(self._decode), plan.abort.path, headers,
                                                         plan.abort.body)
            except PdError as error:
                log.warning("decode abort failed", extra={"request_id": record.request_id, "code": error.code.value})
            except Exception:  # a bug: the next try may still end decode
                _bug(record)
            else:
                accepted = accepted or reply.status == 200
                if reply.status != 200:
                    log.warning("decode abort refused", extra={"request_id": record.request_id,
                                                              "status": reply.status})
            if wait is None:
                break
            with contextlib.suppress(TimeoutError):
                async with self._clock.timeout(wait):
                    await decode_answered.wait()
                    break
        return accepted and decode_answered.is_set()

    # --- pieces ------------------------------------------------------------------------------------

    async def _plan_input(self, adapter: Adapter, target: ResolvedTarget) -> PlanInput:
        server_info = None
        if adapter.server_info_path is not None:
            server_info = await self._server_info.get(target, adapter.server_info_path)
        # The adapter sees the address we checked, not the name: an engine that dials the prefill host
        # itself (SGLang's bootstrap) must not resolve the name again to another address.
        given = target.target
        # A header's IP target is already that address (prefill_target gives it the IP's canonical text).
        checked = given if given.ip == target.ip else WorkerAddress(host=str(target.ip), port=given.port,
                                                                       ip=target.ip)
        return PlanInput(checked, self._nonce(), server_info)

    async def _post_prefill(self, head: RequestHead, request: ClientRequest,
                            target: ResolvedTarget, body: bytes, record: RequestRecord,
                            bounds: Bounds | None = None) -> WorkerReply:
        headers = prefill_headers(head.headers, self._stripped_headers)
        if record.trace is None:
            return await self._prefill.post(target, request.path, headers, body, record.prefill, bounds)
        headers = record.trace.start_prefill(headers)
        try:
            return await self._prefill.post(target, request.path, headers, body, record.prefill, bounds)
        finally:
            record.trace.end_prefill(record.prefill.status)

    def _decode_reply(self, decision: DecodeWith,
                      metadata: Mapping[str, str] | None = None) -> SendToDecode:
        overridden = {name for name, _ in decision.headers}
        remove = [name for name in self._stripped_sorted if name not in overridden]
        return SendToDecode(decision.body, decision.headers, remove, metadata)

    def _leave(self) -> None:
        self._admission.leave()

    def _record(self, head: RequestHead) -> RequestRecord:
        record = RequestRecord(loggable_request_id(head.first("x-request-id")), self._adapter_name,
                               self._now(), api_label(head.path))
        if self._tracing is not None:
            record.trace = self._tracing.begin(head.headers)
        return record

    def _refuse(self, record: RequestRecord, error: PdError) -> LocalReply:
        record.handoff_problem = error.handoff_reason
        if error.relayed is not None:
            record.prefill_error = error.relayed.reason
        self._finish(record, error.code.value, error.status)
        extra = [("retry-after", b"1")] if error.code is Code.PD_OVERLOADED else []
        return error_reply(error, extra, anthropic=record.api == Endpoint.MESSAGES.api)

    def _finish(self, record: RequestRecord, outcome: str, status: int) -> None:
        record.outcome, record.status, record.done = outcome, status, True
        total = self._now() - record.started
        self._metrics.finish(record, total)
        if record.trace is not None:
            record.trace.finish(record.adapter, outcome, status, record.api)
        extra = {
            "request_id": record.request_id,
            "adapter": record.adapter,
            "api": record.api,
            "outcome": outcome,
            "status": status,
            "prefill_status": record.prefill.status,
            "prefill_ms": _ms(record.prefill.total_seconds),
            "total_ms": _ms(total),
            "body_bytes": record.body_bytes,
        }
        if record.decode_aborted is not None:
            extra["decode_aborted"] = record.decode_aborted
        if record.fallback_reason is not None:
            extra["fallback_reason"] = record.fallback_reason
        if record.prefill_error is not None:
            extra["prefill_error"] = record.prefill_error
        logs.info(log, "pd_request", extra)


def _bug(record: RequestRecord) -> PdError:
    """Log the exception being handled (a bug: our code raises only PdError) and return the error the
    client gets for it."""
    log.exception("bug in the P/D processor", extra={"request_id": record.request_id})
    return PdError(Code.INTERNAL_ERROR)


def error_reply(error: PdError, extra: Sequence[tuple[str, bytes]] = (), anthropic: bool = False) -> LocalReply:
    """The client's reply to an error: ours, or the prefill engine's own error about the request, in the
    client's API's shape (Anthropic's on the Messages API)."""
    if error.relayed is not None:
        body = error_shapes.relayed_body(error.relayed, anthropic)
    else:
        body = error_shapes.our_error_body(error.code, error.status, error.param, anthropic)
    # details become %RESPONSE_CODE_DETAILS%; the "pd_" prefix keeps Envoy's local_reply_config mappers
    # (which shape Envoy's own errors) away from our replies.
    return LocalReply(error.status, body, "pd_" + error.code.value, extra)


def api_label(path: str) -> str:
    """The ``api`` label of a request's path: an Endpoint's short name, or "other"."""
    bare = path.split("?", 1)[0]
    for endpoint in Endpoint:
        if bare == endpoint.value:
            return endpoint.api
    return "other"


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1e3, 3)
