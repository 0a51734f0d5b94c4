"""extproc/upstream/client.py's connection pool over real loopback sockets: what is reused, what is closed.

Each worker is a small asyncio server that answers every request on a connection with one canned
response and records, per connection, how many requests it served and whether we closed it. The
pool's clock is a FakeClock, so "idle for longer than the keep-alive" needs no waiting.
"""

from __future__ import annotations

import asyncio
import ipaddress
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import pytest

from extproc.clock import Clock, FakeClock, MonotonicClock
from extproc.protocol.errors import Code, PdError
from extproc.protocol.prefill_policy import PrefillPolicy
from extproc.protocol.transport import Bounds, ResolvedTarget, WorkerAddress
from extproc.upstream import client as upstream

OK = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 2\r\n\r\n{}"
LIMITS = upstream.WorkerLimits(connect_timeout=5, read_timeout=5, deadline=10, max_response_bytes=1 << 20,
                                max_connections=4)


@dataclass
class Served:
    requests: int = 0
    closed_by_us: asyncio.Event = field(default_factory=asyncio.Event)


@dataclass
class Worker:
    port: int
    connections: list[Served] = field(default_factory=list)
    received: asyncio.Event = field(default_factory=asyncio.Event)  # a request head and body arrived

    @property
    def target(self) -> ResolvedTarget:
        ip = ipaddress.ip_address("127.0.0.1")
        return ResolvedTarget(WorkerAddress(host="127.0.0.1", port=self.port, ip=ip), ip, tls=False)


@asynccontextmanager
async def worker(answer: bytes = OK, hold: asyncio.Event | None = None) -> AsyncIterator[Worker]:
    """A worker answering ``answer`` to each request head (after ``hold`` is set, when given)."""
    served = Worker(0)

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        record = Served()
        served.connections.append(record)
        try:
            while True:
                await reader.readuntil(b"\r\n\r\n")
                await reader.readexactly(2)  # every request body in these tests is b"{}"
                record.requests += 1
                served.received.set()
                if hold is not None:
                    await hold.wait()
                writer.write(answer)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            record.closed_by_us.set()
        finally:
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    served.port = server.sockets[0].getsockname()[1]
    try:
        yield served
    finally:
        server.close()


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock(1000.0)


def run(test: Callable[[], Coroutine[Any, Any, None]]) -> None:
    asyncio.run(asyncio.wait_for(test(), 30))


def client(clock: Clock | None = None) -> upstream.WorkerClient:
    return upstream.WorkerClient(LIMITS, PrefillPolicy((), allow_loopback=True), clock=clock or MonotonicClock())


def test_a_fresh_idle_connection_is_reused_and_a_stale_one_closed(clock: FakeClock) -> None:
    async def test() -> None:
        async with worker() as prefill:
            pool = client(clock)
            for _ in range(2):
                assert (await pool.post(prefill.target, "/v1/completions", [], b"{}")).status == 200
            assert [c.requests for c in prefill.connections] == [2]
            clock.advance(upstream.KEEPALIVE_SECONDS)  # idle as long as the workers' keep-alive allows
            await pool.post(prefill.target, "/v1/completions", [], b"{}")
            assert [c.requests for c in prefill.connections] == [2, 1]
            await prefill.connections[0].closed_by_us.wait()
            await pool.aclose()

    run(test)


def test_the_sweep_closes_idle_connections_of_a_worker_no_longer_used(clock: FakeClock) -> None:
    async def test() -> None:
        async with worker() as gone, worker() as current:
            pool = client(clock)
            await pool.post(gone.target, "/v1/completions", [], b"{}")
            clock.advance(upstream.KEEPALIVE_SECONDS)
            await pool.post(current.target, "/v1/completions", [], b"{}")
            await gone.connections[0].closed_by_us.wait()  # never used again, yet closed
            assert not current.connections[0].closed_by_us.is_set()
            assert [key[1] for key in pool._idle] == [current.port]  # the gone worker is forgotten
            await pool.aclose()

    run(test)


def test_a_non_200_answer_closes_its_connection() -> None:
    async def test() -> None:
        answer = b"HTTP/1.1 503 Service Unavailable\r\ncontent-length: 4\r\n\r\nbusy"
        async with worker(answer) as prefill:
            pool = client()
            assert (await pool.post(prefill.target, "/v1/completions", [], b"{}")).status == 503
            await prefill.connections[0].closed_by_us.wait()
            assert pool._idle == {}
            await pool.aclose()

    run(test)


def test_a_cancelled_exchange_closes_its_connection_and_frees_its_slot() -> None:
    async def test() -> None:
        hold = asyncio.Event()
        async with worker(hold=hold) as prefill:
            pool = upstream.WorkerClient(
                upstream.WorkerLimits(connect_timeout=5, read_timeout=5, deadline=10,
                                       max_response_bytes=1 << 20, max_connections=1),
                PrefillPolicy((), allow_loopback=True), clock=MonotonicClock())
            waiting = asyncio.create_task(pool.post(prefill.target, "/v1/completions", [], b"{}"))
            await prefill.received.wait()  # the worker holds the request
            waiting.cancel()
            with pytest.raises(asyncio.CancelledError):
                await waiting
            hold.set()  # the worker answers, then reads on and finds the connection closed
            await prefill.connections[0].closed_by_us.wait()
            # The one slot is free again, and the next request gets a connection of its own.
            assert (await pool.post(prefill.target, "/v1/completions", [], b"{}")).status == 200
            assert [c.requests for c in prefill.connections] == [1, 1]
            await pool.aclose()

    run(test)


