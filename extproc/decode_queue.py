"""How many requests wait on the local decode worker, read at an interval (never per request).

The engine names the Prometheus gauges that count its waiting requests (``Engine.decode_queue``);
this module polls the decode worker's metrics page every ``interval`` seconds, sums those gauges, and
answers ``over_limit()`` from the last reading. A reading older than three intervals, or a failed
scrape, is "unknown", and unknown never refuses a request: the cap protects the KV lease, it must not
turn a metrics outage into an outage of P/D.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Sequence

from extproc.adapters.base import QueueGauges
from extproc.errors import PdError
from extproc.transport import ResolvedTarget, Transport

log = logging.getLogger("extproc.decode_queue")
STALE_AFTER_INTERVALS = 3


def waiting_from(text: str, names: Sequence[str]) -> float | None:
    """The sum of every sample of the named metrics (all label sets), None if none of them is there."""
    wanted = frozenset(names)
    total, found = 0.0, False
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in wanted:
            try:
                total += float(line.rsplit(" ", 1)[1])
            except (IndexError, ValueError):
                continue
            found = True
    return total if found else None


class DecodeQueueWatch:
    def __init__(self, transport: Transport, decode: ResolvedTarget, gauges: QueueGauges, limit: int,
                 interval: float, on_reading: Callable[[float | None], None] = lambda _: None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._transport = transport
        self._decode = decode
        self._gauges = gauges
        self._limit = limit
        self._interval = interval
        self._on_reading = on_reading
        self._clock = clock
        self._waiting: float | None = None
        self._read_at = float("-inf")
        self._task: asyncio.Task[None] | None = None

    @property
    def waiting(self) -> float | None:
        """The last reading, or None when there is none fresh enough to act on."""
        if self._clock() - self._read_at > STALE_AFTER_INTERVALS * self._interval:
            return None
        return self._waiting

    def over_limit(self) -> bool:
        waiting = self.waiting
        return waiting is not None and waiting > self._limit

    async def read_once(self) -> None:
        try:
            reply = await self._transport.get(self._decode, self._gauges.path, ())
        except PdError as error:
            log.warning("decode queue scrape failed", extra={"code": error.code.value})
            self._record(None)
            return
        waiting = waiting_from(reply.body.decode("utf-8", "replace"), self._gauges.names) \
            if reply.status == 200 else None
        if waiting is None:
            log.warning("decode queue scrape gave no reading", extra={"status": reply.status})
        self._record(waiting)

    def _record(self, waiting: float | None) -> None:
        self._waiting = waiting
        self._read_at = self._clock() if waiting is not None else float("-inf")
        self._on_reading(waiting)

    async def _run(self) -> None:
        while True:
            await self.read_once()
            await asyncio.sleep(self._interval)

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
