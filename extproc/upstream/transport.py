"""The seam under the processor: everything it asks of the network, as one small protocol.

``upstream.PrefillClient`` is the real one (extproc/upstream/http1.py); tests use an in-memory fake. A transport raises
only PdError (classified once, in the transport); any other exception is a bug.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from extproc.adapters.base import PrefillReply
from extproc.core.prefill_policy import IPAddress
from extproc.core.prefill_target import PrefillTarget
from extproc.observability.metrics import RequestRecord


@dataclass(frozen=True, slots=True)
class ResolvedTarget:
    """A worker address we checked: the name or address we were given, and the IP we connect to."""

    target: PrefillTarget
    ip: IPAddress
    tls: bool = True  # use the prefill TLS settings (when configured); False for the local decode worker

    @property
    def connect_authority(self) -> str:
        return f"[{self.ip}]:{self.target.port}" if self.ip.version == 6 else f"{self.ip}:{self.target.port}"


@dataclass(frozen=True, slots=True)
class Bounds:
    """Per-call overrides of the prefill limits (the concurrent flow's prefill waits longer)."""

    deadline: float
    read_timeout: float


class Transport(Protocol):
    async def resolve(self, target: PrefillTarget) -> ResolvedTarget:
        """The address to connect to, checked against the prefill policy; no connection is made."""
        ...

    async def post(self, target: ResolvedTarget, path: str, headers: Sequence[tuple[str, str]], body: bytes,
                   record: RequestRecord | None = None, bounds: Bounds | None = None) -> PrefillReply:
        """POST under the prefill limits (or ``bounds``); a non-200 reply comes back without its body."""
        ...

    async def get(self, target: ResolvedTarget, path: str, headers: Sequence[tuple[str, str]]) -> PrefillReply:
        """GET under the same bounds (e.g. SGLang's /server_info)."""
        ...

    async def aclose(self) -> None: ...
