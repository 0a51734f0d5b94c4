"""Our gRPC server's HTTP/2 (extproc/envoy/h2server.py) driven frame by frame by a raw client: the cases
grpcio's client and Envoy never produce in the other tests (CONTINUATION, padding, small peer windows,
resets, GOAWAY drain, a changed HPACK table). Each asserts what the handler received and what the client
read back, frame by frame."""

from __future__ import annotations

import asyncio
import functools
import itertools
import struct
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import NamedTuple

import pytest
from hpack import Decoder, Encoder

from extproc.envoy import h2wire as w
from extproc.envoy.h2server import Call, GrpcServer, Handler
from extproc.envoy.h2wire import Frame, H2Error, Status

GRPC_HEADERS = [(":method", "POST"), (":scheme", "http"), (":authority", "x"), ("content-type", "application/grpc"),
                ("te", "trailers")]


class Got(NamedTuple):
    kind: int
    flags: int
    stream: int
    payload: bytes


class RawClient:
    """An HTTP/2 client that writes the frames a test names and reads every frame back."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer
        self.encoder, self.decoder = Encoder(), Decoder()

    def send(self, kind: int, flags: int, stream: int, payload: bytes = b"") -> None:
        self.writer.write(w.frame(kind, flags, stream, payload))

    def headers(self, stream: int, path: str, *, end: bool = False) -> None:
        block = self.encoder.encode([*GRPC_HEADERS[:1], (":path", path), *GRPC_HEADERS[1:]])
        self.send(Frame.HEADERS, w.END_HEADERS | (w.END_STREAM if end else 0), stream, block)

    def message(self, stream: int, message: bytes, *, end: bool = False) -> None:
        self.send(Frame.DATA, w.END_STREAM if end else 0, stream, w.message_prefix(len(message)) + message)

    async def frame(self) -> Got:
        head = await self.reader.readexactly(9)
        length, kind = struct.unpack(">I", head[:4])[0] >> 8, head[3]
        stream = struct.unpack(">I", head[5:])[0] & 0x7FFFFFFF
        return Got(kind, head[4], stream, await self.reader.readexactly(length))

    async def until(self, stream: int, *, end: bool = True) -> tuple[list[Got], dict[bytes, bytes]]:
        """Frames of ``stream`` until END_STREAM or RST_STREAM (others answered or skipped); the last
        header block's fields."""
        got: list[Got] = []
        fields: dict[bytes, bytes] = {}
        while True:
            item = await self.frame()
            if item.kind == Frame.SETTINGS and not item.flags & w.ACK:
                self.send(Frame.SETTINGS, w.ACK, 0)
            if item.stream != stream:
                continue
            got.append(item)
            if item.kind == Frame.HEADERS:
                fields = dict(self.decoder.decode(item.payload, raw=True))
            ended = item.flags & w.END_STREAM and item.kind in (Frame.DATA, Frame.HEADERS)
            if item.kind == Frame.RST_STREAM or ended:
                return got, fields


def in_a_loop(test: Callable[..., Awaitable[None]]) -> Callable[..., None]:
    """Runs an async test in a fresh event loop; 30 s bounds a hang (not a timing assertion)."""
    @functools.wraps(test)
    def run(*args: object, **kwargs: object) -> None:
        asyncio.run(asyncio.wait_for(test(*args, **kwargs), 30))
    return run


def data_of(frames: list[Got]) -> bytes:
    return b"".join(f.payload for f in frames if f.kind == Frame.DATA)


def messages_of(frames: list[Got]) -> list[bytes]:
    data, out = data_of(frames), []
    while data:
        length = struct.unpack(">I", data[1:5])[0]
        out.append(data[5:5 + length])
        data = data[5 + length:]
    return out


@asynccontextmanager
async def serving(tmp_path: Path, handlers: dict[str, Handler], max_message: int = 1 << 20,
                  settings: bytes = b"") -> AsyncIterator[tuple[GrpcServer, RawClient]]:
    server = GrpcServer(handlers, max_message)
    path = str(tmp_path / "h2.sock")
    await server.listen_unix(path)
    reader, writer = await asyncio.open_unix_connection(path)
    client = RawClient(reader, writer)
    writer.write(w.PREFACE)
    client.send(Frame.SETTINGS, 0, 0, settings)
    try:
        yield server, client
    finally:
        writer.close()
        await server.stop(0)


