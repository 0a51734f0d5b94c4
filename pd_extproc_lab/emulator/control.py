"""What every emulated worker shares: a record of each request it received, scripted behaviours,
and the /_emulator/* control endpoints tests use to read them.

Control endpoints (never recorded):
  GET  /_emulator/info                     engine, role, worker id, side channel
  GET  /_emulator/requests                 every recorded request (body parsed when it is small JSON)
  GET  /_emulator/requests/{seq}/body      one request's raw body
  GET  /_emulator/wait?outcome=O&count=N&timeout=S   block until N requests have outcome O (or 408)
  POST /_emulator/script                   {"behaviours": [...]}: one behaviour per next request, FIFO;
                                           400 naming the key when one is not the emulator's (behaviour.py)
  POST /_emulator/gauges                   {"name": value, ...}: what the engine's queue gauges report
  POST /_emulator/release                  answer every request a ``hold`` behaviour holds now: {"released": N}
  POST /_emulator/reset                    forget requests, script and gauges (counters stay cumulative); release
                                           every held request
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Generic

import orjson

from extproc.observability.httpserver import Request, Response
from pd_extproc_lab.emulator.behaviour import B, BehaviourError
from pd_extproc_lab.emulator.http import Reply, StreamResponse

_INLINE_JSON_LIMIT = 2 << 20


@dataclass(slots=True)
class Received:
    seq: int
    request: Request
    at: float = field(default_factory=time.time)
    outcome: str = "pending"  # pending | answered | disconnected
    status: int | None = None
    notes: dict[str, Any] = field(default_factory=dict)

    def summary(self) -> dict[str, Any]:
        body = self.request.body
        parsed: Any = None
        if len(body) <= _INLINE_JSON_LIMIT:
            with contextlib.suppress(orjson.JSONDecodeError):
                parsed = orjson.loads(body)
        return {
            "seq": self.seq,
            "method": self.request.method,
            "target": self.request.target,
            "headers": self.request.headers,
            "peer": self.request.peer,
            "body_len": len(body),
            "body_sha256": hashlib.sha256(body).hexdigest(),
            "json": parsed,
            "outcome": self.outcome,
            "status": self.status,
            "notes": self.notes,
        }


class Control(Generic[B]):
    def __init__(self, info: dict[str, Any], behaviour: type[B]) -> None:
        self.info = info
        self.behaviour = behaviour
        self.records: list[Received] = []
        self.script: deque[B] = deque()
        self.gauges: dict[str, float] = {}  # set by tests: the engine's own waiting-queue gauges
        self._changed = asyncio.Condition()
        self._seq = 0
        self._release = asyncio.Event()  # set (then replaced) by each release: what held requests wait for
        self._holding = 0

    def record(self, request: Request) -> Received:
        self._seq += 1
        received = Received(self._seq, request)
        self.records.append(received)
        self._notify()
        return received

    def finish(self, received: Received, outcome: str, status: int | None = None) -> None:
        received.outcome = outcome
        received.status = status
        self._notify()

    def disconnected(self, request: Request) -> None:
        for received in reversed(self.records):
            if received.request is request:
                self.finish(received, "disconnected", received.status)
                return

    def gauge(self, name: str) -> float:
        return float(self.gauges.get(name, 0.0))

    async def answer(self, request: Request, generate: Callable[[Request, Received], Awaitable[Reply]]) -> Reply:
        """Record ``request``, let ``generate`` answer it, and note the status of an ordinary answer (a
        raw one, written by the handler itself, notes its own outcome)."""
        received = self.record(request)
        reply = await generate(request, received)
        if isinstance(reply, Response | StreamResponse):
            self.finish(received, "answered", reply.status)
        return reply

    def next_behaviour(self, received: Received | None = None) -> B:
        """The next scripted behaviour (the default one when none is queued), noted on ``received``."""
        behaviour = self.script.popleft() if self.script else self.behaviour()
        if received is not None:
            received.notes["behaviour"] = behaviour.given()
        return behaviour

    async def held(self) -> None:
        """Wait for the next release (a ``hold`` behaviour): a test decides when the request goes on."""
        release = self._release
        self._holding += 1
        try:
            await release.wait()
        finally:
            self._holding -= 1

    def release(self) -> int:
        """Let every held request go on; how many there were."""
        released = self._holding
        self._release.set()
        self._release = asyncio.Event()
        return released

    def _notify(self) -> None:
        async def notify() -> None:
            async with self._changed:
                self._changed.notify_all()

        with contextlib.suppress(RuntimeError):
            asyncio.get_running_loop().create_task(notify())

    async def wait_for(self, predicate: Callable[[], bool], within: float) -> bool:
        async with self._changed:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(within):
                    await self._changed.wait_for(predicate)
        return predicate()

    async def handle(self, request: Request) -> Response | None:
        """Answer a control request, or None if ``request`` is not one."""
        if not request.path.startswith("/_emulator/"):
            return None
        path = request.path[len("/_emulator/"):]
        query = dict(
            part.split("=", 1) for part in request.target.partition("?")[2].split("&") if "=" in part
        )
        if path == "info":
            return Response(200, orjson.dumps(self.info))
        if path == "requests":
            return Response(200, orjson.dumps([r.summary() for r in self.records]))
        if path.startswith("requests/") and path.endswith("/body"):
            seq = int(path.split("/")[1])
            for received in self.records:
                if received.seq == seq:
                    return Response(200, received.request.body, content_type="application/octet-stream")
            return Response(404, b"{}")
        if path == "reset" and request.method == "POST":
            self.records.clear()
            self.script.clear()
            self.gauges.clear()
            self.release()
            return Response(200, b"{}")
        if path == "release" and request.method == "POST":
            return Response(200, orjson.dumps({"released": self.release()}))
        if path == "gauges" and request.method == "POST":
            values = orjson.loads(request.body)
            if not isinstance(values, dict) or not all(isinstance(v, int | float) for v in values.values()):
                return Response(400, b'{"error": "gauges: an object of numbers"}')
            self.gauges.update(values)
            return Response(200, b"{}")
        if path == "script" and request.method == "POST":
            try:
                parsed = [self.behaviour.parse(entry) for entry in orjson.loads(request.body)["behaviours"]]
            except (BehaviourError, orjson.JSONDecodeError, KeyError, TypeError) as exc:
                return Response(400, orjson.dumps({"error": str(exc)}))
            self.script.extend(parsed)
            return Response(200, b"{}")
        if path == "wait":
            outcome = query.get("outcome", "answered")
            count = int(query.get("count", "1"))
            ok = await self.wait_for(
                lambda: sum(r.outcome == outcome for r in self.records) >= count,
                float(query.get("timeout", "10")),
            )
            return Response(200 if ok else 408, orjson.dumps({"ok": ok}))
        return Response(404, b"{}")
