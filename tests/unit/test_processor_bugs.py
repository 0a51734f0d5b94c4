"""A bug (an exception that is not PdError) at each phase of a request ends it the way a PdError does:
a logged JSON 500 ``internal_error`` for the client, the slot released, the request counted and its span
closed; in a background (SGLang) prefill, also decode aborted and the failure counted. Found in review: a
bug in the background prefill left decode waiting for SGLang's 300 s timeout, and one in the headers
phase reached Envoy as a gRPC error with no log line and an open span."""

from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import dataclass, field
from typing import Any

import pytest

from extproc.adapters.sglang import SglangAdapter
from extproc.adapters.vllm_nixl import VllmNixlAdapter
from extproc.pipeline.processor import ABORT_RETRY_WAITS, Pending
from extproc.protocol.transport import WorkerReply
from tests.unit.test_processor import (
    CHAT_BODY,
    DECODE,
    HANDOFF,
    Rig,
    background_failures,
    decode_answers_once_aborted,
    error_code,
    head,
    ok,
    rig,
    start_background,
)


@dataclass
class FakeTrace:
    prefill_open: bool = False
    finished: list[tuple[str, int]] = field(default_factory=list)

    def start_prefill(self, headers: list[tuple[str, str]]) -> list[tuple[str, str]]:
        self.prefill_open = True
        return headers

    def end_prefill(self, status: int | None) -> None:
        self.prefill_open = False

    def finish(self, adapter: str, outcome: str, status: int, api: str = "other") -> None:
        self.finished.append((outcome, status))


@dataclass
class FakeTracing:
    traces: list[FakeTrace] = field(default_factory=list)

    def begin(self, headers: Any) -> FakeTrace:
        self.traces.append(FakeTrace())
        return self.traces[-1]


class Bug(Exception):
    pass


async def bug() -> WorkerReply:
    raise Bug("a bug in the I/O shell")


def traced(adapter: Any) -> tuple[Rig, FakeTracing]:
    tracing = FakeTracing()
    return rig(adapter, tracing=tracing), tracing


def assert_span_closed(tracing: FakeTracing) -> None:
    (trace,) = tracing.traces
    assert trace.finished == [("internal_error", 500)] and not trace.prefill_open


def assert_logged(caplog: pytest.LogCaptureFixture) -> None:
    assert [r.message for r in caplog.records if r.name == "extproc.request"].count("bug in the P/D processor") == 1


def test_a_bug_in_the_headers_phase_is_a_logged_json_500(caplog: pytest.LogCaptureFixture) -> None:
    async def run() -> None:
        r, tracing = traced(VllmNixlAdapter())
        r.transport.resolve_error = Bug("a bug in resolve")  # type: ignore[assignment]
        with caplog.at_level(logging.ERROR, "extproc.request"):
            response = await r.processor.on_headers(head())
        assert not isinstance(response, Pending)
        assert error_code(response) == "internal_error" and response.status == 500
        assert r.transport.calls == [] and r.admission.inflight == 0 and r.outcomes() == {"internal_error": 1.0}
        assert_span_closed(tracing)
        assert_logged(caplog)

    asyncio.run(run())


class BuggyDecide(VllmNixlAdapter):
    def decide(self, request: Any, reply: WorkerReply) -> Any:
        raise KeyError("a bug in an adapter")


def test_a_bug_in_the_body_phase_is_a_logged_json_500_and_decode_gets_nothing(
        caplog: pytest.LogCaptureFixture) -> None:
    async def run() -> None:
        r, tracing = traced(BuggyDecide())
        r.transport.answers.append(ok({"id": "x", "kv_transfer_params": HANDOFF}))
        request_head = head()
        pending = await r.processor.on_headers(request_head)
        assert isinstance(pending, Pending)
        with caplog.at_level(logging.ERROR, "extproc.request"):
            outcome = await r.processor.on_body(request_head, pending, json.dumps(CHAT_BODY).encode())
        assert error_code(outcome.decision) == "internal_error" and outcome.background is None
        assert r.transport.posts_to(DECODE) == [] and r.admission.inflight == 0
        assert r.outcomes() == {"internal_error": 1.0}
        assert_span_closed(tracing)
        assert_logged(caplog)

    asyncio.run(run())


class BuggyCheck(SglangAdapter):
    def check_prefill(self, reply: WorkerReply) -> None:
        raise ValueError("a bug in an adapter")


@pytest.mark.parametrize("phase", ["prefill-call", "prefill-check"])
def test_a_bug_in_the_background_prefill_aborts_decode_and_is_the_clients_answer(
        phase: str, caplog: pytest.LogCaptureFixture) -> None:
    async def run() -> None:
        adapter = SglangAdapter() if phase == "prefill-call" else BuggyCheck()
        r, tracing = traced(adapter)
        r.transport.answers.append(bug if phase == "prefill-call"
                                   else ok({"id": "x", "choices": [{"index": 0, "finish_reason": "length"}]}))
        handle = await start_background(r)
        abort_ends_decode = decode_answers_once_aborted(r, handle)

        r.transport.answers.append(abort_ends_decode)
        with caplog.at_level(logging.ERROR, "extproc.request"):
            await handle.task
        aborts = r.transport.posts_to(DECODE)
        assert [call.path for call in aborts] == ["/abort_request"]
        assert json.loads(aborts[0].body or b"")["rid"] == "pd-0000000000001234"
        answer = await r.processor.on_decode_answer(handle, 500)
        assert error_code(answer) == "internal_error" and answer.status == 500
        assert background_failures(r) == {"internal_error": 1.0}
        assert r.outcomes() == {"internal_error": 1.0} and r.admission.inflight == 0
        assert_span_closed(tracing)
        assert_logged(caplog)

    asyncio.run(run())


def test_a_bug_while_aborting_decode_does_not_stop_the_next_abort(caplog: pytest.LogCaptureFixture) -> None:
    async def run() -> None:
        r, tracing = traced(SglangAdapter())
        r.transport.answers.append(WorkerReply(503, "application/json", b""))
        handle = await start_background(r)
        abort_ends_decode = decode_answers_once_aborted(r, handle)

        r.transport.answers.extend([bug, abort_ends_decode])
        with caplog.at_level(logging.ERROR, "extproc.request"):
            await r.clock.waiting()  # the first abort failed; the next one waits its turn
            r.clock.advance(ABORT_RETRY_WAITS[0])
            await handle.task
        assert [call.path for call in r.transport.posts_to(DECODE)] == ["/abort_request", "/abort_request"]
        assert error_code(await r.processor.on_decode_answer(handle, 500)) == "prefill_upstream_error"
        assert background_failures(r) == {"prefill_upstream_error": 1.0} and r.admission.inflight == 0
        assert tracing.traces[0].finished == [("prefill_upstream_error", 503)]
        assert_logged(caplog)

    asyncio.run(run())
