"""A small asyncio HTTP/1.1 server on h11, for our /metrics, /healthz and /readyz.

Requests in, one complete response each out, keep-alive. The emulated engines extend it
(pd_extproc_lab/emulator/http.py) with streaming, disconnect detection and deliberate misbehaviour; none of
that is here.
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

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


class HttpServer:
    def __init__(self, handler: Callable[[Request], Awaitable[Any]], max_body: int = 64 << 20) -> None:
        self._handler = handler
        self._max_body = max_body
        self._server: asyncio.Server | None = None
        self._connections: set[asyncio.Task[None]] = set()

    async def start(self, host: str, port: int, tls: ssl.SSLContext | None = None) -> int:
        self._server = await asyncio.start_server(self._serve, host, port, limit=1 << 20, backlog=4096, ssl=tls)
        return int(self._server.sockets[0].getsockname()[1])

    async def start_unix(self, path: str) -> None:
        """On a Unix socket (a worker's private endpoint, scraped by its supervisor)."""
        self._server = await asyncio.start_unix_server(self._serve, path, limit=1 << 20, backlog=64)

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

    async def _run_handler(self, request: Request, reader: asyncio.StreamReader, conn: h11.Connection) -> Any:
        """The handler's reply (None ends the connection)."""
        return await self._handler(request)

    async def _write_reply(self, conn: h11.Connection, reader: asyncio.StreamReader,
                           writer: asyncio.StreamWriter, request: Request, reply: Any) -> bool:
        """Write a reply; False ends the connection."""
        assert isinstance(reply, Response)
        await write_response(conn, writer, reply)
        return True


async def write_response(conn: h11.Connection, writer: asyncio.StreamWriter, reply: Response) -> None:
    headers = [("content-type", reply.content_type), ("content-length", str(len(reply.body))), *reply.headers]
    writer.write(conn.send(h11.Response(status_code=reply.status, headers=headers)) or b"")
    writer.write(conn.send(h11.Data(data=reply.body)) or b"")
    writer.write(conn.send(h11.EndOfMessage()) or b"")
    await writer.drain()
