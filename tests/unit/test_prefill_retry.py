"""extproc/upstream: the request line is validated before anything is sent, the transport raises only
PdError, the idle limit is a setting, and a request is sent again once only when a reused keep-alive
connection ended before any byte of a response (counted). Workers are scripted asyncio servers on
loopback; the pool's clock is a FakeClock where idle ages matter."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import pytest

from extproc.clock import Clock, FakeClock, MonotonicClock
from extproc.config import load_settings
from extproc.protocol.errors import Code, PdError
from extproc.protocol.prefill_policy import PrefillPolicy
from extproc.upstream import client as upstream
from extproc.upstream import http1
from tests.unit.test_prefill_pool import LIMITS, OK, Worker, clock, run

__all__ = ["clock"]  # the fixture, used by name


@dataclass
class Script:
    """Per connection, in order, what the worker does with each request it reads: "answer" (OK,
    keep-alive), "close" (close without a byte), "partial" (a few bytes of a head, then close)."""

    connections: list[list[str]]
    served: list[int] = field(default_factory=list)  # requests read, per connection


@asynccontextmanager
async def scripted(script: Script) -> AsyncIterator[Worker]:
    worker = Worker(0)

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        index = len(script.served)
        script.served.append(0)
        actions = script.connections[index] if index < len(script.connections) else ["close"]
        try:
            for action in actions:
                await reader.readuntil(b"\r\n\r\n")
                await reader.readexactly(2)
                script.served[index] += 1
                if action == "answer":
                    writer.write(OK)
                    await writer.drain()
                    continue
                if action == "partial":
                    writer.write(b"HTTP/1.1 2")
                    await writer.drain()
                break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    worker.port = server.sockets[0].getsockname()[1]
    try:
        yield worker
    finally:
        server.close()


def pool(retries: list[int], limits: upstream.WorkerLimits = LIMITS,
         clock: Clock | None = None) -> upstream.WorkerClient:
    return upstream.WorkerClient(limits, PrefillPolicy((), allow_loopback=True), on_retry=lambda: retries.append(1),
                                 clock=clock or MonotonicClock())


async def post(client: upstream.WorkerClient, worker: Worker) -> int:
    return (await client.post(worker.target, "/v1/completions", [], b"{}")).status


def test_a_reused_connection_closed_before_any_byte_is_retried_once_on_a_new_one() -> None:
    """The keep-alive race: the worker closes its idle connection as our second request goes out."""
    async def test() -> None:
        script, retries = Script([["answer", "close"], ["answer"]]), []
        async with scripted(script) as worker:
            client = pool(retries)
            assert await post(client, worker) == 200
            assert await post(client, worker) == 200
            assert script.served == [2, 1] and retries == [1]
            await client.aclose()

    run(test)


@pytest.mark.parametrize("connections,served", [
    ([["close"]], [1]),  # a fresh connection: the worker saw the request and said nothing
    ([["answer", "partial"]], [2]),  # reused, but a byte of the response arrived
    ([["answer", "close"], ["close"]], [2, 1]),  # the one retry also ends: no second retry
], ids=["fresh", "a-byte-arrived", "retried-once-only"])
def test_no_other_failure_is_retried(connections: list[list[str]], served: list[int]) -> None:
    async def test() -> None:
        script, retries = Script(connections), []
        async with scripted(script) as worker:
            client = pool(retries)
            if len(connections[0]) > 1:
                assert await post(client, worker) == 200
            with pytest.raises(PdError) as caught:
                await post(client, worker)
            assert caught.value.code is Code.PREFILL_UPSTREAM_UNAVAILABLE
            assert script.served == served
            assert retries == ([1] if len(served) == 2 else [])
            await client.aclose()

    run(test)


def test_the_idle_limit_is_the_setting(clock: FakeClock) -> None:
    async def test() -> None:
        script = Script([["answer", "answer"], ["answer"]])
        async with scripted(script) as worker:
            limits = upstream.WorkerLimits(connect_timeout=5, read_timeout=5, deadline=10,
                                           max_response_bytes=1 << 20, max_connections=4, keepalive=1.5)
            client = pool([], limits, clock)
            assert await post(client, worker) == 200
            clock.advance(1.4)
            assert await post(client, worker) == 200  # within the limit: reused
            clock.advance(1.5)
            assert await post(client, worker) == 200  # idle as long as the limit: a new connection
            assert script.served == [2, 1]
            await client.aclose()

    run(test)


def test_the_idle_limit_setting_defaults_below_uvicorns_keep_alive() -> None:
    """uvicorn/config.py, Config.__init__: timeout_keep_alive=5 (what vLLM and SGLang keep)."""
    assert load_settings({}, {}).prefill_keepalive == upstream.KEEPALIVE_SECONDS < 5
    assert load_settings({"PD_EXTPROC_PREFILL_KEEPALIVE": "1500ms"}, {}).prefill_keepalive == 1.5


@pytest.mark.parametrize("path", ["/v1/completions x", "/v1/completions\t", "/v1/\x00", "/v1/\x7f", "/é",
                                  "v1/completions", "", "*", "http://evil/v1/completions",
                                  "/v1/completions HTTP/1.1\r\nhost: evil\r\n\r\nGET /"])
def test_a_request_target_outside_origin_form_visible_ascii_is_refused(path: str) -> None:
    with pytest.raises(http1.InvalidRequest) as caught:
        http1.encode_request("POST", path, "prefill:8100", [], b"{}")
    assert caught.value.part == "path"


def test_a_visible_ascii_target_goes_out_verbatim() -> None:
    path = "/v1/completions?x=%2F&y=~!$'()*+,;=:@[]"
    assert http1.encode_request("GET", path, "p:1", [], None).startswith(f"GET {path} HTTP/1.1\r\n".encode())


@pytest.mark.parametrize("name,value", [("bad name", "v"), ("", "v"), ("x-a:", "v"), ("x-a", "v\x00"),
                                        ("x-a", "日本")])
def test_a_header_that_cannot_be_written_is_refused(name: str, value: str) -> None:
    with pytest.raises(http1.InvalidRequest) as caught:
        http1.encode_request("POST", "/v1/completions", "p:1", [(name, value)], b"{}")
    assert caught.value.part == "headers"


@pytest.mark.parametrize("path,headers,param", [
    ("/v1/completions x", [], "path"),
    ("/v1/completions", [("x-a", "v\r\nx-b: evil")], "headers"),
    ("/v1/completions", [("x-a", "日本")], "headers"),
])
def test_the_transport_raises_only_pd_error_and_sends_nothing(path: str, headers: list[tuple[str, str]],
                                                              param: str) -> None:
    async def test() -> None:
        script = Script([["answer"]])
        async with scripted(script) as worker:
            client = pool([])
            with pytest.raises(PdError) as caught:
                await client.post(worker.target, path, headers, b"{}")
            assert (caught.value.code, caught.value.param) == (Code.INVALID_REQUEST_FIELD, param)
            assert script.served == []  # no connection was made
            await client.aclose()

    run(test)
