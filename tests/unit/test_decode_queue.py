"""The decode-queue reader: which samples it sums, and that no fresh reading never refuses."""

from __future__ import annotations

import asyncio
import ipaddress

from extproc.adapters.base import PrefillReply, QueueGauges
from extproc.decode_queue import DecodeQueueWatch, waiting_from
from extproc.errors import Code, PdError
from extproc.prefill_target import PrefillTarget
from extproc.transport import ResolvedTarget
from tests.unit.test_processor import FakeTransport

DECODE = ResolvedTarget(PrefillTarget("127.0.0.1", 8200, ipaddress.ip_address("127.0.0.1")),
                        ipaddress.ip_address("127.0.0.1"), tls=False)
PAGE = """# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="m"} 3.0
vllm:num_requests_waiting{engine="1",model_name="m"} 2.0
vllm:num_requests_waiting_by_reason{reason="x"} 100.0
vllm:num_requests_running{engine="0"} 7.0
"""


def test_every_label_set_of_the_named_gauges_is_summed_and_nothing_else() -> None:
    assert waiting_from(PAGE, ["vllm:num_requests_waiting"]) == 5.0
    assert waiting_from(PAGE, ["sglang:num_queue_reqs"]) is None


def test_over_the_limit_refuses_and_a_stale_or_failed_reading_never_does() -> None:
    async def run() -> None:
        now = [100.0]
        transport = FakeTransport()
        watch = DecodeQueueWatch(transport, DECODE, QueueGauges("/metrics", ("vllm:num_requests_waiting",)),
                                 limit=4, interval=1.0, clock=lambda: now[0])
        transport.answers.append(PrefillReply(200, "text/plain", PAGE.encode()))
        await watch.read_once()
        assert watch.waiting == 5.0 and watch.over_limit()
        assert transport.calls[0].path == "/metrics" and transport.calls[0].target == DECODE
        now[0] += 3.5  # three intervals without a new reading: too old to act on
        assert watch.waiting is None and not watch.over_limit()
        transport.answers.append(PdError(Code.PREFILL_UPSTREAM_UNAVAILABLE))
        await watch.read_once()
        assert not watch.over_limit()
        transport.answers.append(PrefillReply(500, "text/plain", b""))
        await watch.read_once()
        assert watch.waiting is None

    asyncio.run(run())
