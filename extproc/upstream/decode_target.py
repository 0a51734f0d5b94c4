"""The local decode worker's address as a transport target (for a concurrent engine's abort request and
the decode-queue watch). It is configured, never taken from a request, so the prefill policy does not
apply. A name is resolved off the event loop before the server starts, then again every ``ttl``
seconds (on the server's clock); a failed re-resolution keeps the last address (and says so once).
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import socket

from extproc.clock import Clock
from extproc.protocol.transport import ResolvedTarget, WorkerAddress
from extproc.protocol.units import Address

log = logging.getLogger("extproc.decode")
RESOLVE_TTL = 30.0


class Unresolvable(Exception):
    """The decode worker's name does not resolve (at start: a configuration error)."""


class DecodeTarget:
    def __init__(self, address: Address, clock: Clock, ttl: float = RESOLVE_TTL) -> None:
        self._address = address
        self._clock = clock
        self._ttl = ttl
        self._current: ResolvedTarget | None = None
        self._task: asyncio.Task[None] | None = None
        self._failing = False
        with contextlib.suppress(ValueError):
            ip = ipaddress.ip_address(address.host)
            self._current = ResolvedTarget(WorkerAddress(address.host, address.port, ip), ip, tls=False)
        self.is_name = self._current is None

    @property
    def current(self) -> ResolvedTarget:
        """The address in use; only a name that never resolved has none (``start`` refuses that)."""
        if self._current is None:
            raise Unresolvable(f"the decode worker's name {self._address.host} is not resolved yet")
        return self._current

    async def resolve(self) -> ResolvedTarget:
        """Resolve the name now, in the loop's resolver thread (getaddrinfo blocks)."""
        host, port = self._address.host, self._address.port
        try:
            infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
        except OSError as exc:
            raise Unresolvable(f"the decode worker's name {host} does not resolve: {exc}") from None
        ip = ipaddress.ip_address(str(infos[0][4][0]).split("%", 1)[0])
        self._current = ResolvedTarget(WorkerAddress(host, port, ip), ip, tls=False)
        return self._current

    async def start(self) -> None:
        """Resolve a name (raising Unresolvable if it does not) and keep it fresh; an IP needs neither."""
        if not self.is_name:
            return
        await self.resolve()
        self._task = asyncio.get_running_loop().create_task(self._refresh())

    async def _refresh(self) -> None:
        while True:
            await self._clock.sleep(self._ttl)
            try:
                before = self._current
                after = await self.resolve()
            except Unresolvable as exc:
                if not self._failing:
                    log.warning("decode worker name no longer resolves; keeping the last address",
                                extra={"reason": str(exc)})
                self._failing = True
                continue
            self._failing = False
            if before is not None and before.ip != after.ip:
                log.info("decode worker address changed", extra={"address": str(after.ip)})

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None


def resolved(decode: ResolvedTarget | DecodeTarget) -> ResolvedTarget:
    """A fixed target as is; a DecodeTarget's address in use now."""
    return decode.current if isinstance(decode, DecodeTarget) else decode
