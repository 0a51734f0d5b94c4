"""What the per-request caches keep, and what they must not change: every answer is the uncached one."""

from __future__ import annotations

import asyncio

import pytest
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from extproc.envoy import messages as msg
from extproc.protocol import prefill_target
from extproc.protocol.errors import Code, PdError
from extproc.protocol.prefill_policy import PrefillPolicy, parse_allow_list
from extproc.protocol.prefill_target import parse_prefill_target
from extproc.upstream import client as upstream

LIMITS = upstream.WorkerLimits(connect_timeout=5, read_timeout=5, deadline=10, max_response_bytes=1 << 20,
                                max_connections=4)


def test_an_accepted_target_is_parsed_once_and_a_refused_one_every_time() -> None:
    first = parse_prefill_target(["10.0.0.7:8000"])
    assert parse_prefill_target(["10.0.0.7:8000"]) is first
    for _ in range(2):
        with pytest.raises(PdError) as refused:
            parse_prefill_target(["10.0.0.7:08000"])
        assert refused.value.code is Code.INVALID_PREFILL_TARGET
    assert "10.0.0.7:08000" not in prefill_target._ACCEPTED
    with pytest.raises(PdError):
        parse_prefill_target(["10.0.0.7:8000", "10.0.0.7:8000"])  # a repeat is refused even when cached


def test_the_accepted_values_stay_bounded() -> None:
    for port in range(1, prefill_target._ACCEPTED_MAX + 10):
        parse_prefill_target([f"10.0.0.8:{port}"])
    assert len(prefill_target._ACCEPTED) <= prefill_target._ACCEPTED_MAX


def test_a_checked_target_is_remembered_and_a_forbidden_one_refused_every_time() -> None:
    async def scenario() -> None:
        client = upstream.WorkerClient(LIMITS, PrefillPolicy(parse_allow_list("10.0.0.0/8:8000")))
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
