"""The emulators' KV ledgers free what nobody will use: the soak (bench/soak.py) reads them at rest."""

from __future__ import annotations

import asyncio
import time

from extproc.observability.httpserver import Request
from pd_extproc_lab.emulator.control import Received
from pd_extproc_lab.emulator.sglang import SglangEmulator
from pd_extproc_lab.emulator.vllm import VllmBehaviour, VllmEmulator


def test_vllm_metrics_free_an_expired_lease_without_another_request() -> None:
    emulator = VllmEmulator("prefill", "m", "p", "127.0.0.1", block_size=16, lease_seconds=0.01)
    emulator._grant_lease(20, Received(1, Request("POST", "/v1/completions", [], b"", "t")), VllmBehaviour())
    time.sleep(0.02)
    page = emulator.metrics()
    assert "emulator_kv_leases_outstanding{" in page and 'model_name="m"} 0.0' in page.split(
        "emulator_kv_leases_outstanding")[2]
    assert emulator.counters.expired_leases == 1 and not emulator.leases


def test_sglang_a_cancelled_claim_forgets_the_room_it_waited_for() -> None:
    async def scenario() -> dict[int, object]:
        emulator = SglangEmulator("prefill", "m", "p", "127.0.0.1", kv_timeout=30.0)
        claim = asyncio.ensure_future(emulator._claim({"room": 42, "prompt_sha": "x", "consumer": "d"}))
        await asyncio.sleep(0)  # one loop turn: the claim takes its room before its first await
        assert 42 in emulator.rooms, "the claim waits on the room"
        claim.cancel()
        await asyncio.gather(claim, return_exceptions=True)
        return dict(emulator.rooms)

    assert asyncio.run(scenario()) == {}
