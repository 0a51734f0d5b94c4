"""One worst-shaped body must not stall the server: while it is inspected, health checks and small P/D
requests on other streams are answered. Proven by the order of answers, not by clocks."""

from __future__ import annotations

import asyncio
import functools
import os
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from grpc_health.v1 import health_pb2, health_pb2_grpc

from bench.loop_stall import worst_shape_chat
from extproc.app import EXT_PROC_SERVICE
from extproc.pipeline.inspector import Inspector
from extproc.protocol.inspection import Inspected, Refusal, Rules, inspect_answer
from extproc.protocol.request_head import RequestHead
from tests.servicer.test_servicer import CHAT, Harness, body_message, error_of, headers_message, run

# Refused after the whole inspection (a reserved field), so the big request runs no prefill leg.
REFUSED_AFTER_INSPECTION = b'"kv_transfer_params":{"remote_host":"10.0.0.1"},'
SMALL = {"model": "m", "messages": [{"role": "user", "content": "x"}]}


def gated_inspect(gate: str, path: str, content_type: str | None, raw: bytes, rules: Rules) -> Inspected | Refusal:
    """The pool's work, held until the test opens the FIFO ``gate`` for writing (runs in a worker process)."""
    with open(gate, "rb") as fifo:
        fifo.read()
    return inspect_answer(path, content_type, raw, rules)


async def _answers_while_big_is_inspected(h: Harness, big: bytes,
                                          release: Callable[[], Awaitable[None]] | None = None) -> list[str]:
    """Send the big body; once the server has it, a health check and a small P/D request on other streams.
    The order in which the three are answered."""
    order: list[str] = []
    big_arrived = asyncio.Event()
    on_body = h.server.processor.on_body

    async def watched(head: RequestHead, pending: Any, body: bytes) -> Any:
        if len(body) == len(big):
            big_arrived.set()
        return await on_body(head, pending, body)

    h.server.processor.on_body = watched  # type: ignore[method-assign]

    async def big_request() -> None:
        responses = await h.exchange(headers_message(CHAT, {"x-prefiller-host-port": h.prefill_address}),
                                     body_message(big))
        assert error_of(responses[-1]) == (400, "reserved_request_field")
        order.append("big")

    async def others() -> None:
        await big_arrived.wait()
        health = health_pb2_grpc.HealthStub(h.channel)
        reply = await health.Check(health_pb2.HealthCheckRequest(service=EXT_PROC_SERVICE))
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
        order.append("health")
        responses = await h.exchange(headers_message(CHAT, {"x-prefiller-host-port": h.prefill_address}),
                                     body_message(SMALL))
        assert responses[-1].WhichOneof("response") == "request_body"
        order.append("small")
        if release is not None:
            assert order == ["health", "small"]  # the big one is held in its worker
            await release()

    await asyncio.gather(big_request(), others())
    return order


def test_health_and_small_requests_are_answered_while_a_worst_shape_body_is_inspected() -> None:
    """8 MiB of tiny content parts: on the event loop its parse took seconds and everything else waited."""
    big = worst_shape_chat(8 << 20, REFUSED_AFTER_INSPECTION)

    async def test(h: Harness) -> None:
        assert await _answers_while_big_is_inspected(h, big) == ["health", "small", "big"]
        assert [record.request.path for record in h.prefill.control.records] == [CHAT]  # the small one's leg only

    run(test)


def test_a_held_inspection_holds_nothing_else(tmp_path: Path) -> None:
    """The inspection is held in its worker process until the others are answered: the order is forced."""
    gate = tmp_path / "gate"
    os.mkfifo(gate)
    big = worst_shape_chat(64 << 10, REFUSED_AFTER_INSPECTION)

    async def release() -> None:
        await asyncio.to_thread(lambda: open(gate, "wb").close())

    async def test(h: Harness) -> None:
        rules = h.server.processor.inspector._rules
        h.server.processor.inspector = Inspector(rules, work=functools.partial(gated_inspect, str(gate)))
        try:
            assert await _answers_while_big_is_inspected(h, big, release) == ["health", "small", "big"]
        finally:
            h.server.processor.inspector.close()

    run(test)


