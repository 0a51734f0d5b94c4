"""What the per-request caches keep, and what they must not change: every answer is the uncached one."""

from __future__ import annotations

import asyncio

import pytest
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from extproc.clock import MonotonicClock
from extproc.envoy import messages as msg
from extproc.protocol.errors import Code, PdError
from extproc.protocol.lru import Lru
from extproc.protocol.prefill_policy import PrefillPolicy, parse_allow_list
from extproc.protocol.prefill_target import ACCEPTED_ENTRIES, PrefillTargets, parse_prefill_target
from extproc.upstream import client as upstream

LIMITS = upstream.WorkerLimits(connect_timeout=5, read_timeout=5, deadline=10, max_response_bytes=1 << 20,
                                max_connections=4)


def test_an_accepted_target_is_parsed_once_and_a_refused_one_every_time() -> None:
    targets = PrefillTargets()
    first = targets.parse(["10.0.0.7:8000"])
    assert targets.parse(["10.0.0.7:8000"]) is first and first == parse_prefill_target(["10.0.0.7:8000"])
    for _ in range(2):
        with pytest.raises(PdError) as refused:
            targets.parse(["10.0.0.7:08000"])
        assert refused.value.code is Code.INVALID_PREFILL_TARGET
    assert "10.0.0.7:08000" not in targets.accepted
    with pytest.raises(PdError):
        targets.parse(["10.0.0.7:8000", "10.0.0.7:8000"])  # a repeat is refused even when cached


def test_the_accepted_values_stay_bounded_and_the_least_recently_used_goes_first() -> None:
    targets = PrefillTargets()
    kept = targets.parse(["10.0.0.8:1"])
    for port in range(2, ACCEPTED_ENTRIES + 10):
        targets.parse([f"10.0.0.8:{port}"])
        assert targets.parse(["10.0.0.8:1"]) is kept, "read again each time: never the least recently used"
    assert len(targets.accepted) == ACCEPTED_ENTRIES
    assert "10.0.0.8:2" not in targets.accepted and f"10.0.0.8:{ACCEPTED_ENTRIES + 9}" in targets.accepted


def test_two_owners_never_share_their_accepted_targets() -> None:
    """Each processor owns its own (was one module-level dict for every instance and test)."""
    first, second = PrefillTargets(), PrefillTargets()
    first.parse(["10.0.0.9:8000"])
    assert "10.0.0.9:8000" not in second.accepted


def test_an_lru_evicts_the_least_recently_used_entry_past_its_bound() -> None:
    cache: Lru[str, int] = Lru(2)
    cache.put("a", 1)
    cache.put("b", 2)
    assert cache.get("a") == 1  # "b" is now the least recently used
    cache.put("c", 3)
    assert ("a" in cache, "b" in cache, "c" in cache, len(cache)) == (True, False, True, 2)
    cache.put("a", 4)  # an update is a use: "c" goes next
    cache.put("d", 5)
    assert (cache.get("a"), cache.get("c"), cache.get("d")) == (4, None, 5)
    with pytest.raises(ValueError):
        Lru[str, int](0)


def test_a_checked_target_is_remembered_and_a_forbidden_one_refused_every_time() -> None:
    async def scenario() -> None:
        client = upstream.WorkerClient(LIMITS, PrefillPolicy(parse_allow_list("10.0.0.0/8:8000")),
                                       clock=MonotonicClock())
        allowed = parse_prefill_target(["10.0.0.7:8000"])
        checked = await client.resolve(allowed)
        assert allowed.ip is not None and checked == upstream.ResolvedTarget(allowed, allowed.ip, tls=False)
        assert await client.resolve(allowed) is checked
        for _ in range(2):
            with pytest.raises(PdError) as refused:
                await client.resolve(parse_prefill_target(["10.0.0.7:8001"]))
            assert refused.value.code is Code.PREFILL_TARGET_FORBIDDEN
        await client.aclose()

    asyncio.run(scenario())


def test_the_shared_continue_replies_are_the_messages_built_fresh() -> None:
    assert msg.continue_headers() == pb.ProcessingResponse(request_headers=pb.HeadersResponse())
    assert msg.continue_response_headers() == pb.ProcessingResponse(response_headers=pb.HeadersResponse())


def test_the_checked_targets_stay_bounded_and_the_least_recently_used_goes_first() -> None:
    async def scenario() -> None:
        client = upstream.WorkerClient(LIMITS, PrefillPolicy(parse_allow_list("10.0.0.0/8:*")), clock=MonotonicClock())
        kept = await client.resolve(parse_prefill_target(["10.0.0.7:1"]))
        for port in range(2, upstream.CHECKED_TARGETS_MAX + 10):
            await client.resolve(parse_prefill_target([f"10.0.0.7:{port}"]))
            assert await client.resolve(parse_prefill_target(["10.0.0.7:1"])) is kept
        assert len(client._checked) == upstream.CHECKED_TARGETS_MAX
        await client.aclose()

    asyncio.run(scenario())


def test_reading_an_lru_entry_is_a_use_whatever_its_value() -> None:
    """A stored None (or any value) read back is the most recently used, like any other."""
    cache: Lru[str, int | None] = Lru(2)
    cache.put("a", None)
    cache.put("b", 1)
    assert cache.get("a") is None  # a use: "b" is now the least recently used
    cache.put("c", 2)
    assert ("a" in cache, "b" in cache, "c" in cache) == (True, False, True)
