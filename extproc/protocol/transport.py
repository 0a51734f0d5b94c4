"""The seam under the processor: everything it asks of the network, as one small protocol.

``upstream.client.WorkerClient`` is the real one (app.py's prefill client, decode control client and
decode scraper); tests use ``FakeTransport``. A transport raises only PdError (classified once, in the
transport); any other exception is a bug.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from extproc.protocol.prefill_policy import IPAddress


@dataclass(frozen=True, slots=True)
class WorkerAddress:
    """A worker's address as given (the prefill target header, or the configured decode worker)."""

    host: str  # a DNS name, or the canonical text of an IP address (IPv6 without brackets)
    port: int
    ip: ipaddress.IPv4Address | ipaddress.IPv6Address | None  # None for a DNS name

    @property
    def authority(self) -> str:
        """The value for a Host header and for URLs."""
        return f"[{self.host}]:{self.port}" if isinstance(self.ip, ipaddress.IPv6Address) else \
            f"{self.host}:{self.port}"


@dataclass(frozen=True, slots=True)
class WorkerReply:
    status: int
    content_type: str | None
    body: bytes


@dataclass(slots=True)
class ExchangeTimings:
    """What the transport measured of one exchange, filled in as it goes (a failed one keeps what it got).
    The caller owns it; the request's metrics and log line read it when the request ends."""

    status: int | None = None
    connect_seconds: float | None = None  # only when a new connection was opened
    response_seconds: float | None = None  # until the response head
    total_seconds: float | None = None  # the whole exchange, body read included
    response_bytes: int | None = None


@dataclass(frozen=True, slots=True)
class ResolvedTarget:
    """A worker address we checked: the name or address we were given, and the IP we connect to."""

    target: WorkerAddress
    ip: IPAddress
    tls: bool  # use the prefill TLS settings (when configured); False for the local decode worker


@dataclass(frozen=True, slots=True)
class Bounds:
    """Per-call overrides of the prefill limits (the concurrent flow's prefill waits longer)."""

    deadline: float
    read_timeout: float


class Transport(Protocol):
    async def resolve(self, target: WorkerAddress) -> ResolvedTarget:
        """The address to connect to, checked against the prefill policy; no connection is made."""
        ...

    async def post(self, target: ResolvedTarget, path: str, headers: Sequence[tuple[str, str]], body: bytes,
                   timings: ExchangeTimings | None = None, bounds: Bounds | None = None) -> WorkerReply:
        """POST under the prefill limits (or ``bounds``); a non-200 reply comes back without its body."""
        ...

    async def get(self, target: ResolvedTarget, path: str, headers: Sequence[tuple[str, str]]) -> WorkerReply:
        """GET under the same bounds (e.g. SGLang's /server_info)."""
        ...

    async def aclose(self) -> None: ...
