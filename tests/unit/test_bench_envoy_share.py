"""The Envoy's-share A/B of the benchmark: the floor variants' replies (against our server's own reply), the
points' checks, and the report's rows and verdict, over made-up points."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from bench import markdown, report, run, verify
from bench.cheap_worker import DEFAULT_ENGINE_ID
from bench.cheap_worker import Worker as CheapWorker
from bench.floor import aio, replies
from bench.systems import System
from bench.workers import LegCounters
from bench.workload import CHAT_PATH, chat_body
from extproc.adapters.vllm_nixl import VllmNixlAdapter
from extproc.envoy import messages as msg
from extproc.protocol.transport import WorkerReply
from tests.unit.test_processor import rig, start


def body_message(body: bytes) -> pb.ProcessingRequest:
    return pb.ProcessingRequest(request_body=pb.HttpBody(body=body, end_of_stream=True))


def headers_message() -> pb.ProcessingRequest:
    return pb.ProcessingRequest(request_headers=pb.HttpHeaders())


def wire(response: pb.ProcessingResponse) -> bytes:
    return response.SerializeToString(deterministic=True)


def cheap_prefill_answer(request_body: bytes) -> bytes:
    """What the cheap vllm prefill worker answers a producer request with, its handoff id set to the shape's."""
    worker = CheapWorker("vllm", "prefill", DEFAULT_ENGINE_ID, 8998)
    response = worker.post(CHAT_PATH.encode(), request_body)
    assert worker.counters["producer"] == 1
    return response.split(b"\r\n\r\n", 1)[1].replace(b'"cheap-1"', json.dumps(replies.SHAPE_REQUEST_ID).encode())


@pytest.mark.parametrize("stream", [False, True])
def test_the_shape_reply_is_our_servers_reply_to_the_same_body_and_the_cheap_prefill_handoff(stream: bool) -> None:
    client = chat_body(stream)

    async def ours() -> pb.ProcessingResponse:
        r = rig(VllmNixlAdapter())
        r.transport.answers.append(WorkerReply(200, "application/json",
                                               cheap_prefill_answer(b'{"kv_transfer_params":{"do_remote_decode":true}}')))
        request_head, pending = await start(r, {})
        outcome = await r.processor.on_body(request_head, pending, client)
        reply = msg.reply(outcome.decision)
        assert isinstance(reply, msg.EncodedResponse)
        return reply.message()

    expected = asyncio.run(ours())
    assert list(expected.request_body.response.header_mutation.remove_headers)  # the removals are compared too
    assert wire(replies.shape_reply(body_message(client))) == wire(expected)


def test_the_shaped_body_makes_the_cheap_decode_worker_count_a_consumer_leg() -> None:
    decode = CheapWorker("vllm", "decode", DEFAULT_ENGINE_ID, 8998)
    decode.post(CHAT_PATH.encode(), replies.shaped_body(chat_body(stream=False)))
    decode.post(CHAT_PATH.encode(), chat_body(stream=False))
    assert (decode.counters["consumer"], decode.counters["plain"], len(decode.handoff_ids)) == (1, 1, 1)


@pytest.mark.parametrize("body", [b"", b"{}", b"[1]", b'"x"'])
def test_the_shaped_body_refuses_what_is_not_a_non_empty_object(body: bytes) -> None:
    with pytest.raises(ValueError):
        replies.shaped_body(body)


@pytest.mark.parametrize("make", [replies.plain_reply, replies.shape_reply])
def test_every_variant_continues_on_the_headers(make: aio.Reply) -> None:
    assert wire(make(headers_message())) == wire(pb.ProcessingResponse(request_headers=pb.HeadersResponse()))


def test_the_plain_reply_is_the_body_back_with_its_length_and_nothing_else() -> None:
    common = replies.plain_reply(body_message(b'{"a":1}')).request_body.response
    assert common.body_mutation.body == b'{"a":1}'
    set_headers = [(h.header.key, h.header.raw_value) for h in common.header_mutation.set_headers]
    assert set_headers == [("content-length", b"7")]
    assert not common.header_mutation.remove_headers


@pytest.mark.parametrize("variant,reply,waits", [("plain", replies.plain_reply, False),
                                                 ("shape", replies.shape_reply, False),
                                                 ("delay", replies.plain_reply, True),
                                                 ("burn", replies.plain_reply, True)])
def test_each_variant_answers_with_its_reply_and_waits_only_if_told(variant: str, reply: aio.Reply,
                                                                    waits: bool) -> None:
    chosen, before_body = aio.variant_behaviour(variant, delay_ms=0.0, burn_us=1.0)
    assert chosen is reply and (before_body is not None) == waits


def test_the_servicer_waits_before_the_body_only_then_answers_each_message() -> None:
    waited_before: list[int] = []
    answered: list[str] = []

    async def before_body() -> None:
        waited_before.append(len(answered))

    async def messages() -> AsyncIterator[pb.ProcessingRequest]:
        yield headers_message()
        yield body_message(b'{"a":1}')

    async def drive() -> None:
        servicer = aio.Servicer(replies.plain_reply, before_body)
        async for response in servicer.Process(messages(), None):
            answered.append(str(response.WhichOneof("response")))

    asyncio.run(drive())
    assert answered == ["request_headers", "request_body"] and waited_before == [1]


def test_burn_spends_at_least_its_cpu() -> None:
    before = time.thread_time_ns()
    aio.burn(2000)
    assert time.thread_time_ns() - before >= 2_000_000