def echo(seen: list[bytes]) -> Callable[[Call], Awaitable[tuple[int, str]]]:
    async def handler(call: Call) -> tuple[int, str]:
        while (message := await call.recv()) is not None:
            seen.append(message)
            call.send(message[::-1])
        return Status.OK, ""
    return handler


@in_a_loop
async def test_continuation_padding_and_a_message_across_frames(tmp_path: Path) -> None:
    seen: list[bytes] = []
    async with serving(tmp_path, {"/s/Echo": echo(seen)}) as (_, client):
        block = client.encoder.encode([*GRPC_HEADERS[:1], (":path", "/s/Echo"), *GRPC_HEADERS[1:]])
        client.send(Frame.HEADERS, w.PADDED, 1, bytes((3,)) + block[:4] + b"\0\0\0")
        client.send(Frame.CONTINUATION, 0, 1, block[4:6])
        client.send(Frame.CONTINUATION, w.END_HEADERS, 1, block[6:])
        framed = w.message_prefix(10) + b"0123456789"
        client.send(Frame.DATA, w.PADDED, 1, bytes((2,)) + framed[:7] + b"\0\0")
        client.send(Frame.DATA, w.END_STREAM, 1, framed[7:])
        frames, trailers = await client.until(1)
    assert seen == [b"0123456789"]
    assert messages_of(frames) == [b"9876543210"]
    assert trailers[b"grpc-status"] == b"0"


@in_a_loop
async def test_output_waits_for_the_peers_stream_window_and_trailers_follow_it(tmp_path: Path) -> None:
    seen: list[bytes] = []
    settings = struct.pack(">HI", w.Setting.INITIAL_WINDOW_SIZE, 100)
    async with serving(tmp_path, {"/s/Echo": echo(seen)}, settings=settings) as (_, client):
        client.headers(1, "/s/Echo")
        client.message(1, bytes(range(250)) * 4, end=True)
        first: list[Got] = []
        while sum(len(f.payload) for f in first if f.kind == Frame.DATA) < 100:
            item = await client.frame()
            if item.stream == 1:
                first.append(item)
        assert len(data_of(first)) == 100 and all(f.kind != Frame.HEADERS or not f.flags & w.END_STREAM for f in first)
        client.send(Frame.WINDOW_UPDATE, 0, 1, struct.pack(">I", 5000))
        rest, trailers = await client.until(1)
    assert messages_of(first + rest) == [(bytes(range(250)) * 4)[::-1]]
    assert trailers[b"grpc-status"] == b"0"


@in_a_loop
async def test_a_message_sent_in_pieces_arrives_whole_through_a_small_window(tmp_path: Path) -> None:
    async def pieces(call: Call) -> tuple[int, str]:
        message = await call.recv()
        assert message is not None
        call.send(message[:3], b"", message[3:150], message[150:])
        return Status.OK, ""

    settings = struct.pack(">HI", w.Setting.INITIAL_WINDOW_SIZE, 64)
    async with serving(tmp_path, {"/s/Pieces": pieces}, settings=settings) as (_, client):
        client.headers(1, "/s/Pieces")
        client.message(1, bytes(range(200)), end=True)
        got: list[Got] = []
        while True:
            item = await client.frame()
            if item.stream != 1:
                continue
            got.append(item)
            if item.kind == Frame.HEADERS and item.flags & w.END_STREAM:
                break
            if item.kind == Frame.DATA and sum(len(f.payload) for f in got if f.kind == Frame.DATA) % 64 == 0:
                client.send(Frame.WINDOW_UPDATE, 0, 1, struct.pack(">I", 64))
    assert messages_of(got) == [bytes(range(200))]
    assert all(len(f.payload) <= 64 for f in got if f.kind == Frame.DATA)


@in_a_loop
async def test_a_stream_gets_its_window_back_only_as_its_handler_takes_the_messages(tmp_path: Path) -> None:
    take = asyncio.Event()
    taken: list[bytes] = []

    async def slow(call: Call) -> tuple[int, str]:
        await take.wait()
        while (message := await call.recv()) is not None:
            taken.append(message)
        return Status.OK, ""

    async with serving(tmp_path, {"/s/Slow": slow}, max_message=100) as (server, client):
        half = server.stream_window // 2
        count = half // 105 + 10  # past half the window, within it
        client.headers(1, "/s/Slow")
        for _ in range(count):
            client.message(1, b"m" * 100)
        client.send(Frame.PING, 0, 0, b"pingpong")  # answered after every frame before it was read
        updates = []
        while not ((item := await client.frame()).kind == Frame.PING and item.flags & w.ACK):
            if item.kind == Frame.WINDOW_UPDATE and item.stream == 1:
                updates.append(item)
        assert updates == []  # the handler took nothing: the peer is held to its window
        take.set()
        while not ((item := await client.frame()).kind == Frame.WINDOW_UPDATE and item.stream == 1):
            pass
        assert struct.unpack(">I", item.payload)[0] == count * 105
        client.send(Frame.DATA, w.END_STREAM, 1)
        await client.until(1)
    assert taken == [b"m" * 100] * count


