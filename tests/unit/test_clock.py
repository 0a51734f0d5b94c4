"""extproc.clock.FakeClock: time that moves only when the test says, and what wakes when it does."""

from __future__ import annotations

import asyncio

import pytest

from extproc.clock import FakeClock, MonotonicClock


def test_a_sleep_wakes_when_its_time_is_reached_and_not_before() -> None:
    async def run() -> None:
        clock = FakeClock(10.0)
        woke_at: list[float] = []

        async def sleeper(seconds: float) -> None:
            await clock.sleep(seconds)
            woke_at.append(clock.now())

        sleepers = [asyncio.ensure_future(sleeper(s)) for s in (2.0, 1.0)]
        await clock.waiting(2)
        clock.advance(0.5)
        assert clock.pending == 2
        clock.advance(0.5)
        await sleepers[1]
        assert woke_at == [11.0] and not sleepers[0].done()
        clock.advance(5.0)
        await sleepers[0]
        assert woke_at == [11.0, 16.0] and clock.pending == 0

    asyncio.run(run())


def test_a_timeout_expires_only_once_due_and_is_forgotten_when_its_block_ends() -> None:
    async def run() -> None:
        clock, never = FakeClock(), asyncio.Event()

        async def bounded() -> str:
            try:
                async with clock.timeout(3.0):
                    await never.wait()
            except TimeoutError:
                return f"expired at {clock.now()}"
            return "ended"

        waiter = asyncio.ensure_future(bounded())
        await clock.waiting()
        clock.advance(2.999)
        assert clock.pending == 1 and not waiter.done()
        clock.advance(0.001)
        assert await waiter == "expired at 3.0"

        done = asyncio.Event()
        done.set()
        async with clock.timeout(1.0):
            await done.wait()
        assert clock.pending == 0, "a block that ended in time leaves nothing behind"
        with pytest.raises(TimeoutError):
            async with clock.timeout(0):  # already due: expires at the block's first wait
                await never.wait()

    asyncio.run(run())


def test_time_never_goes_back() -> None:
    with pytest.raises(ValueError):
        FakeClock().advance(-1.0)


def test_the_real_clock_is_monotonic_time() -> None:
    clock = MonotonicClock()
    first = clock.now()
    assert clock.now() >= first
