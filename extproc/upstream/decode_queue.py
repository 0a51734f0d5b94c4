"""How many requests wait on the local decode worker, read at an interval (never per request).

The engine names the Prometheus gauges that count its waiting requests (``Engine.decode_queue``);
this module polls the decode worker's metrics page every ``interval`` seconds, sums those gauges, and
answers ``over_limit()`` from the last reading. A scrape that fails (or takes longer than the
interval) gives no reading, and the last one stands until it is three intervals old: one failed
scrape does not stop the limit at once (a scrape that times out uses two of those intervals, so the one
after it runs while the reading ages out). Past that the queue is "unknown", and unknown never
refuses a request: the cap protects the KV lease, it must not turn a metrics outage into an outage
of P/D.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Sequence
from typing import Protocol

from extproc.clock import Clock
from extproc.protocol.errors import PdError
from extproc.protocol.prom_text import gauge_values
from extproc.protocol.transport import ResolvedTarget, Transport
from extproc.upstream.decode_target import DecodeTarget, resolved

log = logging.getLogger("extproc.decode_queue")
STALE_AFTER_INTERVALS = 3


def fresh(waiting: float | None, read_at: float, now: float, interval: float) -> float | None:
    """``waiting`` while it is at most three intervals old, else None: an older reading refuses nothing."""
    return None if now - read_at > STALE_AFTER_INTERVALS * interval else waiting


def over(waiting: float | None, limit: int) -> bool:
    """The limit's decision on a reading (None: no fresh reading, nothing refused)."""
    return waiting is not None and waiting > limit


def waiting_from(page: bytes, names: Sequence[str]) -> float | None:
    """The sum of every sample of the named metrics (all label sets), None if none of them is there."""
    values = list(gauge_values(page, names))
    return sum(values) if values else None


class QueueGauges(Protocol):
    """Where the engine reports its waiting requests (``Engine.decode_queue``, given by app.py): a
    Prometheus text page and the gauges to sum."""

    @property
    def path(self) -> str: ...

    @property
    def names(self) -> tuple[str, ...]: ...


class QueueLimit(Protocol):
    """What the processor asks: the watch itself, or (a worker of several) the reading it shares."""

    def over_limit(self) -> bool: ...


class DecodeQueueWatch:
    """Owns the last reading and the decode scraper it reads with (closed by ``stop``). ``waiting`` is what
    the limit and the gauge both see; ``on_failure`` counts each scrape that gave no reading; a
    failure is logged when readings stop, not every time."""

    def __init__(self, scraper: Transport, decode: ResolvedTarget | DecodeTarget, gauges: QueueGauges, limit: int,
                 interval: float, clock: Clock, on_failure: Callable[[str], None] = lambda _: None,
                 on_reading: Callable[[float, float], None] | None = None) -> None:
        self._scraper = scraper
        self._decode = decode
        self._gauges = gauges
        self._limit = limit
        self._interval = interval
        self._on_failure = on_failure
        self._clock = clock
        self._on_reading = on_reading  # (waiting, when): each reading, for the other worker processes
        self._waiting: float | None = None
        self._read_at = float("-inf")
        self._failing = False
        self._task: asyncio.Task[None] | None = None

    @property
    def waiting(self) -> float | None:
        """The last reading, or None when there is none fresh enough to act on."""
        return fresh(self._waiting, self._read_at, self._clock.now(), self._interval)

    def over_limit(self) -> bool:
        return over(self.waiting, self._limit)

    async def read_once(self) -> None:
        """One scrape, bounded by the interval (a slow page must not hold the last reading past it)."""
        try:
            async with self._clock.timeout(self._interval):
                reply = await self._scraper.get(resolved(self._decode), self._gauges.path, ())
        except TimeoutError:
            self._failed("timeout")
            return
        except PdError as error:
            self._failed(error.code.value)
            return
        if reply.status != 200:
            self._failed(f"status_{reply.status}")
            return
        waiting = waiting_from(reply.body, self._gauges.names)
        if waiting is None:
            self._failed("no_gauge")
            return
        if self._failing:
            log.info("decode queue readings resumed", extra={"waiting": waiting})
        self._waiting, self._read_at, self._failing = waiting, self._clock.now(), False
        if self._on_reading is not None:
            self._on_reading(waiting, self._read_at)

    def _failed(self, reason: str) -> None:
        """No reading: the last one ages out by itself (three intervals after it was taken)."""
        self._on_failure(reason)
        if not self._failing:
            log.warning("decode queue scrape gave no reading; the limit refuses nothing without one",
                        extra={"reason": reason, "path": self._gauges.path})
        self._failing = True

    async def _run(self) -> None:
        while True:
            try:
                await self.read_once()
            except Exception:  # a bug here must not end the readings (stale readings refuse nothing)
                log.exception("bug in the decode queue reader")
                self._failed("internal_error")
            await self._clock.sleep(self._interval)

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        await self._scraper.aclose()
