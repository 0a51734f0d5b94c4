"""A small engine that is not part of pd-extproc: the whole of what a new engine needs, in one
module (its Engine, adapter and emulator), written against the two plugin APIs only (``extproc.plugin``
for the adapter, ``pd_extproc_lab.plugin`` for the emulator), installed as a ``pd_extproc.engines``
entry point by tests/plugin_engine/test_plugin_engine.py; tests/plugin_engine/test_toy_adapter.py
drives its adapter in-process over ``extproc.plugin.FakeTransport``. Nothing in extproc/ names it.

The toy protocol: the prefill worker answers ``{"toy_handoff": <sha256 of the prompt>}``; the decode
worker generates only when the request carries that handoff, plus the engine's own setting
(``PD_EXTPROC_TOY_GREETING``) as ``toy_greeting``.
"""

from __future__ import annotations

import hashlib
import ssl
import time
from typing import Any, ClassVar

import orjson

from extproc.plugin import (
    ClientRequest,
    DecodeWith,
    Engine,
    Flow,
    Options,
    PlanInput,
    Problem,
    ReservedField,
    SequentialAdapter,
    SettingSpec,
    WorkerReply,
    handoff_error,
    jsonspan,
    non_empty_str,
    parse_prefill_object,
    set_members,
    text_value,
)
from pd_extproc_lab.plugin import Behaviour, Control, EmulatorHttpServer, Received, Reply, Request, Response, text

KEY = "toy_handoff"


def prompt_digest(body: dict[str, Any]) -> str:
    messages = body.get("messages")
    prompt = text.chat_prompt(messages) if messages is not None else text.completion_prompt(body.get("prompt"))
    return hashlib.sha256(prompt.encode()).hexdigest()


class ToyAdapter(SequentialAdapter):
    name: ClassVar[str] = "toy"
    reserved_fields: ClassVar[tuple[ReservedField, ...]] = (ReservedField(KEY),)

    def __init__(self, protocol: str, greeting: str) -> None:
        super().__init__(protocol)
        self._greeting = greeting

    def prefill_body(self, request: ClientRequest, plan: PlanInput) -> bytes:
        return set_members(request.raw, request.members, {"max_tokens": b"1", "stream": b"false"})

    def decide(self, request: ClientRequest, reply: WorkerReply) -> DecodeWith:
        parsed, spans = parse_prefill_object(reply)
        if not non_empty_str(parsed.get(KEY)):
            raise handoff_error(KEY, Problem.MISSING)
        handoff = jsonspan.member_value(reply.body, spans, KEY)
        assert handoff is not None
        return DecodeWith(set_members(request.raw, request.members,
                                      {KEY: handoff, "toy_greeting": orjson.dumps(self._greeting)}))


def build(protocol: str, options: Options) -> ToyAdapter:
    return ToyAdapter(protocol, str(options.get("toy_greeting", "")))


class ToyEmulator:
    side_port = 0

    def __init__(self, role: str, worker_id: str) -> None:
        self.role = role
        self.control = Control({"engine": "toy", "role": role, "worker_id": worker_id}, Behaviour)
        self.http = EmulatorHttpServer(self.handle, on_disconnect=self.control.disconnected)

    @staticmethod
    def add_arguments(group: Any) -> None:
        return None

    @classmethod
    def from_args(cls, args: Any) -> ToyEmulator:
        return cls(args.role, args.worker_id)

    async def start(self, host: str, port: int, side_port: int, tls: ssl.SSLContext | None = None) -> int:
        return await self.http.start(host, port, tls)

    async def close(self) -> None:
        await self.http.close()

    async def handle(self, request: Request) -> Reply:
        control = await self.control.handle(request)
        if control is not None:
            return control
        if request.path == "/health":
            return Response(200, b"")
        return await self.control.answer(request, self._generate)

    async def _generate(self, request: Request, received: Received) -> Reply:
        body = orjson.loads(request.body)
        if self.role == "prefill":
            return Response(200, orjson.dumps({"id": "toy", KEY: prompt_digest(body)}))
        if body.get(KEY) != prompt_digest(body):
            return Response(400, b'{"error": "no handoff for this prompt"}')
        received.notes["handoff"] = "ok"
        return Response(200, orjson.dumps({"id": "toy", "object": "chat.completion", "created": int(time.time()),
                                           "choices": [{"index": 0, "message": {
                                               "role": "assistant", "content": body.get("toy_greeting")},
                                               "finish_reason": "stop"}]}))


ENGINE = Engine(
    name=ToyAdapter.name, engine="toy", pins=("toy-1",), flow=Flow.SEQUENTIAL, build=build,
    emulator="toy_engine:ToyEmulator",
    settings=(SettingSpec("toy_greeting", text_value, "toy adapter: what decode says", default=""),),
    summary="a toy engine, registered by a test through an entry point",
)