@in_a_loop
async def test_a_reset_cancels_the_handler_and_nothing_more_is_sent(tmp_path: Path) -> None:
    outcome: asyncio.Future[str] = asyncio.get_running_loop().create_future()
    started = asyncio.Event()

    async def hold(call: Call) -> tuple[int, str]:
        await call.recv()
        started.set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            outcome.set_result("cancelled")
            raise
        return Status.OK, ""

    async with serving(tmp_path, {"/s/Hold": hold, "/s/Echo": echo([])}) as (_, client):
        client.headers(1, "/s/Hold")
        client.message(1, b"x")
        await started.wait()
        client.send(Frame.RST_STREAM, 0, 1, struct.pack(">I", H2Error.CANCEL))
        assert await outcome == "cancelled"
        client.headers(3, "/s/Echo")  # the connection still serves
        client.message(3, b"ab", end=True)
        frames, trailers = await client.until(3)
    assert messages_of(frames) == [b"ba"] and trailers[b"grpc-status"] == b"0"


@in_a_loop
async def test_a_message_over_the_limit_ends_the_call_with_resource_exhausted(tmp_path: Path) -> None:
    seen: list[bytes] = []
    async with serving(tmp_path, {"/s/Echo": echo(seen)}, max_message=16) as (_, client):
        client.headers(1, "/s/Echo")
        client.message(1, b"y" * 17, end=True)
        frames, trailers = await client.until(1)
    assert seen == [] and data_of(frames) == b""
    assert trailers[b"grpc-status"] == b"%d" % Status.RESOURCE_EXHAUSTED


@in_a_loop
async def test_an_unknown_method_gets_unimplemented_trailers_only(tmp_path: Path) -> None:
    async with serving(tmp_path, {"/s/Echo": echo([])}) as (_, client):
        client.headers(1, "/s/Nope", end=True)
        frames, fields = await client.until(1)
    assert [f.kind for f in frames] == [Frame.HEADERS]
    assert fields[b":status"] == b"200" and fields[b"grpc-status"] == b"%d" % Status.UNIMPLEMENTED
    assert fields[b"grpc-message"] == b"unknown method /s/Nope"


@in_a_loop
async def test_a_failing_handler_gets_unknown_and_the_connection_lives(tmp_path: Path) -> None:
    async def broken(call: Call) -> tuple[int, str]:
        raise RuntimeError("bug")

    async with serving(tmp_path, {"/s/Broken": broken, "/s/Echo": echo([])}) as (_, client):
        client.headers(1, "/s/Broken", end=True)
        _, fields = await client.until(1)
        client.headers(3, "/s/Echo")
        client.message(3, b"ok", end=True)
        frames, _ = await client.until(3)
    assert fields[b"grpc-status"] == b"%d" % Status.UNKNOWN
    assert messages_of(frames) == [b"ko"]


@in_a_loop
async def test_ping_is_answered_with_its_payload(tmp_path: Path) -> None:
    async with serving(tmp_path, {}) as (_, client):
        client.send(Frame.PING, 0, 0, b"12345678")
        while (item := await client.frame()).kind != Frame.PING:
            pass
    assert item.flags == w.ACK and item.payload == b"12345678"


@in_a_loop
async def test_a_wrong_preface_gets_goaway_protocol_error(tmp_path: Path) -> None:
    server = GrpcServer({}, 1024)
    path = str(tmp_path / "h2.sock")
    await server.listen_unix(path)
    reader, writer = await asyncio.open_unix_connection(path)
    writer.write(b"GET / HTTP/1.1\r\n\r\n")  # shorter than the preface: refused at once all the same
    client = RawClient(reader, writer)
    kinds = []
    while (item := await client.frame()).kind != Frame.GOAWAY:
        kinds.append(item.kind)
    assert struct.unpack(">I", item.payload[4:8])[0] == H2Error.PROTOCOL_ERROR
    assert await reader.read() == b""  # closed
    writer.close()
    await server.stop(0)


