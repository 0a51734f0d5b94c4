"""The in-flight cap on P/D requests: beyond it requests are shed, never queued. One owner: the server."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from extproc.errors import Code, PdError


@dataclass
class Admission:
    limit: int
    inflight: int = 0
    draining: bool = False
    idle: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def full(self) -> bool:
        return self.inflight >= self.limit

    def check(self) -> None:
        """Refuse now if a new request could not enter (the head-phase check, before Envoy buffers the body)."""
        if self.draining:
            raise PdError(Code.PD_SHUTTING_DOWN)
        if self.full:
            raise PdError(Code.PD_OVERLOADED)

    def enter(self) -> None:
        self.check()
        self.inflight += 1
        self.idle.clear()

    def leave(self) -> None:
        self.inflight -= 1
        if self.inflight == 0:
            self.idle.set()
