"""pd_extproc_lab/emulator/http.py (the emulators' HTTP server) when the client is gone before a write.

Under uvloop (which `pd-extproc serve` and `emulate` run on) a write to a closed transport raises
RuntimeError, where asyncio's own loop drops the bytes. The writer below behaves like uvloop's, so
these checks do not depend on which of the server's two paths (read watch or write) sees the close
first, a race that made the end-to-end C18 test flaky.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any, cast

import h11

from extproc.observability.httpserver import Request, Response
from pd_extproc_lab.emulator.http import EmulatorHttpServer as HttpServer
from pd_extproc_lab.emulator.http import Reply, StreamResponse


class ClosableWriter:
    """A StreamWriter stand-in whose transport can be closed under it, failing writes as uvloop does."""

    def __init__(self) -> None:
        self.closed = False
        self.sent = bytearray()

    def is_closing(self) -> bool:
        return self.closed

    def write(self, data: bytes) -> None:
        if self.closed:
            raise RuntimeError("unable to perform operation on <TCPTransport closed=True>; the handler is closed")
        self.sent += data

    async def drain(self) -> None:
        return None


def answered_connection() -> h11.Connection:
    """A server-side h11 connection that has read one whole request and must now answer it."""
    conn = h11.Connection(h11.SERVER)
    conn.receive_data(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-length: 0\r\n\r\n")
    assert isinstance(conn.next_event(), h11.Request)
    assert isinstance(conn.next_event(), h11.EndOfMessage)
    return conn


def write_reply(reply_for: Any, writer: ClosableWriter) -> tuple[bool, list[Request]]:
    """Run the server's reply writer on a connection whose reader never sees EOF; return what it
    returned and every request it reported as disconnected."""
    gone: list[Request] = []
    server = HttpServer(lambda request: asyncio.sleep(0), on_disconnect=gone.append)
    request = Request("POST", "/v1/completions", [], b"", "127.0.0.1:1")

    async def run() -> bool:
        reader = asyncio.StreamReader()  # never fed: only the write path can notice the close
        reply: Reply = reply_for()
        return await server._write_reply(answered_connection(), reader, cast(asyncio.StreamWriter, writer),
                                         request, reply)

    return asyncio.run(run()), gone


def test_a_stream_whose_client_left_between_chunks_is_reported_as_disconnected() -> None:
    writer = ClosableWriter()

    async def chunks() -> AsyncIterator[bytes]:
        yield b"data: first\n\n"
        writer.closed = True  # the client hangs up after the first event
        yield b"data: second\n\n"

    kept_going, gone = write_reply(lambda: StreamResponse(chunks()), writer)
    assert kept_going is False, "the connection must be dropped, not reused"
    assert len(gone) == 1, "the disconnect must be reported once"
    assert b"data: first" in writer.sent and b"data: second" not in writer.sent


def test_a_reply_whose_client_left_while_the_handler_ran_is_reported_as_disconnected() -> None:
    writer = ClosableWriter()
    writer.closed = True
    kept_going, gone = write_reply(lambda: Response(200, b"{}"), writer)
    assert (kept_going, len(gone), bytes(writer.sent)) == (False, 1, b"")


def test_a_stream_to_a_client_that_stays_is_written_whole() -> None:
    writer = ClosableWriter()

    async def chunks() -> AsyncIterator[bytes]:
        yield b"data: one\n\n"
        yield b"data: [DONE]\n\n"

    kept_going, gone = write_reply(lambda: StreamResponse(chunks()), writer)
    assert (kept_going, gone) == (True, [])
    assert writer.sent.endswith(b"0\r\n\r\n") and b"data: [DONE]" in writer.sent
