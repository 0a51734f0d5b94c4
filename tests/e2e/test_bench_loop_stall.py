"""``make bench``'s loop-stall phase (bench/loop_stall.py) runs against today's server: a worst-shape body,
sent by another process, is refused while small P/D requests go on, and the server shuts down cleanly."""

from __future__ import annotations

import asyncio

from bench import loop_stall


def test_the_loop_stall_phase_measures_both_phases_and_refuses_the_big_body() -> None:
    result = asyncio.run(loop_stall.measure(loop_stall.in_the_pool, size_mib=1, small_streams=1,
                                            baseline_seconds=0.1))
    assert result["big_ms"] > 0  # the big body was answered, with the refusal (checked inside measure)
    assert result["before_count"] > 0 and result["during_count"] > 0  # small P/D requests succeeded
