"""The gRPC server Envoy's ext_proc filter and health checker talk to: HTTP/2 (RFC 9113) over asyncio.

Why not grpc.aio: with the same Envoy in front, a do-nothing ext_proc servicer on grpc.aio cost 485-625 µs
of CPU per request and on this server 108-139 µs (docs/decisions.md). It serves what Envoy's gRPC
client sends (envoy_grpc: HTTP/2 with prior knowledge, unencrypted, over a Unix socket or TCP) and what
grpcio's own client sends (the tests, grpc_health_probe): unary and bidirectional streaming calls,
uncompressed messages, flow control both ways, CONTINUATION, padding, PING, RST_STREAM, GOAWAY. It
does not serve TLS, server push (never used by gRPC), compression (we advertise none) or grpc-timeout
(the ext_proc stream's own deadlines are Envoy's message_timeout and our prefill deadline).

One ``Connection`` per accepted socket owns its streams (``Call``); each call runs its handler in one
task, which a peer's RST_STREAM or a lost connection cancels, as grpc.aio cancels a servicer's task.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import stat
from collections import deque
from collections.abc import Awaitable, Callable
from typing import cast

from hpack import Decoder, HPACKError

from extproc.envoy import h2wire as w
from extproc.envoy.h2wire import Frame, H2Error, Setting, Status

log = logging.getLogger("extproc.server")

# What we advertise: a frame size that cuts a large body into few frames, and a stream window of one
# message at the limit (GrpcServer.stream_window), so the largest body arrives without waiting for a
# window update; a stream gets its window back only as its handler takes the messages.
FRAME_SIZE = 1 << 20
MAX_HEADER_LIST = 64 << 10
WINDOW_SLACK = 64 << 10
DRAIN_PING = b"h2drain\x00"  # the PING whose ACK tells that the peer has seen our first GOAWAY
DRAIN_ACK_WAIT = 1.0  # seconds stop() waits for that ACK before refusing new streams anyway
# A TCP peer gone without a FIN (its host died): probed after a minute of silence, dropped after 3 probes.
KEEPALIVE_IDLE, KEEPALIVE_INTERVAL, KEEPALIVE_PROBES = 60, 10, 3
DECODED_BLOCKS = 64  # header blocks remembered per connection (Envoy's differ only by :path)


class CallEnded(Exception):
    """The call is over (its stream was reset or its message refused): nothing more can be sent."""


class Call:
    """One gRPC call (an HTTP/2 stream) as its handler sees it: messages in, messages out."""

    __slots__ = (
        "_conn",
        "_messages",
        "_reader",
        "_remote_done",
        "_waiter",
        "ended",
        "head_sent",
        "held",
        "out",
        "path",
        "recv_unacked",
        "send_window",
        "stream_id",
        "task",
        "trailer",
    )

    def __init__(self, conn: Connection, stream_id: int, path: str) -> None:
        self.stream_id, self.path, self._conn = stream_id, path, conn
        self._messages: deque[bytearray] = deque()
        self._waiter: asyncio.Future[None] | None = None
        self._remote_done = False  # the peer ended its side (END_STREAM)
        self._reader = w.MessageReader(conn.server.max_message)
        self.task: asyncio.Task[None] | None = None
        self.send_window = conn.peer_initial_window
        self.out: deque[memoryview] = deque()  # message bytes not yet framed (flow control)
        self.head_sent = False
        self.trailer: bytes | None = None  # the trailers, once the handler returned, until out is empty
        self.ended = False  # no more frames for this stream
        self.recv_unacked = 0  # DATA bytes received that the peer's window has not had back
        self.held = 0  # bytes of whole messages the handler has not taken

    async def recv(self) -> bytearray | None:
        """The next message, or None once the peer ended its side."""
        while not self._messages:
            if self._remote_done:
                return None
            if self.ended:
                raise CallEnded(self.path)
            self._waiter = self._conn.loop.create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        message = self._messages.popleft()
        self.held -= len(message) + 5
        self._conn.window_back(self)
        return message

    def send(self, *parts: bytes) -> None:
        """Queue one message, given whole or in pieces written one after another (never joined); it
        leaves as the peer's flow-control windows allow."""
        if self.ended:
            raise CallEnded(self.path)
        if not self.head_sent:
            self.head_sent = True
            self._conn.write_headers(self.stream_id, w.RESPONSE_HEADERS, end=False)
        out = self.out
        out.append(memoryview(w.message_prefix(sum(map(len, parts)))))
        out.extend(memoryview(part) for part in parts if part)
        self._conn.drain(self)

    def wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def received(self, data: memoryview, end: bool) -> None:
        """Take a DATA payload (MessageError if a message breaks the rules)."""
        if data:
            for message in self._reader.feed(data):
                self._messages.append(message)
                self.held += len(message) + 5
        if end:
            self.remote_ended()
        else:
            self.wake()

    def remote_ended(self) -> None:
        """The peer ended its side (END_STREAM on DATA or on trailers)."""
        if self._reader.inside_message:
            raise w.MessageError(Status.INTERNAL, "the stream ended inside a message")
        self._remote_done = True
        self.wake()

    @property
    def remote_done(self) -> bool:
        return self._remote_done