@in_a_loop
async def test_stop_serves_streams_sent_before_the_peer_saw_it_refuses_later_ones_then_cancels(
        tmp_path: Path) -> None:
    """Two GOAWAYs (RFC 9113 6.8): the first (last stream 2^31-1) with a PING; a stream the peer opens
    before it answers the PING is served; the final GOAWAY names it, and a stream after it is refused."""
    release = asyncio.Event()
    started = {1: asyncio.Event(), 3: asyncio.Event(), 5: asyncio.Event()}
    cancelled: list[int] = []

    async def hold(call: Call) -> tuple[int, str]:
        await call.recv()
        started[call.stream_id].set()
        try:
            if call.stream_id == 1:
                await release.wait()
            else:
                await asyncio.Event().wait()
        except asyncio.CancelledError:
            cancelled.append(call.stream_id)
            raise
        call.send(b"done")
        return Status.OK, ""

    server = GrpcServer({"/s/Hold": hold}, 1024)
    path = str(tmp_path / "h2.sock")
    await server.listen_unix(path)
    reader, writer = await asyncio.open_unix_connection(path)
    client = RawClient(reader, writer)
    writer.write(w.PREFACE)
    client.send(Frame.SETTINGS, 0, 0)
    for stream in (1, 3):
        client.headers(stream, "/s/Hold")
        client.message(stream, b"x", end=True)
    await started[1].wait()
    await started[3].wait()
    stopping = asyncio.create_task(server.stop(3600))
    while (item := await client.frame()).kind != Frame.GOAWAY:
        pass
    assert struct.unpack(">II", item.payload) == (2**31 - 1, H2Error.NO_ERROR)
    while (ping := await client.frame()).kind != Frame.PING:
        pass
    client.headers(5, "/s/Hold")  # on its way before the peer saw the GOAWAY: served
    client.message(5, b"x", end=True)
    await started[5].wait()
    client.send(Frame.PING, w.ACK, 0, ping.payload)
    while (item := await client.frame()).kind != Frame.GOAWAY:
        pass
    assert struct.unpack(">II", item.payload) == (5, H2Error.NO_ERROR)
    client.headers(7, "/s/Hold", end=True)
    while (item := await client.frame()).stream != 7:
        pass
    assert item.kind == Frame.RST_STREAM and struct.unpack(">I", item.payload)[0] == H2Error.REFUSED_STREAM
    release.set()
    frames, trailers = await client.until(1)
    assert messages_of(frames) == [b"done"] and trailers[b"grpc-status"] == b"0"
    assert not stopping.done()  # streams 3 and 5 are still in flight: the grace (an hour) is not over
    stopping.cancel()
    await server.stop(0)
    frames, _ = await client.until(3)
    assert frames[-1].kind == Frame.RST_STREAM
    frames, _ = await client.until(5)
    assert frames[-1].kind == Frame.RST_STREAM and sorted(cancelled) == [3, 5]
    writer.close()


@in_a_loop
async def test_a_changed_hpack_table_is_never_read_from_the_cache(tmp_path: Path) -> None:
    """The server caches header blocks that leave the table unchanged. Here the same indexed bytes name
    /s/A, then, after a block that empties and refills the dynamic table, /s/B: the second time they must
    be decoded again."""
    paths: list[str] = []

    async def record(call: Call) -> tuple[int, str]:
        paths.append(call.path)
        return Status.OK, ""

    content_type = b"\x5f\x10application/grpc"  # literal with incremental indexing, name: static 31

    def path(value: bytes) -> bytes:  # literal with incremental indexing, name: static 4 (:path)
        return b"\x44" + bytes((len(value),)) + value

    fill_a = b"\x83\x86" + content_type + path(b"/s/A")  # table: 62 :path /s/A, 63 content-type
    indexed = b"\x83\x86\xbe\xbf"  # POST, http, dynamic 62, dynamic 63
    refill_b = b"\x20\x3f\xe1\x1f" + b"\x83\x86" + content_type + path(b"/s/B")  # size 0, 4096: emptied
    assert w.table_unchanged(indexed) and not w.table_unchanged(refill_b)
    async with serving(tmp_path, {"/s/A": record, "/s/B": record}) as (_, client):
        for stream, block in zip((1, 3, 5, 7), (fill_a, indexed, refill_b, indexed), strict=True):
            client.send(Frame.HEADERS, w.END_HEADERS | w.END_STREAM, stream, block)
            await client.until(stream)
    assert paths == ["/s/A", "/s/A", "/s/B", "/s/B"]