def test_a_worker_that_closes_before_answering_is_unavailable() -> None:
    async def test() -> None:
        async def drop(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await reader.readuntil(b"\r\n\r\n")
            writer.close()

        server = await asyncio.start_server(drop, "127.0.0.1", 0)
        pool = client()
        with pytest.raises(PdError) as error:
            await pool.post(Worker(server.sockets[0].getsockname()[1]).target, "/v1/completions", [], b"{}")
        assert error.value.code is Code.PREFILL_UPSTREAM_UNAVAILABLE
        assert pool._idle == {}
        server.close()
        await pool.aclose()

    run(test)


def _short_deadline(max_connections: int = 4) -> upstream.WorkerClient:
    return upstream.WorkerClient(
        upstream.WorkerLimits(connect_timeout=5, read_timeout=30, deadline=0.2, max_response_bytes=1 << 20,
                               max_connections=max_connections),
        PrefillPolicy((), allow_loopback=True), clock=MonotonicClock())


Peer = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


async def _the_deadline_ends_the_exchange_with(peer: Peer) -> None:
    """A worker that reads our request head, then behaves as ``peer`` until we close the connection: the
    post must fail on the 0.2 s deadline, as a timeout, with the connection closed by us."""
    finished = asyncio.Event()

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await reader.readuntil(b"\r\n\r\n")
            await peer(reader, writer)
        except ConnectionError:
            pass
        finally:
            writer.close()
            finished.set()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    pool = _short_deadline()
    with pytest.raises(PdError) as error:
        # A post that never returns fails the test instead of hanging the suite (TimeoutError is not a PdError).
        async with asyncio.timeout(20):
            await pool.post(Worker(server.sockets[0].getsockname()[1]).target, "/v1/completions", [], b"{}")
    assert error.value.code is Code.PREFILL_UPSTREAM_TIMEOUT
    assert pool._idle == {}
    await finished.wait()  # the worker saw our close
    server.close()
    await pool.aclose()


def _drip(head: bytes) -> Peer:
    """Send ``head``, then one byte of the body every 10 ms, well within the 30 s read gap."""
    async def peer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readexactly(2)
        writer.write(head)
        while True:
            try:
                if not await asyncio.wait_for(reader.read(1), 0.01):
                    return  # we closed the connection
            except TimeoutError:
                writer.write(b" ")

    return peer


async def _flood(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Never stop sending ``100 Continue`` heads."""
    while not writer.is_closing() and not reader.at_eof():
        writer.write(b"HTTP/1.1 100 Continue\r\n\r\n" * 64)
        await writer.drain()


def test_the_deadline_bounds_a_peer_that_drips_within_the_read_gap() -> None:
    run(lambda: _the_deadline_ends_the_exchange_with(_drip(b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\n")))


def test_the_deadline_passing_while_an_error_body_drips_is_a_timeout_not_the_status() -> None:
    run(lambda: _the_deadline_ends_the_exchange_with(_drip(
        b"HTTP/1.1 400 Bad Request\r\ncontent-type: application/json\r\ncontent-length: 100\r\n\r\n")))


def test_the_deadline_bounds_a_peer_that_floods_interim_responses() -> None:
    """Every wait for bytes ends at once, so only a deadline checked before each wait can end the exchange
    (found in review: it ran unbounded)."""
    run(lambda: _the_deadline_ends_the_exchange_with(_flood))


def test_the_deadline_bounds_the_wait_for_a_connection_slot() -> None:
    """The first request holds the one slot on a long deadline of its own (Bounds), so the slot stays
    taken for as long as the second request's 0.2 s deadline runs: it used to share the 0.2 s, time out
    first and free the slot, which the second then took whenever the loop got there in time."""
    async def test() -> None:
        hold = asyncio.Event()
        async with worker(hold=hold) as prefill:
            pool = _short_deadline(max_connections=1)
            first = asyncio.create_task(pool.post(prefill.target, "/v1/completions", [], b"{}",
                                                  bounds=Bounds(deadline=120, read_timeout=120)))
            await prefill.received.wait()  # the one slot is taken, and held past the second's deadline
            with pytest.raises(PdError) as error:
                await pool.post(prefill.target, "/v1/completions", [], b"{}")
            assert error.value.code is Code.PREFILL_UPSTREAM_TIMEOUT
            assert [c.requests for c in prefill.connections] == [1]  # the second never got a connection
            assert not first.done(), "the slot's holder is still waiting for its answer"
            hold.set()
            assert (await first).status == 200
            await pool.aclose()
            await prefill.connections[0].closed_by_us.wait()

    run(test)