def test_large_bodies_past_the_waiting_bound_are_shed(tmp_path: Path) -> None:
    gate = tmp_path / "gate"
    os.mkfifo(gate)
    big = worst_shape_chat(64 << 10)

    async def test(h: Harness) -> None:
        rules = h.server.processor.inspector._rules
        h.server.processor.inspector = inspector = Inspector(rules, max_waiting=1,
                                                             work=functools.partial(gated_inspect, str(gate)))
        try:
            first = asyncio.create_task(inspector.inspect(CHAT, "application/json", big))
            await asyncio.sleep(0)  # one step of the task: up to its wait for the pool
            assert inspector.waiting == 1
            responses = await h.exchange(headers_message(CHAT, {"x-prefiller-host-port": h.prefill_address}),
                                         body_message(big))
            assert error_of(responses[-1]) == (503, "pd_overloaded")
            await asyncio.to_thread(lambda: open(gate, "wb").close())
            assert (await first).body["model"] == "m"
        finally:
            inspector.close()

    run(test)


@pytest.mark.parametrize("size", [8 << 10, 64 << 10])
def test_a_body_gets_the_same_answer_on_either_side_of_the_inline_limit(size: int) -> None:
    async def test(h: Harness) -> None:
        responses = await h.exchange(headers_message(CHAT, {"x-prefiller-host-port": h.prefill_address}),
                                     body_message(worst_shape_chat(size, b'"n":2,')))
        assert error_of(responses[-1]) == (400, "unsupported_pd_variant")
        responses = await h.exchange(headers_message(CHAT, {"x-prefiller-host-port": h.prefill_address}),
                                     body_message(worst_shape_chat(size)))
        assert responses[-1].WhichOneof("response") == "request_body"
        assert isinstance(responses[-1], pb.ProcessingResponse)
        assert h.server.processor.inspector.offloaded == (1 if size > 16 << 10 else 0) * 2

    run(test)


def test_the_waiting_gauge_counts_a_held_inspection(tmp_path: Path) -> None:
    gate = tmp_path / "gate"
    os.mkfifo(gate)

    def waiting(h: Harness) -> float:
        return float(next(line.split()[1] for line in h.server.metrics.exposition().decode().splitlines()
                          if line.startswith("pd_extproc_body_inspections_waiting ")))

    async def test(h: Harness) -> None:
        rules = h.server.processor.inspector._rules
        h.server.processor.inspector = inspector = Inspector(rules, work=functools.partial(gated_inspect, str(gate)))
        try:
            assert waiting(h) == 0
            held = asyncio.create_task(inspector.inspect(CHAT, "application/json", worst_shape_chat(64 << 10)))
            await asyncio.sleep(0)  # one step of the task: up to its wait for the pool
            assert waiting(h) == 1
            await asyncio.to_thread(lambda: open(gate, "wb").close())
            await held
            assert waiting(h) == 0
        finally:
            inspector.close()

    run(test)


def test_gateway_mode_checks_a_large_tagged_body_in_the_pool() -> None:
    """A tagged request that is not P/D: its body's steering check runs where the P/D inspection would,
    with the same answers (a large body: in a worker process)."""
    async def test(h: Harness) -> None:
        extra = {":method": "POST", "x-prefiller-host-port": h.prefill_address}
        steering = worst_shape_chat(64 << 10, b'"kv_transfer_params":{"remote_host":"10.0.0.9"},')
        responses = await h.exchange(headers_message("/cohere/v2/chat", extra), body_message(steering))
        assert error_of(responses[1]) == (400, "reserved_request_field")
        clean = worst_shape_chat(64 << 10)
        responses = await h.exchange(headers_message("/cohere/v2/chat", extra), body_message(clean))
        assert responses[1].WhichOneof("response") == "request_body"
        assert h.server.processor.inspector.offloaded == 2
        assert h.prefill.control.records == []

    run(test, PD_EXTPROC_MODE="gateway")
