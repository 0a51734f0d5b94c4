"""The toy engine's adapter in-process, the way an engine author tests one before running it end to
end: our processor over ``extproc.plugin.FakeTransport`` (no sockets), the prefill worker's answer
scripted, what each leg received read back; ``extproc.plugin.FakeClock`` moves time where a test needs it."""

from __future__ import annotations

import asyncio
import json
from typing import ClassVar

from extproc.plugin import ClientRequest, FakeClock, FakeTransport, PlanInput, WorkerReply
from extproc.upstream.discovery import SERVER_INFO_TTL
from tests.plugin_engine.toy_engine import KEY, ToyAdapter
from tests.unit.test_processor import error_code, rig, start

BODY = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5}


def test_the_toy_prefill_leg_gets_one_token_and_decode_gets_its_handoff() -> None:
    async def run() -> None:
        r = rig(ToyAdapter("toy-1", greeting="hello"))
        assert isinstance(r.transport, FakeTransport)
        r.transport.answers.append(WorkerReply(200, "application/json", json.dumps({KEY: "abc"}).encode()))
        request_head, pending = await start(r, BODY)
        outcome = await r.processor.on_body(request_head, pending, json.dumps(BODY).encode())
        (prefill,) = r.transport.calls
        assert json.loads(prefill.body or b"") == {**BODY, "max_tokens": 1, "stream": False}
        decode = json.loads(outcome.decision.body)
        assert decode == {**BODY, KEY: "abc", "toy_greeting": "hello"}

    asyncio.run(run())


def test_a_toy_prefill_answer_without_a_handoff_never_reaches_decode() -> None:
    async def run() -> None:
        r = rig(ToyAdapter("toy-1", greeting="hello"))
        r.transport.answers.append(WorkerReply(200, "application/json", b'{"id": "toy"}'))
        request_head, pending = await start(r, BODY)
        outcome = await r.processor.on_body(request_head, pending, json.dumps(BODY).encode())
        assert error_code(outcome.decision) == "invalid_prefill_handoff"
        assert [call.method for call in r.transport.calls] == ["POST"], "the prefill leg only"

    asyncio.run(run())


class DiscoveringToy(ToyAdapter):
    """The toy, reading its prefill worker's self-description (as SGLang reads /server_info)."""

    server_info_path: ClassVar[str | None] = "/toy_info"
    server_info_keys: ClassVar[tuple[str, ...]] = ("toy_version",)
    seen: list[object]

    def prefill_body(self, request: ClientRequest, plan: PlanInput) -> bytes:
        self.seen.append(None if plan.server_info is None else plan.server_info.get("toy_version"))
        return super().prefill_body(request, plan)


def test_a_worker_description_is_reused_for_its_ttl_and_fetched_again_after() -> None:
    """On the fake clock: the cached description serves up to the last instant of its TTL, and the next
    request after it fetches again (on real time this needed a 60 s wait or a patched ``time``)."""
    async def run() -> None:
        adapter = DiscoveringToy("toy-1", greeting="hello")
        adapter.seen = []
        r = rig(adapter)
        assert isinstance(r.clock, FakeClock)
        handoff = WorkerReply(200, "application/json", json.dumps({KEY: "abc"}).encode())

        async def one_request(*answers: WorkerReply) -> None:
            r.transport.answers.extend(answers)
            request_head, pending = await start(r, BODY)
            await r.processor.on_body(request_head, pending, json.dumps(BODY).encode())

        info = WorkerReply(200, "application/json", b'{"toy_version": 1, "api_key": "secret"}')
        await one_request(info, handoff)
        r.clock.advance(SERVER_INFO_TTL - 0.001)
        await one_request(handoff)
        r.clock.advance(0.001)
        await one_request(WorkerReply(200, "application/json", b'{"toy_version": 2}'), handoff)
        assert [call.method + " " + call.path for call in r.transport.calls] == [
            "GET /toy_info", "POST /v1/chat/completions", "POST /v1/chat/completions",
            "GET /toy_info", "POST /v1/chat/completions"]
        assert adapter.seen == [1, 1, 2]

    asyncio.run(run())