def test_the_variants_run_at_the_envoy_share_point_only() -> None:
    assert set(run.ENVOY_SHARE_SYSTEMS) <= set(run.latency_systems(*report.ENVOY_SHARE_POINT))
    for body, concurrency in [("non-stream", 16), ("stream", 64), ("non-stream", 1)]:
        assert not set(run.ENVOY_SHARE_SYSTEMS) & set(run.latency_systems(body, concurrency))
    assert (report.FLOOR_AIO, *run.ENVOY_SHARE_SYSTEMS, "pd-extproc") == report.ENVOY_SHARE_SYSTEMS
    assert set(report.ENVOY_SHARE_SYSTEMS) <= set(markdown.SYSTEM_ORDER) <= set(markdown.SYSTEM_DESCRIPTIONS)


SHAPE = System("floor-aio-shape", "http://127.0.0.1:1", handoff=True)
DELAY = System("floor-aio-delay", "http://127.0.0.1:1")


def legs(consumer: int = 0, plain: int = 0, producer: int = 0) -> LegCounters:
    return LegCounters(producer, producer, 0, consumer, 0, plain, 1 if consumer else 0)


@pytest.mark.parametrize("system,counters,problems", [
    (SHAPE, legs(consumer=100), []),
    (SHAPE, legs(consumer=103), []),  # wrk abandoned three at the end
    (SHAPE, legs(consumer=99, plain=1), ["99 consumer legs at decode for 100 completed requests",
                                         "1 decode requests had no handoff"]),
    (SHAPE, legs(consumer=100, producer=100), ["prefill was called"]),
    (DELAY, legs(plain=100), []),
    (DELAY, legs(consumer=100), ["decode pulled KV on a non-P/D path", "decode saw fewer requests than completed"]),
])
def test_a_variants_point_is_checked_against_the_workers_counters(system: System, counters: LegCounters,
                                                                   problems: list[str]) -> None:
    assert verify.check_point(system, counters, 100, 0, 64) == problems


def point(system: str, envoy_us: float, server_us: float, rps: float = 1000.0, round_index: int = 0,
          body: str = "non-stream", concurrency: int = 64) -> dict[str, Any]:
    handled = int(rps)
    cpu = {"envoy": envoy_us * handled / 1e6}
    if system != "direct":
        cpu[system] = server_us * handled / 1e6
    return {"phase": "latency", "workers": "cheap", "system": system, "body": body, "concurrency": concurrency,
            "round": round_index, "p50_us": 1000.0, "p99_us": 2000.0, "max_us": 3000.0, "requests": handled,
            "seconds": 1.0, "errors": 0, "problems": [], "foreign_cpu_share": 0.0, "loadgen_cpu_seconds": 0.1,
            "requests_handled": handled, "proxy_cpu_seconds": cpu}


def share_points(ours_envoy: float) -> list[dict[str, Any]]:
    return [point("direct", 0, 0, 9000), point("floor-aio", 260, 360, 2000), point("floor-aio-shape", 270, 370, 1900),
            point("floor-aio-delay", 330, 350, 1200), point("floor-aio-burn", 300, 800, 1100),
            point("pd-extproc", ours_envoy, 790, 1000), point("pd-extproc", 999, 999, 500, concurrency=16)]


def test_the_envoy_share_rows_are_each_systems_cpu_and_its_envoy_over_floor_aios() -> None:
    rows = report.envoy_share(report.cells(share_points(400), "latency"))
    assert [(r["system"], round(r["envoy_us"]), round(r["envoy_over_floor_us"]), round(r["server_us"]), r["rps"])
            for r in rows] == [("floor-aio", 260, 0, 360, 2000), ("floor-aio-shape", 270, 10, 370, 1900),
                               ("floor-aio-delay", 330, 70, 350, 1200), ("floor-aio-burn", 300, 40, 800, 1100),
                               ("pd-extproc", 400, 140, 790, 1000)]


@pytest.mark.parametrize("ours,met,by", [(400, False, "+110 µs over"), (290, True, "met"), (280, True, "met")])
def test_the_envoy_share_verdict_is_met_within_30_us_of_floor_aios(ours: float, met: bool, by: str) -> None:
    verdict = report.target_envoy_share(report.cells(share_points(ours), "latency"))
    assert verdict is not None and (verdict.met, verdict.by) == (met, by)
    assert verdict.target == "Envoy's CPU per P/D request within 30 µs of floor-aio's (c=64)"


def test_without_floor_aio_there_is_no_envoy_share_verdict_and_it_heads_the_targets() -> None:
    without = [p for p in share_points(400) if p["system"] != "floor-aio"]
    assert report.target_envoy_share(report.cells(without, "latency")) is None
    assert all(r["envoy_over_floor_us"] is None for r in report.envoy_share(report.cells(without, "latency")))
    verdicts = report.verdicts(report.cells(share_points(400), "latency"), [])
    assert verdicts[0].target.startswith("Envoy's CPU per P/D request")


def test_the_results_section_has_a_row_per_system_with_its_difference() -> None:
    summary = {"envoy_share": report.envoy_share(report.cells(share_points(400), "latency"))}
    lines = markdown.envoy_share(summary)
    assert lines[0] == "## What makes Envoy work harder (c=64, non-stream, cheap workers)"
    rows = [line for line in lines if line.startswith("| `")]
    assert rows == ["| `floor-aio` | 260 | +0 | 360 | 2000 | ok |",
                    "| `floor-aio-shape` | 270 | +10 | 370 | 1900 | ok |",
                    "| `floor-aio-delay` | 330 | +70 | 350 | 1200 | ok |",
                    "| `floor-aio-burn` | 300 | +40 | 800 | 1100 | ok |",
                    "| `pd-extproc` | 400 | +140 | 790 | 1000 | ok |"]
    assert markdown.envoy_share({}) == []
