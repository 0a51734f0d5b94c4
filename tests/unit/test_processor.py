"""The processor over an in-memory transport (no sockets): admission, both flows, the background
prefill's ending however it ends, the decode abort, and upstream's exception table."""

from __future__ import annotations

import asyncio
import ipaddress
import json
import ssl
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import pytest

from extproc.adapters.base import Adapter
from extproc.adapters.sglang import SglangAdapter
from extproc.adapters.vllm_nixl import VllmNixlAdapter
from extproc.observability.metrics import Metrics
from extproc.pipeline.admission import Admission
from extproc.pipeline.background import BackgroundPrefill, BackgroundPrefills
from extproc.pipeline.decisions import LocalReply
from extproc.pipeline.processor import ABORT_RETRY_WAITS, DECODE_ERROR_GRACE, BodyOutcome, PdProcessor, Pending
from extproc.plugin import FakeClock, FakeTransport
from extproc.protocol.errors import Code, PdError
from extproc.protocol.request_head import RequestHead
from extproc.protocol.transport import Bounds, ResolvedTarget, WorkerAddress, WorkerReply
from extproc.upstream.client import Phase, classify, http1

PREFILL = "10.0.0.7:8000"
DECODE = ResolvedTarget(WorkerAddress("127.0.0.1", 8200, ipaddress.ip_address("127.0.0.1")),
                        ipaddress.ip_address("127.0.0.1"), tls=False)
HANDOFF = {"do_remote_prefill": True, "do_remote_decode": False, "remote_block_ids": [[1]], "remote_engine_id": "e",
           "remote_request_id": "r", "remote_host": "10.0.0.7", "remote_port": 5600, "tp_size": 1}
CHAT_BODY = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}

def ok(body: dict[str, Any]) -> WorkerReply:
    return WorkerReply(200, "application/json", json.dumps(body).encode())


@dataclass
class Rig:
    processor: PdProcessor
    transport: FakeTransport
    admission: Admission
    metrics: Metrics
    background: BackgroundPrefills
    clock: FakeClock

    def outcomes(self) -> dict[str, float]:
        return {sample.labels["outcome"]: sample.value for metric in self.metrics.registry.collect()
                if metric.name == "pd_extproc_requests" for sample in metric.samples
                if sample.name.endswith("_total")}


def rig(adapter: Adapter, limit: int = 4, fallback: bool = False, tracing: Any = None,
        strip_before_decode: frozenset[str] = frozenset(), decode_control: FakeTransport | None = None) -> Rig:
    """A processor over a FakeTransport (its prefill client and, unless ``decode_control`` is given, its
    decode control client too: one record of every call, in order) and a FakeClock (its time moves only
    when the test advances it)."""
    transport, admission, metrics, clock = FakeTransport(), Admission(limit), Metrics(), FakeClock()
    background = BackgroundPrefills(clock)
    processor = PdProcessor(adapter, transport, decode_control=decode_control or transport, clock=clock,
                            max_request_bytes=1 << 20,
                            admission=admission, metrics=metrics, background=background, decode=DECODE,
                            fallback=fallback, tracing=tracing, nonce=lambda: 0x1234,
                            strip_before_decode=strip_before_decode)
    return Rig(processor, transport, admission, metrics, background, clock)


def inflight_gauge(r: Rig) -> float:
    (value,) = [sample.value for metric in r.metrics.registry.collect()
                if metric.name == "pd_extproc_inflight_requests" for sample in metric.samples]
    return value


def head(path: str = "/v1/chat/completions", **headers: str) -> RequestHead:
    return RequestHead(path, (("x-prefiller-host-port", PREFILL), ("content-type", "application/json"),
                                  *headers.items()))


async def start(r: Rig, body: dict[str, Any]) -> tuple[RequestHead, Pending]:
    request_head = head()
    pending = await r.processor.on_headers(request_head)
    assert isinstance(pending, Pending)
    return request_head, pending


async def start_background(r: Rig, body: dict[str, Any] = CHAT_BODY) -> BackgroundPrefill:
    """A P/D request on a concurrent (SGLang) flow, up to its background prefill's handle."""
    request_head, pending = await start(r, body)
    outcome = await r.processor.on_body(request_head, pending, json.dumps(body).encode())
    assert outcome.background is not None
    return outcome.background