# Envoy 1.40's ext_proc stream headers once its table is warm (recorded): :path and :authority as literals
# (never indexed), the rest indexed.
ENVOY_BLOCK = bytes.fromhex("8304a560b5773fa5d05b3b98855cbe5315761c8bf7657c1e525b2a1d1aec390a841ec635d872"
                            "1508c286c1c0bfbe")


@pytest.mark.parametrize("block,unchanged", [
    (ENVOY_BLOCK, True),
    (b"\x82\x86\x84", True),  # indexed only
    (b"\x00\x03abc\x01z", True),  # literal without indexing, new name
    (b"\x10\x03abc\x01z", True),  # never indexed, new name
    (b"\x0f\x10\x03abc", True),  # without indexing, name index 31 (a multi-byte integer)
    (b"\x44\x02/a", False),  # incremental indexing
    (b"\x82\x20", False),  # a table size update
    (b"\x00\x03ab", False),  # cut short
    (b"\x04\x85abc", False),  # a value longer than the block
])
def test_which_header_blocks_leave_the_table_unchanged(block: bytes, unchanged: bool) -> None:
    assert w.table_unchanged(block) is unchanged


@pytest.mark.parametrize("message,encoded", [("plain text", b"plain text"), ("50% off", b"50%25 off"),
                                             ("naïve\n", b"na%C3%AFve%0A")])
def test_grpc_message_is_percent_encoded(message: str, encoded: bytes) -> None:
    assert dict(Decoder().decode(w.trailers(13, message), raw=True))[b"grpc-message"] == encoded


class RecordingTransport:
    """What a Connection writes, with no socket: the read side is driven by calling data_received."""

    def __init__(self) -> None:
        self.written: list[bytes] = []
        self.closed = False
        self.reading = True

    def get_extra_info(self, name: str) -> None:
        return None

    def pause_reading(self) -> None:
        self.reading = False

    def resume_reading(self) -> None:
        self.reading = True

    def writelines(self, data: list[bytes | memoryview]) -> None:
        self.written.extend(bytes(item) for item in data)

    def is_closing(self) -> bool:
        return self.closed

    def close(self) -> None:
        self.closed = True


def _a_request_as_bytes() -> bytes:
    """Preface, SETTINGS, one call's HEADERS and two messages over three DATA frames, END_STREAM."""
    block = Encoder().encode([*GRPC_HEADERS[:1], (":path", "/s/Echo"), *GRPC_HEADERS[1:]])
    data = w.message_prefix(3) + b"abc" + w.message_prefix(40) + bytes(range(40))
    return (w.PREFACE + w.frame(Frame.SETTINGS, 0, 0) + w.frame(Frame.HEADERS, w.END_HEADERS, 1, block)
            + w.frame(Frame.DATA, 0, 1, data[:6]) + w.frame(Frame.DATA, 0, 1, data[6:30])
            + w.frame(Frame.DATA, w.END_STREAM, 1, data[30:]))


@pytest.mark.parametrize("cuts", [[n] for n in range(1, 130, 3)] + [list(range(1, 200))],
                         ids=lambda cuts: f"cut at {cuts[0]}" if len(cuts) == 1 else "byte by byte")
def test_frames_cut_anywhere_by_reads_are_read_whole(cuts: list[int]) -> None:
    wire = _a_request_as_bytes()

    async def drive() -> list[bytes]:
        seen: list[bytes] = []
        finished = asyncio.Event()
        answer = echo(seen)

        async def handler(call: Call) -> tuple[int, str]:
            outcome = await answer(call)
            finished.set()
            return outcome

        server = GrpcServer({"/s/Echo": handler}, 1024)
        connection = server._connection()
        transport = RecordingTransport()
        connection.connection_made(transport)  # type: ignore[arg-type]
        edges = [0, *(cut for cut in cuts if cut < len(wire)), len(wire)]
        for start, end in itertools.pairwise(edges):
            connection.data_received(wire[start:end])
        await asyncio.wait_for(finished.wait(), 10)  # the handler read the end of the stream
        assert not transport.closed
        return seen

    assert asyncio.run(drive()) == [b"abc", bytes(range(40))]


