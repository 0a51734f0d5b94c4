"""The emulated engines' HTTP server: our small h11 server plus what tests need of an engine.

It notices a client that closes its connection while a handler is still working (the handler task is
cancelled and ``on_disconnect`` is told), which is what cancellation tests observe; it streams (SSE);
and handlers can take over the raw socket to misbehave on purpose (stall, drip, truncate).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

import h11

from extproc.observability.httpserver import HttpServer, Request, Response, write_response


@dataclass(slots=True)
class StreamResponse:
    """A chunked response (SSE): each item of ``chunks`` is written and flushed as it comes."""

    chunks: AsyncIterator[bytes]
    status: int = 200
    content_type: str = "text/event-stream"


@dataclass(slots=True)
class RawResponse:
    """The handler writes raw bytes itself; the connection is closed afterwards."""

    write: Callable[[asyncio.StreamWriter], Awaitable[None]]


Reply = Response | StreamResponse | RawResponse
Handler = Callable[[Request], Awaitable[Reply]]
DisconnectHook = Callable[[Request], None]


def _eof(watch: asyncio.Future[bytes]) -> bool:
    """A finished read of the request socket means the client left (EOF or a reset)."""
    return watch.exception() is not None or not watch.result()


class EmulatorHttpServer(HttpServer):
    def __init__(self, handler: Handler, on_disconnect: DisconnectHook | None = None,
                 max_body: int = 64 << 20) -> None:
        super().__init__(handler, max_body)
        self._on_disconnect = on_disconnect

    def _disconnected(self, request: Request) -> None:
        if self._on_disconnect is not None:
            self._on_disconnect(request)

    async def _run_handler(self, request: Request, reader: asyncio.StreamReader,
                           conn: h11.Connection) -> Reply | None:
        """Run the handler while watching the socket: EOF means the client left."""
        handler = asyncio.ensure_future(self._handler(request))
        watch = asyncio.ensure_future(reader.read(1 << 16))
        done, _ = await asyncio.wait({handler, watch}, return_when=asyncio.FIRST_COMPLETED)
        if watch in done and _eof(watch):
            handler.cancel()
            with contextlib.suppress(BaseException):
                await handler
            self._disconnected(request)
            return None
        if watch in done:  # a pipelined request: keep its bytes for the next cycle
            conn.receive_data(watch.result())
            reply: Reply = await handler
        else:
            watch.cancel()
            with contextlib.suppress(BaseException):
                await watch
            reply = handler.result()
        return reply

    async def _until_disconnect(self, work: Awaitable[None], reader: asyncio.StreamReader,
                                request: Request) -> None:
        """Run ``work``; if the client closes the connection first, cancel it and report."""
        task = asyncio.ensure_future(work)
        watch = asyncio.ensure_future(reader.read(1 << 16))
        done, _ = await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
        for pending in (task, watch):
            if not pending.done():
                pending.cancel()
            with contextlib.suppress(BaseException):
                await pending
        if watch in done and _eof(watch) and task not in done:
            self._disconnected(request)

    async def _write_reply(self, conn: h11.Connection, reader: asyncio.StreamReader,
                           writer: asyncio.StreamWriter, request: Request, reply: Reply) -> bool:
        if isinstance(reply, RawResponse):
            await self._until_disconnect(reply.write(writer), reader, request)
            return False
        if writer.is_closing():  # the client left while the handler ran
            self._disconnected(request)
            return False
        if isinstance(reply, Response):
            await write_response(conn, writer, reply)
            return True
        return await self._write_stream(conn, reader, writer, request, reply)

    async def _write_stream(self, conn: h11.Connection, reader: asyncio.StreamReader,
                            writer: asyncio.StreamWriter, request: Request, reply: StreamResponse) -> bool:
        headers = [("content-type", reply.content_type), ("cache-control", "no-cache"),
                   ("transfer-encoding", "chunked")]
        writer.write(conn.send(h11.Response(status_code=reply.status, headers=headers)) or b"")
        await writer.drain()
        watch = asyncio.ensure_future(reader.read(1 << 16))
        chunks = aiter(reply.chunks)
        try:
            while True:
                step = asyncio.ensure_future(anext(chunks))
                done, _ = await asyncio.wait({step, watch}, return_when=asyncio.FIRST_COMPLETED)
                if watch in done and _eof(watch):  # the client left mid-stream
                    step.cancel()
                    with contextlib.suppress(BaseException):
                        await step
                    self._disconnected(request)
                    return False
                try:
                    chunk = await step
                except StopAsyncIteration:
                    break
                try:
                    # uvloop raises RuntimeError on a write to a closed transport (asyncio's own loop
                    # drops the bytes), so a closed transport is checked first, as a disconnect.
                    if writer.is_closing():
                        raise ConnectionResetError("the client closed the connection")
                    writer.write(conn.send(h11.Data(data=chunk)) or b"")
                    await writer.drain()
                except ConnectionError:  # the client left while we were writing
                    self._disconnected(request)
                    return False
        finally:
            if not watch.done():
                watch.cancel()
                with contextlib.suppress(BaseException):
                    await watch
        if writer.is_closing():
            return False
        writer.write(conn.send(h11.EndOfMessage()) or b"")
        await writer.drain()
        return True