def decode_answers_once_aborted(r: Rig, handle: BackgroundPrefill,
                                status: int = 500) -> Callable[[], Awaitable[WorkerReply]]:
    """The transport's answer to the decode abort: 200, after which decode answers ``status``, as
    SGLang's decode does for an aborted request."""
    async def abort_ends_decode() -> WorkerReply:
        asyncio.get_running_loop().call_soon(lambda: asyncio.ensure_future(
            r.processor.on_decode_answer(handle, status)))
        return WorkerReply(200, "text/plain", b"")

    return abort_ends_decode


async def settled(task: asyncio.Task[None]) -> None:
    """Return once ``task`` has ended and its owner's done callback (the slot's release) has run."""
    ran = asyncio.Event()
    task.add_done_callback(lambda _: ran.set())  # runs after the callbacks added before it
    await ran.wait()


def error_code(reply: object) -> str:
    assert isinstance(reply, LocalReply), reply
    code: str = json.loads(reply.body)["error"]["code"]
    return code


# --- the sequential flow ---------------------------------------------------------------------------


def test_sequential_request_posts_the_derived_body_and_releases_its_slot() -> None:
    async def run() -> None:
        r = rig(VllmNixlAdapter())
        r.transport.answers.append(ok({"id": "x", "kv_transfer_params": HANDOFF}))
        request_head, pending = await start(r, CHAT_BODY)
        outcome = await r.processor.on_body(request_head, pending, json.dumps(CHAT_BODY).encode())
        assert outcome.background is None
        decode_body = json.loads(outcome.decision.body)
        assert decode_body == {**CHAT_BODY, "kv_transfer_params": HANDOFF}
        (call,) = r.transport.calls
        assert json.loads(call.body or b"")["max_tokens"] == 1 and call.path == "/v1/chat/completions"
        assert r.admission.inflight == 0 and r.outcomes() == {"ok": 1.0}

    asyncio.run(run())


def test_a_reserved_field_is_refused_before_admission_and_any_leg() -> None:
    """Even at the cap: the client's error is the client's, not an overload."""
    async def run() -> None:
        r = rig(VllmNixlAdapter(), limit=1)
        request_head, pending = await start(r, CHAT_BODY)
        r.admission.enter()  # the one slot is taken
        body = json.dumps({**CHAT_BODY, "kv_transfer_params": {"do_remote_decode": True}}).encode()
        outcome = await r.processor.on_body(request_head, pending, body)
        assert error_code(outcome.decision) == "reserved_request_field"
        assert r.transport.calls == [] and r.admission.inflight == 1

    asyncio.run(run())


def test_a_full_cap_sheds_at_the_head_with_retry_after() -> None:
    async def run() -> None:
        r = rig(VllmNixlAdapter(), limit=1)
        r.admission.enter()
        response = await r.processor.on_headers(head())
        assert isinstance(response, LocalReply) and error_code(response) == "pd_overloaded"
        headers = dict(response.headers)
        assert headers["retry-after"] == b"1" and r.transport.calls == []

    asyncio.run(run())


def test_a_cancelled_sequential_request_releases_its_slot_and_is_counted_cancelled() -> None:
    async def run() -> None:
        r = rig(VllmNixlAdapter())
        sent, never = asyncio.Event(), asyncio.Event()

        async def hang() -> WorkerReply:
            sent.set()
            await never.wait()
            raise AssertionError("unreachable")

        r.transport.answers.append(hang)
        request_head, pending = await start(r, CHAT_BODY)
        task = asyncio.ensure_future(r.processor.on_body(request_head, pending, json.dumps(CHAT_BODY).encode()))
        await sent.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert r.admission.inflight == 0 and r.outcomes() == {"cancelled": 1.0}

    asyncio.run(run())


def test_an_upstream_error_is_the_clients_answer_and_decode_gets_nothing() -> None:
    async def run() -> None:
        r = rig(VllmNixlAdapter())
        r.transport.answers.append(PdError(Code.PREFILL_UPSTREAM_TIMEOUT))
        request_head, pending = await start(r, CHAT_BODY)
        outcome = await r.processor.on_body(request_head, pending, json.dumps(CHAT_BODY).encode())
        assert error_code(outcome.decision) == "prefill_upstream_timeout"
        assert r.transport.posts_to(DECODE) == [] and r.admission.inflight == 0

    asyncio.run(run())


