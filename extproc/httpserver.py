"""A small asyncio HTTP/1.1 server on h11: our metrics and health endpoints, and the emulated engines.

It notices a client that closes its connection while a handler is still working (the handler task
is cancelled and ``on_disconnect`` is told), which is what cancellation tests observe. Handlers can
also take over the raw socket to misbehave on purpose (stall, drip, truncate).
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

import h11


@dataclass(slots=True)
class Request:
    method: str
    target: str
    headers: list[tuple[str, str]]
    body: bytes
    peer: str

    @property
    def path(self) -> str:
        return self.target.split("?", 1)[0]

    def header(self, name: str) -> str | None:
        for key, value in self.headers:
            if key == name:
                return value
        return None


@dataclass(slots=True)
class Response:
    status: int
    body: bytes = b""
    content_type: str = "application/json"
    headers: list[tuple[str, str]] = field(default_factory=list)


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


def _eof(watch: asyncio.Future[bytes]) -> bool:
    """A finished read of the request socket means the client left (EOF or a reset)."""
    return watch.exception() is not None or not watch.result()
Handler = Callable[[Request], Awaitable[Reply]]
DisconnectHook = Callable[[Request], None]


class HttpServer:
    def __init__(self, handler: Handler, on_disconnect: DisconnectHook | None = None,
                 max_body: int = 64 << 20) -> None:
        self._handler = handler
        self._on_disconnect = on_disconnect
        self._max_body = max_body
        self._server: asyncio.Server | None = None
        self._connections: set[asyncio.Task[None]] = set()

    async def start(self, host: str, port: int, tls: ssl.SSLContext | None = None) -> int:
        self._server = await asyncio.start_server(self._serve, host, port, limit=1 << 20, backlog=4096, ssl=tls)
        return int(self._server.sockets[0].getsockname()[1])

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            for task in list(self._connections):
                task.cancel()
            await self._server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._connections.add(task)
        peer = writer.get_extra_info("peername")
        peer_text = f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) else str(peer)
        conn = h11.Connection(h11.SERVER, max_incomplete_event_size=1 << 20)
        try:
            while True:
                request = await self._read_request(conn, reader, peer_text)
                if request is None:
                    return
                reply = await self._run_handler(request, reader, conn)
                if reply is None:
                    return
                if not await self._write_reply(conn, reader, writer, request, reply):
                    return
                if conn.our_state is h11.MUST_CLOSE or conn.their_state is h11.MUST_CLOSE:
                    return
                conn.start_next_cycle()
        except (ConnectionError, h11.ProtocolError, asyncio.IncompleteReadError):
            return
        finally:
            self._connections.discard(task)
            with contextlib.suppress(Exception):
                writer.close()

    async def _read_request(self, conn: h11.Connection, reader: asyncio.StreamReader,
                            peer: str) -> Request | None:
        head: h11.Request | None = None
        body = bytearray()
        while True:
            event = conn.next_event()
            if event is h11.NEED_DATA:
                data = await reader.read(1 << 20)
                conn.receive_data(data)
                if not data and conn.their_state is not h11.DONE:
                    return None
                continue
            if isinstance(event, h11.Request):
                head = event
            elif isinstance(event, h11.Data):
                body += event.data
                if len(body) > self._max_body:
                    return None
            elif isinstance(event, h11.EndOfMessage):
                assert head is not None
                headers = [(k.decode("latin-1").lower(), v.decode("latin-1")) for k, v in head.headers]
                return Request(head.method.decode(), head.target.decode("latin-1"), headers, bytes(body), peer)
            elif isinstance(event, h11.ConnectionClosed) or event is h11.PAUSED:
                return None

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
            if self._on_disconnect is not None:
                self._on_disconnect(request)
            return None
        if watch in done:  # a pipelined request: keep its bytes for the next cycle
            conn.receive_data(watch.result())
            reply = await handler
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
        if watch in done and _eof(watch) and task not in done and self._on_disconnect is not None:
            self._on_disconnect(request)

    async def _write_reply(self, conn: h11.Connection, reader: asyncio.StreamReader,
                           writer: asyncio.StreamWriter, request: Request, reply: Reply) -> bool:
        if isinstance(reply, RawResponse):
            await self._until_disconnect(reply.write(writer), reader, request)
            return False
        if writer.is_closing():  # the client left while the handler ran
            if self._on_disconnect is not None:
                self._on_disconnect(request)
            return False
        if isinstance(reply, Response):
            headers = [("content-type", reply.content_type), ("content-length", str(len(reply.body))),
                       *reply.headers]
            writer.write(conn.send(h11.Response(status_code=reply.status, headers=headers)) or b"")
            writer.write(conn.send(h11.Data(data=reply.body)) or b"")
            writer.write(conn.send(h11.EndOfMessage()) or b"")
            await writer.drain()
            return True
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
                    if self._on_disconnect is not None:
                        self._on_disconnect(request)
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
                    if self._on_disconnect is not None:
                        self._on_disconnect(request)
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
