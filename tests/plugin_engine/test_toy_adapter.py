"""The toy engine's adapter in-process, the way an engine author tests one before running it end to
end: our processor over ``extproc.plugin.FakeTransport`` (no sockets), the prefill worker's answer
scripted, what each leg received read back."""

from __future__ import annotations

import asyncio
import json

from extproc.plugin import FakeTransport, WorkerReply
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