Handler = Callable[[Call], Awaitable[tuple[int, str]]]


class Connection(asyncio.Protocol):
    """One HTTP/2 connection from Envoy (or a gRPC client): its frames, its streams, its windows."""

    def __init__(self, server: GrpcServer) -> None:
        self.server = server
        self.loop = asyncio.get_running_loop()
        self.transport: asyncio.Transport | None = None
        self._chunks: list[memoryview] = []  # an incomplete frame (or preface): views of the reads' bytes
        self._have = 0
        self._need = 0
        self._preface = False
        self._decoder = Decoder()
        self._decoder.max_header_list_size = MAX_HEADER_LIST
        # Header blocks that leave the table unchanged, by their bytes: Envoy sends the same block for
        # every ext_proc stream once its table is warm (decoding it costs ~25 µs).
        self._decoded: dict[bytes, list[tuple[bytes, bytes]]] = {}
        self.calls: dict[int, Call] = {}
        self.peer_initial_window = w.DEFAULT_WINDOW
        self.peer_max_frame = w.DEFAULT_FRAME
        self.send_window = w.DEFAULT_WINDOW
        self._recv_window = w.MAX_WINDOW  # what the peer may still send on the connection
        self._pending: list[bytes | memoryview] = []
        self._flush_scheduled = False
        self._block: bytearray | None = None  # a header block awaiting its CONTINUATION frames
        self._block_stream = 0
        self._block_end = False
        self.last_stream = 0
        self._blocked: dict[int, Call] = {}  # calls waiting for the connection's window
        self.refusing = False  # after our final GOAWAY or the peer's: new streams are refused
        self.drain_acked: asyncio.Future[None] | None = None  # stop(): the peer has seen our first GOAWAY
        self._table_update_due = False  # the peer changed HEADER_TABLE_SIZE: our next block says size 0

    # The output: frames gather during one pass of the loop and leave in one write.
    def _write(self, data: bytes | memoryview) -> None:
        self._pending.append(data)
        self._schedule_flush()

    def _schedule_flush(self) -> None:
        if not self._flush_scheduled:
            self._flush_scheduled = True
            self.loop.call_soon(self._flush)

    def _flush(self) -> None:
        self._flush_scheduled = False
        pending, self._pending = self._pending, []
        if pending and self.transport is not None and not self.transport.is_closing():
            self.transport.writelines(pending)

    def write_headers(self, stream_id: int, block: bytes, *, end: bool) -> None:
        # Our blocks are small (status, content-type, grpc-status, a grpc-message cut to 1 KiB).
        if self._table_update_due:  # RFC 7541 4.2: the first block after the peer's table changed says so
            self._table_update_due = False
            block = w.TABLE_SIZE_ZERO + block
        flags = w.END_HEADERS | (w.END_STREAM if end else 0)
        self._write(w.frame(Frame.HEADERS, flags, stream_id, block))

    def drain(self, call: Call) -> None:
        """Frame what the windows allow of a call's output; its trailers follow its last byte."""
        out, stream_id, frame_max = call.out, call.stream_id, self.peer_max_frame
        pack, pending = w.FRAME.pack, self._pending
        while out:
            allowed = min(self.send_window, call.send_window)
            if allowed <= 0:
                if self.send_window <= 0:
                    self._blocked[stream_id] = call
                return
            chunk = out.popleft()
            size = len(chunk)
            if size > allowed:
                out.appendleft(chunk[allowed:])
                chunk, size = chunk[:allowed], allowed
            self._schedule_flush()
            for start in range(0, size, frame_max):
                piece = chunk[start:start + frame_max]
                pending.append(pack(len(piece) << 8 | Frame.DATA, 0, stream_id))
                pending.append(piece)
            self.send_window -= size
            call.send_window -= size
        if call.trailer is not None:
            self.write_headers(call.stream_id, call.trailer, end=True)
            call.trailer = None
            if not call.remote_done:  # RFC 9113 8.1: the response is complete, the request need not be
                self._write(w.frame(Frame.RST_STREAM, 0, call.stream_id, w.UINT32.pack(H2Error.NO_ERROR)))
            self._forget(call)

    def window_back(self, call: Call) -> None:
        """Give the peer its stream window back once half of it is used and the handler holds less than
        half: a handler that does not take its messages stops the peer after one window."""
        half = self.server.stream_window // 2
        if call.recv_unacked > half and call.held < half and not call.remote_done and not call.ended:
            self._write(w.frame(Frame.WINDOW_UPDATE, 0, call.stream_id, w.UINT32.pack(call.recv_unacked)))
            call.recv_unacked = 0

    def finish(self, call: Call, status: int, message: str = "") -> None:
        """End a call with its status (trailers after any output still held by flow control)."""
        if call.ended or call.trailer is not None:
            return
        call.trailer = w.trailers(status, message, with_headers=not call.head_sent)
        call.head_sent = True
        self.drain(call)

    def reset(self, call: Call, code: H2Error) -> None:
        if not call.ended:
            self._write(w.frame(Frame.RST_STREAM, 0, call.stream_id, w.UINT32.pack(code)))
            self._forget(call)

    def _forget(self, call: Call) -> None:
        call.ended = True
        call.out.clear()
        call.wake()
        self.calls.pop(call.stream_id, None)
        self._blocked.pop(call.stream_id, None)
        if not self.calls:
            self.server.idle(self)

    def goaway(self, code: H2Error = H2Error.NO_ERROR) -> None:
        """The final GOAWAY: streams after the last one we saw are refused."""
        self.refusing = True
        if self.transport is not None:  # else connection_made sends it, after our SETTINGS
            self._write(w.frame(Frame.GOAWAY, 0, 0, w.UINT32.pack(self.last_stream) + w.UINT32.pack(code)))

    def announce_drain(self) -> asyncio.Future[None]:
        """The first of two GOAWAYs (RFC 9113 6.8): last stream 2^31-1, so streams already on their way
        are still served, and a PING; once its ACK is back, the peer has seen the GOAWAY and the final
        one refuses only streams opened after it."""
        self.drain_acked = self.loop.create_future()
        if self.transport is None:
            self.drain_acked.set_result(None)
        else:
            self._write(w.frame(Frame.GOAWAY, 0, 0, w.UINT32.pack(w.MAX_WINDOW) + w.UINT32.pack(H2Error.NO_ERROR)))
            self._write(w.frame(Frame.PING, 0, 0, DRAIN_PING))
        return self.drain_acked

    def close(self) -> None:
        self._flush()
        if self.transport is not None:
            self.transport.close()

    # asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's transports do not subclass asyncio's
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            _keepalive(sock)
        self._write(w.settings_frame({
            Setting.MAX_CONCURRENT_STREAMS: w.MAX_WINDOW, Setting.INITIAL_WINDOW_SIZE: self.server.stream_window,
            Setting.MAX_FRAME_SIZE: FRAME_SIZE, Setting.MAX_HEADER_LIST_SIZE: MAX_HEADER_LIST,
            Setting.ENABLE_PUSH: 0}))
        self._write(w.frame(Frame.WINDOW_UPDATE, 0, 0, w.UINT32.pack(w.MAX_WINDOW - w.DEFAULT_WINDOW)))
        if self.refusing:  # the server began to stop before this connection was set up
            self.goaway()

    def pause_writing(self) -> None:
        """The peer does not read what we write: stop reading what it sends (its PINGs and frames would
        each add to our output) until it catches up."""
        if self.transport is not None:
            self.transport.pause_reading()

    def resume_writing(self) -> None:
        if self.transport is not None:
            self.transport.resume_reading()

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        for call in list(self.calls.values()):
            call.ended = True
            call.wake()
            if call.task is not None:
                call.task.cancel()
        self.calls.clear()
        self._blocked.clear()
        if self.drain_acked is not None and not self.drain_acked.done():
            self.drain_acked.set_result(None)
        self.server.lost(self)

    def data_received(self, data: bytes) -> None:
        try:
            self._received(memoryview(data))
        except w.ConnectionError_ as error:
            log.warning("HTTP/2 connection error from Envoy's side; closing it", extra={
                "reason": str(error), "h2_error": error.code.name})
            self.goaway(error.code)
            self.close()
        except HPACKError as error:
            log.warning("HTTP/2 header block cannot be decoded; closing the connection",
                        extra={"reason": str(error)})
            self.goaway(H2Error.COMPRESSION_ERROR)
            self.close()

    def _received(self, view: memoryview) -> None:
        """The frames of one read. A frame cut by a read's end is joined once, alone; the rest is parsed
        where it lies (views of the reads' bytes, which never change)."""
        chunks = self._chunks
        while chunks:
            missing = self._need - self._have
            if len(view) < missing:
                chunks.append(view)
                self._have += len(view)
                return
            chunks.append(view[:missing])
            view = view[missing:]
            whole = memoryview(b"".join(chunks))
            chunks.clear()
            self._have = 0
            if not self._parse(whole):
                return
        if view:
            self._parse(view)

    def _parse(self, view: memoryview) -> bool:
        """Handle every whole frame of ``view`` and keep its incomplete tail; False once closing."""
        if not self._preface:
            if len(view) < len(w.PREFACE):
                if not w.PREFACE.startswith(view):
                    raise w.ConnectionError_(H2Error.PROTOCOL_ERROR, "not the HTTP/2 connection preface")
                return self._keep(view, len(w.PREFACE))
            if view[:len(w.PREFACE)] != w.PREFACE:
                raise w.ConnectionError_(H2Error.PROTOCOL_ERROR, "not the HTTP/2 connection preface")
            view = view[len(w.PREFACE):]
            self._preface = True
        offset, size = 0, len(view)
        while size - offset >= w.FRAME_HEAD:
            head = w.UINT32.unpack_from(view, offset)[0]
            length = head >> 8
            if length > FRAME_SIZE:
                raise w.ConnectionError_(H2Error.FRAME_SIZE_ERROR, f"a frame of {length} bytes")
            start = offset + w.FRAME_HEAD
            if start + length > size:
                return self._keep(view[offset:], w.FRAME_HEAD + length)
            stream_id = w.UINT32.unpack_from(view, offset + 5)[0] & 0x7FFFFFFF
            self._frame(head & 0xFF, view[offset + 4], stream_id, view[start:start + length])
            offset = start + length
            if self.transport is None or self.transport.is_closing():
                return False
        return offset == size or self._keep(view[offset:], w.FRAME_HEAD)

    def _keep(self, tail: memoryview, need: int) -> bool:
        self._chunks.append(tail)
        self._have, self._need = len(tail), need
        return True

    def _frame(self, kind: int, flags: int, stream_id: int, payload: memoryview) -> None:
        if self._block is not None and kind != Frame.CONTINUATION:
            raise w.ConnectionError_(H2Error.PROTOCOL_ERROR, "a header block interrupted")
        if kind == Frame.DATA:
            self._data(flags, stream_id, payload)
        elif kind == Frame.HEADERS:
            if stream_id == 0:
                raise w.ConnectionError_(H2Error.PROTOCOL_ERROR, "HEADERS on stream 0")
            self._block = bytearray(w.unpad(flags, payload, priority=True))
            if len(self._block) > MAX_HEADER_LIST * 2:
                raise w.ConnectionError_(H2Error.PROTOCOL_ERROR, "header block too large")
            self._block_stream, self._block_end = stream_id, bool(flags & w.END_STREAM)
            if flags & w.END_HEADERS:
                self._headers_done()
        elif kind == Frame.CONTINUATION:
            if self._block is None or stream_id != self._block_stream:
                raise w.ConnectionError_(H2Error.PROTOCOL_ERROR, "CONTINUATION without its HEADERS")
            self._block += payload
            if len(self._block) > MAX_HEADER_LIST * 2:
                raise w.ConnectionError_(H2Error.PROTOCOL_ERROR, "header block too large")
            if flags & w.END_HEADERS:
                self._headers_done()
        elif kind == Frame.SETTINGS:
            self._settings(flags, stream_id, payload)
        elif kind == Frame.WINDOW_UPDATE:
            self._window_update(stream_id, payload)
        elif kind == Frame.PING:
            if stream_id:
                raise w.ConnectionError_(H2Error.PROTOCOL_ERROR, "PING on a stream")
            if len(payload) != 8:
                raise w.ConnectionError_(H2Error.FRAME_SIZE_ERROR, "PING not 8 bytes")
            if not flags & w.ACK:
                self._write(w.frame(Frame.PING, w.ACK, 0, bytes(payload)))
            elif payload == DRAIN_PING and self.drain_acked is not None and not self.drain_acked.done():
                self.drain_acked.set_result(None)
        elif kind == Frame.RST_STREAM:
            if not stream_id:
                raise w.ConnectionError_(H2Error.PROTOCOL_ERROR, "RST_STREAM on stream 0")
            if len(payload) != 4:
                raise w.ConnectionError_(H2Error.FRAME_SIZE_ERROR, "RST_STREAM not 4 bytes")
            call = self.calls.get(stream_id)
            if call is not None:
                self._forget(call)
                if call.task is not None:
                    call.task.cancel()
        elif kind == Frame.GOAWAY:
            self.refusing = True
        elif kind == Frame.PUSH_PROMISE:
            raise w.ConnectionError_(H2Error.PROTOCOL_ERROR, "PUSH_PROMISE from a client")
        # PRIORITY and frame types this version does not know are ignored (RFC 9113 sections 5.3.2, 4.1).

    def _settings(self, flags: int, stream_id: int, payload: memoryview) -> None:
        if stream_id:
            raise w.ConnectionError_(H2Error.PROTOCOL_ERROR, "SETTINGS on a stream")
        if flags & w.ACK:
            return
        for key, value in w.parse_settings(payload):
            if key == Setting.INITIAL_WINDOW_SIZE:
                delta, self.peer_initial_window = value - self.peer_initial_window, value
                for call in self.calls.values():
                    call.send_window += delta
            elif key == Setting.MAX_FRAME_SIZE:
                self.peer_max_frame = value
            elif key == Setting.HEADER_TABLE_SIZE:
                self._table_update_due = True
        self._write(w.frame(Frame.SETTINGS, w.ACK, 0))
        for call in list(self.calls.values()):
            self.drain(call)

    def _window_update(self, stream_id: int, payload: memoryview) -> None:
        if len(payload) != 4:
            raise w.ConnectionError_(H2Error.FRAME_SIZE_ERROR, "WINDOW_UPDATE not 4 bytes")
        increment = w.UINT32.unpack_from(payload)[0] & 0x7FFFFFFF
        if stream_id == 0:
            if not increment:
                raise w.ConnectionError_(H2Error.PROTOCOL_ERROR, "WINDOW_UPDATE of 0")
            self.send_window += increment
            if self.send_window > w.MAX_WINDOW:
                raise w.ConnectionError_(H2Error.FLOW_CONTROL_ERROR, "connection window over 2^31-1")
            blocked, self._blocked = self._blocked, {}
            for waiting in blocked.values():
                self.drain(waiting)
            return
        call = self.calls.get(stream_id)
        if call is None:
            return
        if not increment:  # a stream error (section 6.9): this stream only
            self.reset(call, H2Error.PROTOCOL_ERROR)
            if call.task is not None:
                call.task.cancel()
            return
        call.send_window += increment
        self.drain(call)

    def _data(self, flags: int, stream_id: int, payload: memoryview) -> None:
        if stream_id == 0:
            raise w.ConnectionError_(H2Error.PROTOCOL_ERROR, "DATA on stream 0")
        size = len(payload)
        window = self._recv_window - size  # the connection's window counts every DATA frame, padding too
        if window < 0:
            raise w.ConnectionError_(H2Error.FLOW_CONTROL_ERROR, "DATA beyond the connection window")
        if window < w.MAX_WINDOW // 2:  # streams bound what we hold; the connection's is given back at once
            self._write(w.frame(Frame.WINDOW_UPDATE, 0, 0, w.UINT32.pack(w.MAX_WINDOW - window)))
            window = w.MAX_WINDOW
        self._recv_window = window
        call = self.calls.get(stream_id)
        if call is None or call.remote_done or call.trailer is not None:
            return  # a stream we ended, reset or refused: frames in flight are dropped
        call.recv_unacked += size
        if call.recv_unacked > self.server.stream_window:  # the peer ignores the window we gave
            self.reset(call, H2Error.FLOW_CONTROL_ERROR)
            if call.task is not None:
                call.task.cancel()
            return
        try:
            call.received(w.unpad(flags, payload) if flags & w.PADDED else payload, bool(flags & w.END_STREAM))
        except w.MessageError as error:
            self.finish(call, error.status, str(error))
            if call.task is not None:
                call.task.cancel()
            return
        if call.recv_unacked > self.server.stream_window // 2:
            self.window_back(call)

    def _headers_done(self) -> None:
        block, self._block = bytes(self._block or b""), None
        stream_id, end = self._block_stream, self._block_end
        fields = self._decoded.get(block)
        if fields is None:
            fields = list(self._decoder.decode(block, raw=True))
            if not w.table_unchanged(block):  # the bytes cached so far may now mean other headers
                self._decoded.clear()
            elif len(self._decoded) < DECODED_BLOCKS:
                self._decoded[block] = fields
        open_call = self.calls.get(stream_id)
        if open_call is not None:  # trailers from the peer: they must end its side
            if open_call.remote_done or open_call.trailer is not None:
                return
            try:
                if not end:
                    raise w.MessageError(Status.INTERNAL, "a second header block that does not end the stream")
                open_call.remote_ended()
            except w.MessageError as error:
                self.finish(open_call, error.status, str(error))
                if open_call.task is not None:
                    open_call.task.cancel()
            return
        if stream_id <= self.last_stream or not stream_id & 1:
            if stream_id & 1 and stream_id <= self.last_stream:
                return  # trailers of a stream we already ended
            raise w.ConnectionError_(H2Error.PROTOCOL_ERROR, f"new stream {stream_id} is not odd and rising")
        self.last_stream = stream_id
        headers = w.request_headers(fields)
        call = Call(self, stream_id, headers.path)
        if self.refusing:
            self._write(w.frame(Frame.RST_STREAM, 0, stream_id, w.UINT32.pack(H2Error.REFUSED_STREAM)))
            return
        self.calls[stream_id] = call
        if end:
            call.remote_ended()
        handler = self.server.handlers.get(headers.path)
        refusal = w.call_refusal(headers, handler is not None)
        if refusal is not None:
            self.finish(call, *refusal)
            return
        assert handler is not None
        call.task = self.loop.create_task(self._run(call, handler))

    async def _run(self, call: Call, handler: Handler) -> None:
        try:
            status, message = await handler(call)
        except (asyncio.CancelledError, CallEnded):
            # The call was reset or lost (nothing to send), or the handler met a CancelledError that was
            # not its own: the stream must still end, or the peer waits for it forever.
            if not call.ended and call.trailer is None:
                self.reset(call, H2Error.CANCEL)
            return
        except Exception:  # a handler's bug: the call fails, the connection and its other calls do not
            log.exception("gRPC handler failed", extra={"method": call.path})
            status, message = Status.UNKNOWN, "unexpected error in the handler"
        self.finish(call, status, message)