@pytest.mark.parametrize("fallback", [True, False], ids=["fallback", "off"])
def test_a_prefill_name_that_does_not_resolve_falls_back_only_when_asked(fallback: bool) -> None:
    """The failure is known from the head; with fallback on, the body phase serves the client's own
    body whole (no prefill leg), otherwise the head is refused."""
    async def run() -> None:
        r = rig(VllmNixlAdapter(), fallback=fallback)
        r.transport.resolve_error = PdError(Code.PREFILL_UPSTREAM_UNAVAILABLE)
        pending = await r.processor.on_headers(head())
        if not fallback:
            assert isinstance(pending, LocalReply)
            assert error_code(pending) == "prefill_upstream_unavailable" and r.transport.calls == []
            return
        assert isinstance(pending, Pending)
        raw = json.dumps(CHAT_BODY).encode()
        outcome = await r.processor.on_body(head(), pending, raw)
        assert outcome.decision.body == raw
        assert r.transport.calls == [] and r.admission.inflight == 0 and r.outcomes() == {"prefill_fallback": 1.0}

    asyncio.run(run())


# --- the concurrent flow -------------------------------------------------------------------------


def sglang_prefill_ok() -> WorkerReply:
    return ok({"id": "x", "choices": [{"index": 0, "finish_reason": "length"}]})


async def start_held_prefill(r: Rig, answer: WorkerReply) -> tuple[asyncio.Event, BodyOutcome]:
    """A concurrent P/D request whose prefill worker answers ``answer`` once the returned event is set."""
    release = asyncio.Event()

    async def held() -> WorkerReply:
        await release.wait()
        return answer

    r.transport.answers.append(held)
    request_head, pending = await start(r, CHAT_BODY)
    outcome = await r.processor.on_body(request_head, pending, json.dumps(CHAT_BODY).encode())
    assert outcome.background is not None
    return release, outcome


def test_a_background_prefill_holds_its_slot_until_it_ends() -> None:
    async def run() -> None:
        r = rig(SglangAdapter())
        release, outcome = await start_held_prefill(r, sglang_prefill_ok())
        assert outcome.background is not None and len(r.background) == 1
        decode_body = json.loads(outcome.decision.body)
        assert decode_body["rid"] == "pd-0000000000001234" and decode_body["bootstrap_room"] == 1 + 0x1234
        assert r.admission.inflight == 1, "the slot is held while the prefill runs"
        assert inflight_gauge(r) == 1.0
        release.set()
        await outcome.background.task
        assert r.admission.inflight == 0 and len(r.background) == 0 and r.outcomes() == {"ok": 1.0}
        assert inflight_gauge(r) == 0.0
        (call,) = r.transport.calls
        assert call.bounds == Bounds(SglangAdapter().prefill_deadline, SglangAdapter().prefill_deadline)

    asyncio.run(run())


def test_a_background_prefill_cancelled_before_its_first_step_releases_its_slot() -> None:
    """The task never runs a line of its own: only the owner's done callback can release the slot."""
    async def run() -> None:
        r = rig(SglangAdapter())
        request_head, pending = await start(r, CHAT_BODY)
        outcome = await r.processor.on_body(request_head, pending, json.dumps(CHAT_BODY).encode())
        assert outcome.background is not None and r.admission.inflight == 1
        outcome.background.task.cancel()  # before the event loop ever stepped it
        with pytest.raises(asyncio.CancelledError):
            await outcome.background.task
        assert r.transport.calls == [], "the prefill request was never sent"
        assert r.admission.inflight == 0 and r.outcomes() == {"cancelled": 1.0}

    asyncio.run(run())


def test_a_failed_prefill_aborts_decode_until_it_answers_and_the_client_gets_our_error() -> None:
    async def run() -> None:
        r = rig(SglangAdapter())
        r.transport.answers.append(WorkerReply(503, "application/json", b""))
        request_head, pending = await start(r, CHAT_BODY)
        outcome = await r.processor.on_body(request_head, pending, json.dumps(CHAT_BODY).encode())
        handle = outcome.background
        assert handle is not None
        # The first abort is lost (decode does not have the request yet), the second ends it.
        r.transport.answers.append(WorkerReply(200, "text/plain", b""))

        async def second_abort() -> WorkerReply:
            asyncio.get_running_loop().call_soon(lambda: asyncio.ensure_future(
                r.processor.on_decode_answer(handle, 500)))
            return WorkerReply(200, "text/plain", b"")

        r.transport.answers.append(second_abort)
        await r.clock.waiting()  # the first abort is out; the processor waits for decode's answer
        assert len(r.transport.posts_to(DECODE)) == 1 and not handle.task.done()
        r.clock.advance(ABORT_RETRY_WAITS[0])
        await handle.task
        aborts = r.transport.posts_to(DECODE)
        assert [call.path for call in aborts] == ["/abort_request", "/abort_request"]
        assert {json.loads(call.body or b"")["rid"] for call in aborts} == {"pd-0000000000001234"}
        answer = await r.processor.on_decode_answer(handle, 500)
        assert error_code(answer) == "prefill_upstream_error"
        assert answer.status == 503
        assert r.admission.inflight == 0 and r.outcomes() == {"prefill_upstream_error": 1.0}

    asyncio.run(run())


