"""The decode-queue reader: which samples it sums, and that no fresh reading never refuses."""

from __future__ import annotations

import asyncio
import ipaddress

from bench.prom_parse import vllm_like_page
from extproc.adapters.base import QueueGauges
from extproc.plugin import FakeClock, FakeTransport
from extproc.protocol.errors import Code, PdError
from extproc.protocol.prom_text import gauge_values, sample_values
from extproc.protocol.transport import ResolvedTarget, WorkerAddress, WorkerReply
from extproc.upstream.decode_queue import DecodeQueueWatch, waiting_from

DECODE = ResolvedTarget(WorkerAddress("127.0.0.1", 8200, ipaddress.ip_address("127.0.0.1")),
                        ipaddress.ip_address("127.0.0.1"), tls=False)
PAGE = """# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="m"} 3.0
vllm:num_requests_waiting{engine="1",model_name="m"} 2.0
vllm:num_requests_waiting_by_reason{reason="x"} 100.0
vllm:num_requests_running{engine="0"} 7.0
"""


def test_every_label_set_of_the_named_gauges_is_summed_and_nothing_else() -> None:
    assert waiting_from(PAGE.encode(), ["vllm:num_requests_waiting"]) == 5.0
    assert waiting_from(PAGE.encode(), ["sglang:num_queue_reqs"]) is None


def test_over_the_limit_refuses_until_the_reading_is_three_intervals_old() -> None:
    """A failed or slow scrape gives no reading; the last one stands until it is too old, then
    nothing is refused."""
    async def run() -> None:
        clock = FakeClock(100.0)
        transport = FakeTransport()
        failures: list[str] = []
        watch = DecodeQueueWatch(transport, DECODE, QueueGauges("/metrics", ("vllm:num_requests_waiting",)),
                                 limit=4, interval=1.0, clock=clock, on_failure=failures.append)
        assert watch.waiting is None and not watch.over_limit(), "no reading yet"
        for failure in (PdError(Code.PREFILL_UPSTREAM_UNAVAILABLE), WorkerReply(500, "text/plain", b""),
                        WorkerReply(200, "text/plain", b"other_metric 9\n")):
            transport.answers.append(WorkerReply(200, "text/plain", PAGE.encode()))
            await watch.read_once()
            transport.answers.append(failure)
            await watch.read_once()
            assert watch.waiting == 5.0 and watch.over_limit(), f"{failure!r}: the last reading stands"
            clock.advance(3.5)  # three intervals without a new reading: too old to act on
            assert watch.waiting is None and not watch.over_limit()
        assert failures == ["prefill_upstream_unavailable", "status_500", "no_gauge"]
        assert transport.calls[0].path == "/metrics" and transport.calls[0].target == DECODE

    asyncio.run(run())


def test_a_scrape_slower_than_the_interval_gives_no_reading() -> None:
    """The scrape is given the interval, to the instant (on the fake clock; it was a real 10 ms wait)."""
    async def run() -> None:
        transport, clock = FakeTransport(), FakeClock()
        failures: list[str] = []
        watch = DecodeQueueWatch(transport, DECODE, QueueGauges("/metrics", ("vllm:num_requests_waiting",)),
                                 limit=4, interval=1.0, clock=clock, on_failure=failures.append)

        async def never() -> WorkerReply:
            await asyncio.Event().wait()
            raise AssertionError("unreachable")

        transport.answers.append(never)
        scrape = asyncio.ensure_future(watch.read_once())
        await clock.waiting()
        clock.advance(0.999)
        assert clock.pending == 1 and failures == [], "within the interval"
        clock.advance(0.001)
        await scrape
        assert failures == ["timeout"] and watch.waiting is None

    asyncio.run(run())


def test_the_watch_reads_once_per_interval_until_stopped() -> None:
    async def run() -> None:
        transport, clock = FakeTransport(), FakeClock()
        read_at: list[float] = []

        async def page() -> WorkerReply:
            read_at.append(clock.now())
            return WorkerReply(200, "text/plain", PAGE.encode())

        transport.answers.extend([page] * 3)
        watch = DecodeQueueWatch(transport, DECODE, QueueGauges("/metrics", ("vllm:num_requests_waiting",)),
                                 limit=4, interval=1.0, clock=clock)
        watch.start()
        for _ in range(2):
            await clock.waiting()  # the wait after a reading
            clock.advance(1.0)
        await clock.waiting()
        await watch.stop()
        assert read_at == [0.0, 1.0, 2.0] and watch.waiting == 5.0 and clock.pending == 0

    asyncio.run(run())


def test_samples_with_timestamps_and_quoted_braces_are_read() -> None:
    page = 'vllm:num_requests_waiting{model_name="a } b \\" {"} 3 1700000000000\nvllm:num_requests_waiting 2\n'
    assert waiting_from(page.encode(), ["vllm:num_requests_waiting"]) == 5.0


def test_gauges_are_found_by_their_line_start_only() -> None:
    """gauge_values finds the named samples without reading the other lines: a name at the page's start,
    after CRLF lines, a longer name it begins, a comment and a label value holding the name."""
    page = (b'vllm:num_requests_waiting{engine="0"} 1\r\n'
            b'# HELP vllm:num_requests_waiting x\n'
            b'other{note="\\nvllm:num_requests_waiting 50"} 7\n'
            b'vllm:num_requests_waiting_total 100\n'
            b'vllm:num_requests_waiting{model_name="a } b \\" {"} 2 1700000000000\n'
            b'vllm:num_requests_waiting 4')
    assert list(gauge_values(page, ["vllm:num_requests_waiting"])) == [1.0, 2.0, 4.0]
    assert list(gauge_values(page, ["sglang:num_queue_reqs"])) == []


def test_gauge_values_agree_with_the_line_parser_on_an_engine_like_page() -> None:
    page = vllm_like_page(histograms=4, buckets=3)
    names = ["vllm:num_requests_waiting", "vllm:hist_1_count", "vllm:hist_2_bucket"]
    assert sorted(gauge_values(page.encode(), names)) == sorted(sample_values(page, frozenset(names)))