def _keepalive(sock: socket.socket) -> None:
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for option, value in (("TCP_KEEPIDLE", KEEPALIVE_IDLE), ("TCP_KEEPINTVL", KEEPALIVE_INTERVAL),
                          ("TCP_KEEPCNT", KEEPALIVE_PROBES)):
        if hasattr(socket, option):
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, option), value)


class GrpcServer:
    """Listens (a Unix socket or TCP), serves ``handlers`` by method path, stops with a grace period."""

    def __init__(self, handlers: dict[str, Handler], max_message: int) -> None:
        self.handlers, self.max_message = handlers, max_message
        self.stream_window = min(w.MAX_WINDOW, max_message + 5 + WINDOW_SLACK)
        self.connections: set[Connection] = set()
        self._listener: asyncio.AbstractServer | None = None
        self._unix_path: str | None = None
        self._idle: asyncio.Event | None = None

    def _connection(self) -> Connection:
        connection = Connection(self)
        self.connections.add(connection)
        return connection

    def idle(self, connection: Connection) -> None:
        if self._idle is not None and not any(c.calls for c in self.connections):
            self._idle.set()

    def lost(self, connection: Connection) -> None:
        self.connections.discard(connection)
        self.idle(connection)

    async def listen_unix(self, path: str) -> None:
        """A stale socket file from a server that did not stop is replaced (as grpc does); any other
        file at ``path`` is an error."""
        with contextlib.suppress(FileNotFoundError):
            if stat.S_ISSOCK(os.lstat(path).st_mode):
                os.unlink(path)
        self._listener = await asyncio.get_running_loop().create_unix_server(self._connection, path)
        self._unix_path = path

    async def listen_tcp(self, host: str, port: int) -> int:
        """The port bound (``port`` 0: one the kernel picks). ``::`` takes IPv4 too, as grpc's does."""
        loop = asyncio.get_running_loop()
        if host == "::":
            sock = socket.socket(socket.AF_INET6, socket.SOCK_STREAM)
            try:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
                sock.bind(("::", port))
            except OSError:
                sock.close()
                raise
            self._listener = await loop.create_server(self._connection, sock=sock)
        else:
            self._listener = await loop.create_server(self._connection, host, port)
        return int(self._listener.sockets[0].getsockname()[1])

    async def stop(self, grace: float) -> None:
        """No new calls (listener closed; GOAWAY to each connection, twice: the streams it sent before it
        saw the first are still served); the calls in flight get ``grace`` seconds, then are cancelled
        and the connections closed."""
        if self._listener is not None:
            self._listener.close()
        self._idle = asyncio.Event()
        acks = [connection.announce_drain() for connection in list(self.connections)]
        if acks:
            await asyncio.wait(acks, timeout=min(DRAIN_ACK_WAIT, max(grace, 0)))
        for connection in list(self.connections):
            connection.goaway()
        if any(c.calls for c in self.connections):
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._idle.wait(), max(grace, 0))
        for connection in list(self.connections):
            for call in list(connection.calls.values()):
                connection.reset(call, H2Error.CANCEL)
                if call.task is not None:
                    call.task.cancel()
            connection.close()
        if self._unix_path is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self._unix_path)
            self._unix_path = None