def test_the_decode_abort_goes_through_the_decode_control_client_not_the_prefill_client() -> None:
    """Aborts have a client (and a connection pool) of their own: an abort never waits for a prefill
    connection slot, and the prefill client's retry counter never counts one."""
    async def run() -> None:
        control = FakeTransport()
        r = rig(SglangAdapter(), decode_control=control)
        r.transport.answers.append(WorkerReply(503, "application/json", b""))
        control.answers.append(WorkerReply(200, "text/plain", b""))
        handle = await start_background(r)
        await r.clock.waiting()  # the first abort is out; the processor waits for decode's answer
        assert [call.method + " " + call.path for call in r.transport.calls] == ["POST /v1/chat/completions"]
        assert [(call.target, call.path) for call in control.calls] == [(DECODE, "/abort_request")]
        await r.processor.on_decode_answer(handle, 500)
        await handle.task
        assert r.outcomes() == {"prefill_upstream_error": 1.0} and r.admission.inflight == 0

    asyncio.run(run())


def test_an_abort_decode_never_answers_is_sent_again_after_each_wait_then_given_up() -> None:
    """Each abort goes out exactly when the previous wait ran out (0, 0.25, 0.75, 1.75, 3.75, 7.75 s), and
    none after the last. Needs the fake clock: on real time these waits took 7.75 s and their moments
    could not be asserted."""
    async def run() -> None:
        r = rig(SglangAdapter())
        r.transport.answers.append(WorkerReply(503, "application/json", b""))
        sent_at: list[float] = []

        async def lost_abort() -> WorkerReply:
            sent_at.append(r.clock.now())
            return WorkerReply(200, "text/plain", b"")

        r.transport.answers.extend([lost_abort] * (len(ABORT_RETRY_WAITS) + 1))
        handle = await start_background(r)
        for wait in ABORT_RETRY_WAITS:
            await r.clock.waiting()
            r.clock.advance(wait)
        await handle.task
        assert sent_at == [0.0, 0.25, 0.75, 1.75, 3.75, 7.75]
        assert len(r.transport.posts_to(DECODE)) == len(sent_at) and r.clock.pending == 0
        assert r.admission.inflight == 0 and r.outcomes() == {"prefill_upstream_error": 1.0}

    asyncio.run(run())


def test_a_decode_error_waits_out_the_grace_for_the_prefill_then_ends_it() -> None:
    """Decode fails while our prefill request is still out: its outcome is awaited for DECODE_ERROR_GRACE,
    not a moment less; then the prefill request is cancelled and decode's answer goes to the client."""
    async def run() -> None:
        r = rig(SglangAdapter())
        _never_released, outcome = await start_held_prefill(r, sglang_prefill_ok())
        handle = outcome.background
        assert handle is not None
        answer = asyncio.ensure_future(r.processor.on_decode_answer(handle, 502))
        await r.clock.waiting()
        r.clock.advance(DECODE_ERROR_GRACE - 0.001)
        assert r.clock.pending == 1 and not answer.done(), "still within the grace: its timeout not due"
        r.clock.advance(0.001)
        assert (await answer) is None, "decode's own answer goes on"
        await settled(handle.task)
        assert handle.task.cancelled()
        assert r.outcomes() == {"ok": 1.0} and r.admission.inflight == 0
        assert r.transport.posts_to(DECODE) == [], "decode answered: nothing to abort"

    asyncio.run(run())


def test_a_prefill_failing_within_the_grace_is_the_clients_answer_not_decodes() -> None:
    async def run() -> None:
        r = rig(SglangAdapter())
        release, outcome = await start_held_prefill(r, WorkerReply(503, "application/json", b""))
        handle = outcome.background
        assert handle is not None
        answer = asyncio.ensure_future(r.processor.on_decode_answer(handle, 502))
        await r.clock.waiting()
        r.clock.advance(DECODE_ERROR_GRACE / 2)
        release.set()
        assert error_code(await answer) == "prefill_upstream_error"
        await handle.task
        assert r.transport.posts_to(DECODE) == [], "decode already answered: no abort"
        assert r.outcomes() == {"prefill_upstream_error": 1.0} and r.admission.inflight == 0

    asyncio.run(run())