def test_a_peer_that_does_not_read_is_not_read_either() -> None:
    async def drive() -> list[bool]:
        connection = GrpcServer({}, 1024)._connection()
        transport = RecordingTransport()
        connection.connection_made(transport)  # type: ignore[arg-type]
        states = [transport.reading]
        connection.pause_writing()
        states.append(transport.reading)
        connection.resume_writing()
        return [*states, transport.reading]

    assert asyncio.run(drive()) == [True, False, True]


@in_a_loop
async def test_a_partial_message_never_keeps_the_window_closed(tmp_path: Path) -> None:
    """The peer fills the window with one message and the start of the next; once the handler takes the
    first, the window must come back, or the second could never arrive."""
    take = asyncio.Event()
    taken: list[bytes] = []

    async def slow(call: Call) -> tuple[int, str]:
        await take.wait()
        while (message := await call.recv()) is not None:
            taken.append(bytes(message))
        return Status.OK, ""

    first, second = b"a" * 100000, b"b" * 100000
    async with serving(tmp_path, {"/s/Slow": slow}, max_message=100000) as (server, client):
        client.headers(1, "/s/Slow")
        client.message(1, first)
        rest = w.message_prefix(len(second)) + second
        cut = server.stream_window - (len(first) + 5)  # all the window allows
        client.send(Frame.DATA, 0, 1, rest[:cut])
        take.set()
        while not ((item := await client.frame()).kind == Frame.WINDOW_UPDATE and item.stream == 1):
            pass
        client.send(Frame.DATA, w.END_STREAM, 1, rest[cut:])
        _, trailers = await client.until(1)
    assert taken == [first, second] and trailers[b"grpc-status"] == b"0"


@in_a_loop
async def test_a_peer_that_ignores_the_stream_window_gets_its_stream_reset(tmp_path: Path) -> None:
    async def idle(call: Call) -> tuple[int, str]:
        await asyncio.Event().wait()
        return Status.OK, ""

    async with serving(tmp_path, {"/s/Idle": idle}, max_message=100) as (server, client):
        client.headers(1, "/s/Idle")
        for _ in range(server.stream_window // 105 + 1):
            client.message(1, b"m" * 100)
        frames, _ = await client.until(1)
    assert frames[-1].kind == Frame.RST_STREAM
    assert struct.unpack(">I", frames[-1].payload)[0] == H2Error.FLOW_CONTROL_ERROR


@in_a_loop
async def test_a_cancelled_error_that_is_not_the_calls_own_still_ends_the_stream(tmp_path: Path) -> None:
    async def awaits_a_cancelled_future(call: Call) -> tuple[int, str]:
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        future.cancel()
        await future
        return Status.OK, ""

    async with serving(tmp_path, {"/s/Stray": awaits_a_cancelled_future}) as (server, client):
        client.headers(1, "/s/Stray", end=True)
        frames, _ = await client.until(1)
        assert not next(iter(server.connections)).calls
    assert frames[-1].kind == Frame.RST_STREAM and struct.unpack(">I", frames[-1].payload)[0] == H2Error.CANCEL


@in_a_loop
async def test_after_the_peer_changes_its_table_size_our_next_block_says_size_0(tmp_path: Path) -> None:
    settings = struct.pack(">HI", w.Setting.HEADER_TABLE_SIZE, 0)
    async with serving(tmp_path, {"/s/Echo": echo([])}, settings=settings) as (_, client):
        client.headers(1, "/s/Echo")
        client.message(1, b"x", end=True)
        first, _ = await client.until(1)
        client.headers(3, "/s/Echo")
        client.message(3, b"y", end=True)
        second, _ = await client.until(3)
    blocks = [f.payload for f in first + second if f.kind == Frame.HEADERS]
    assert [block[:1] for block in blocks] == [w.TABLE_SIZE_ZERO, b"\x00", b"\x88", b"\x00"]


@in_a_loop
async def test_a_header_block_over_the_limit_closes_the_connection(tmp_path: Path) -> None:
    async with serving(tmp_path, {}) as (_, client):
        client.send(Frame.HEADERS, w.END_HEADERS, 1, b"\x00\x01a" + b"\x7f\x81\x80\x08" + b"v" * (130 << 10))
        while (item := await client.frame()).kind != Frame.GOAWAY:
            pass
    assert struct.unpack(">I", item.payload[4:])[0] == H2Error.PROTOCOL_ERROR
