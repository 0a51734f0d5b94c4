"""The in-flight cap on P/D requests: beyond it requests are shed, never queued. One owner: the server."""

from __future__ import annotations

from dataclasses import dataclass

from extproc.protocol.errors import Code, PdError


@dataclass
class Admission:
    limit: int
    inflight: int = 0
    draining: bool = False

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

    def leave(self) -> None:
        self.inflight -= 1
