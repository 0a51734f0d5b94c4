"""A transport for tests: no sockets, each call answered from a script and recorded.

The processor takes its transport as an argument (protocol.transport.Transport), so a test hands it
this one, scripts what the workers answer, and reads back what each leg was sent (as httpx's
MockTransport does for an httpx client). Exported to engine authors by extproc.plugin.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field

from extproc.protocol.errors import PdError
from extproc.protocol.transport import Bounds, ExchangeTimings, ResolvedTarget, WorkerAddress, WorkerReply

# A scripted answer: a reply, an error to raise, or a coroutine function to await (one that waits on an
# event the test sets, say, or raises something else).
ScriptedAnswer = WorkerReply | PdError | Callable[[], Awaitable[WorkerReply]]


@dataclass
class RecordedCall:
    method: str
    target: ResolvedTarget
    path: str
    headers: list[tuple[str, str]]
    body: bytes | None
    bounds: Bounds | None = None


@dataclass
class FakeTransport:
    """Answers each POST or GET with the next scripted answer (``answers``, first in first out) and
    records every call (``calls``). ``resolve`` accepts any IP-literal target, without TLS, unless
    ``resolve_error`` is set (e.g. a name that did not resolve)."""

    answers: deque[ScriptedAnswer] = field(default_factory=deque)
    calls: list[RecordedCall] = field(default_factory=list)
    resolve_error: PdError | None = None

    async def resolve(self, target: WorkerAddress) -> ResolvedTarget:
        if self.resolve_error is not None:
            raise self.resolve_error
        assert target.ip is not None, "FakeTransport resolves IP-literal targets only"
        return ResolvedTarget(target, target.ip, tls=False)

    async def post(self, target: ResolvedTarget, path: str, headers: Sequence[tuple[str, str]], body: bytes,
                   timings: ExchangeTimings | None = None, bounds: Bounds | None = None) -> WorkerReply:
        self.calls.append(RecordedCall("POST", target, path, list(headers), body, bounds))
        return await self._answer()

    async def get(self, target: ResolvedTarget, path: str, headers: Sequence[tuple[str, str]]) -> WorkerReply:
        self.calls.append(RecordedCall("GET", target, path, list(headers), None))
        return await self._answer()

    async def _answer(self) -> WorkerReply:
        answer = self.answers.popleft()
        if isinstance(answer, PdError):
            raise answer
        if isinstance(answer, WorkerReply):
            return answer
        return await answer()

    async def aclose(self) -> None:
        return None

    def posts_to(self, target: ResolvedTarget) -> list[RecordedCall]:
        return [call for call in self.calls if call.method == "POST" and call.target == target]