def test_decode_answering_while_the_prefill_is_fine_is_decodes_answer() -> None:
    async def run() -> None:
        r = rig(SglangAdapter())
        r.transport.answers.append(sglang_prefill_ok())
        request_head, pending = await start(r, CHAT_BODY)
        outcome = await r.processor.on_body(request_head, pending, json.dumps(CHAT_BODY).encode())
        assert outcome.background is not None
        answer = await r.processor.on_decode_answer(outcome.background, 200)
        assert answer is None, "decode's answer goes on"
        await outcome.background.task
        assert r.transport.posts_to(DECODE) == []

    asyncio.run(run())


def background_failures(r: Rig) -> dict[str, float]:
    return {sample.labels["reason"]: sample.value for metric in r.metrics.registry.collect()
            if metric.name == "pd_extproc_background_prefill_failures" for sample in metric.samples
            if sample.name.endswith("_total")}


def test_a_prefill_failing_after_decodes_answer_went_out_counts_what_the_client_got() -> None:
    """Decode's 200 is already on its way to the client when the prefill fails: the request is counted
    under decode's answer, the failure only in the background failure counter, and nothing is aborted."""
    async def run() -> None:
        r = rig(SglangAdapter())
        release, outcome = await start_held_prefill(r, WorkerReply(503, "application/json", b""))
        assert outcome.background is not None
        answer = await r.processor.on_decode_answer(outcome.background, 200)
        assert answer is None, "decode's answer goes on"
        release.set()
        await outcome.background.task
        assert r.outcomes() == {"ok": 1.0}
        assert background_failures(r) == {"prefill_upstream_error": 1.0}
        assert r.transport.posts_to(DECODE) == [], "decode answered: nothing to abort"
        assert r.admission.inflight == 0

    asyncio.run(run())


def test_a_prefill_cancelled_by_a_drain_after_decodes_answer_counts_that_answer() -> None:
    """Found in review: a drain cancelling the prefill after decode's 200 had gone to the client was
    counted cancelled (499)."""
    async def run() -> None:
        r = rig(SglangAdapter())
        _never_released, outcome = await start_held_prefill(r, sglang_prefill_ok())
        assert outcome.background is not None
        await r.processor.on_decode_answer(outcome.background, 200)
        await r.background.drain(0)  # the drain's grace is over: the prefill is cancelled
        assert r.outcomes() == {"ok": 1.0} and r.admission.inflight == 0

    asyncio.run(run())


# --- upstream's classification table --------------------------------------------------------------


@pytest.mark.parametrize("exc,phase,code", [
    (http1.ConnectTimeout(), Phase.HEAD, Code.PREFILL_UPSTREAM_TIMEOUT),
    (http1.ReadTimeout(), Phase.HEAD, Code.PREFILL_UPSTREAM_TIMEOUT),
    (http1.ReadTimeout(), Phase.BODY, Code.PREFILL_UPSTREAM_TIMEOUT),
    (TimeoutError(), Phase.BODY, Code.PREFILL_UPSTREAM_TIMEOUT),
    (ConnectionRefusedError(), Phase.HEAD, Code.PREFILL_UPSTREAM_UNAVAILABLE),
    (ssl.SSLCertVerificationError(), Phase.HEAD, Code.PREFILL_UPSTREAM_UNAVAILABLE),
    (http1.ConnectionClosed(), Phase.HEAD, Code.PREFILL_UPSTREAM_UNAVAILABLE),
    (http1.ProtocolError(), Phase.HEAD, Code.PREFILL_UPSTREAM_UNAVAILABLE),
    (http1.ConnectionClosed(), Phase.BODY, Code.PREFILL_RESPONSE_TRUNCATED),
    (http1.ProtocolError(), Phase.BODY, Code.PREFILL_RESPONSE_TRUNCATED),
    (ConnectionResetError(), Phase.BODY, Code.PREFILL_RESPONSE_TRUNCATED),
], ids=lambda value: type(value).__name__ if isinstance(value, BaseException) else str(value))
def test_upstream_classifies_each_failure_once(exc: BaseException, phase: Phase, code: Code) -> None:
    assert classify(exc, phase) is code
