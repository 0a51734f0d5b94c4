"""Time, as one object passed in: what reads the time or waits on it asks a ``Clock``.

``MonotonicClock`` is the real one (app.py builds it once). ``FakeClock`` is a test's: its time moves
only when the test calls ``advance``, so expiry, TTLs and deadlines are tested without waiting and
without patching ``time``. Exported to engine authors by extproc.plugin.

Connection-level I/O bounds (connect, read gaps, a prefill's total deadline) stay on the event loop's
own clock: they bound real sockets, which a fake time cannot move.
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import itertools
import time
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager
from typing import Protocol


class Clock(Protocol):
    def now(self) -> float:
        """Monotonic seconds: only differences mean anything."""
        ...

    async def sleep(self, seconds: float) -> None: ...

    def timeout(self, seconds: float) -> AbstractAsyncContextManager[object]:
        """An ``async with`` block that raises TimeoutError once ``seconds`` have passed inside it."""
        ...


class MonotonicClock:
    """The real clock: time.monotonic, asyncio.sleep and asyncio.timeout."""

    now = staticmethod(time.monotonic)

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(seconds)

    def timeout(self, seconds: float) -> AbstractAsyncContextManager[object]:
        return asyncio.timeout(seconds)


class FakeClock:
    """Time that moves only when the test says so. ``now`` reads it; ``sleep`` and ``timeout`` wait on
    it; ``advance`` moves it, waking every sleep and expiring every timeout that falls due. ``waiting``
    lets a test advance only once the code under test has started to wait."""

    def __init__(self, start: float = 0.0) -> None:
        self._now = start
        self._timers: list[tuple[float, int, Callable[[], None]]] = []
        self._order = itertools.count()
        self._changed = asyncio.Event()

    def now(self) -> float:
        return self._now

    @property
    def pending(self) -> int:
        """Sleeps and timeouts waiting on this clock now."""
        return len(self._timers)

    async def waiting(self, count: int = 1) -> None:
        """Return once at least ``count`` sleeps or timeouts wait on this clock."""
        while len(self._timers) < count:
            self._changed.clear()
            await self._changed.wait()

    def advance(self, seconds: float) -> None:
        """Move time forward; what falls due wakes (in due order) when the event loop next runs."""
        if seconds < 0:
            raise ValueError("time does not go back")
        self._now += seconds
        self._fire_due()

    async def sleep(self, seconds: float) -> None:
        if seconds <= 0:
            await asyncio.sleep(0)
            return
        woken = asyncio.get_running_loop().create_future()
        entry = self._add(self._now + seconds, lambda: _wake(woken))
        try:
            await woken
        finally:
            self._remove(entry)

    def timeout(self, seconds: float) -> AbstractAsyncContextManager[object]:
        return self._timeout(seconds)

    @contextlib.asynccontextmanager
    async def _timeout(self, seconds: float) -> AsyncIterator[None]:
        # A real asyncio.timeout that never fires by itself: this clock reschedules it to "now" when due.
        async with asyncio.timeout(None) as real:
            loop = asyncio.get_running_loop()
            entry = self._add(self._now + seconds, lambda: real.reschedule(loop.time()))
            self._fire_due()
            try:
                yield
            finally:
                self._remove(entry)

    def _add(self, when: float, fire: Callable[[], None]) -> tuple[float, int, Callable[[], None]]:
        entry = (when, next(self._order), fire)
        heapq.heappush(self._timers, entry)
        self._changed.set()
        return entry

    def _remove(self, entry: tuple[float, int, Callable[[], None]]) -> None:
        if entry in self._timers:
            self._timers.remove(entry)
            heapq.heapify(self._timers)

    def _fire_due(self) -> None:
        while self._timers and self._timers[0][0] <= self._now:
            _, _, fire = heapq.heappop(self._timers)
            fire()


def _wake(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_result(None)
