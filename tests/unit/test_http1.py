"""extproc/upstream/http1.py, the prefill leg's HTTP/1.1 connection, fed bytes directly (no sockets)."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import pytest

from extproc.upstream import http1

CAP = 1024


class FakeTransport:
    def __init__(self) -> None:
        self.written = b""
        self.closing = False
        self.paused = False

    def write(self, data: bytes) -> None:
        self.written += data

    def close(self) -> None:
        self.closing = True

    def is_closing(self) -> bool:
        return self.closing

    def pause_reading(self) -> None:
        self.paused = True

    def resume_reading(self) -> None:
        self.paused = False


class FedConnection(http1.Connection):
    """A connection whose peer sends the next piece only when the reader waits for more bytes, so a
    reader that needs several pieces sees each one arrive on its own (then EOF, or a reset)."""

    def __init__(self, pieces: Sequence[bytes], end: str | None) -> None:
        super().__init__()
        self.pieces = list(pieces)
        self.end = end
        self.waits = 0  # how often the reader waited for more bytes

    async def _more(self, gap: float) -> None:
        self.waits += 1
        loop = asyncio.get_running_loop()
        if self.pieces:
            loop.call_soon(self.data_received, self.pieces.pop(0))
        elif self.end == "eof":
            loop.call_soon(self.eof_received)
        elif self.end == "reset":
            loop.call_soon(self.connection_lost, ConnectionResetError())
        await super()._more(gap)


def _exchange(pieces: Sequence[bytes], close_after: bool = False, cap: int = CAP, end: str | None = None
              ) -> tuple[FedConnection, http1.Head, bytes]:
    """Read one response from a peer that sends ``pieces`` one at a time (then EOF, if asked)."""

    async def run() -> tuple[FedConnection, http1.Head, bytes]:
        connection = FedConnection(pieces, "eof" if close_after else end)
        connection.connection_made(FakeTransport())  # type: ignore[arg-type]
        head = await connection.read_head(gap=30)
        body = await connection.read_body(head, cap, gap=30)
        return connection, head, body

    return asyncio.run(run())


def _bytewise(data: bytes) -> list[bytes]:
    return [data[i:i + 1] for i in range(len(data))]


def test_a_request_carries_exactly_its_headers_host_and_length() -> None:
    request = http1.encode_request("POST", "/v1/completions?x=%2F", "prefill:8100",
                                   [("content-type", "application/json"), ("x-request-id", "abc")], b"{}")
    assert request == (b"POST /v1/completions?x=%2F HTTP/1.1\r\nhost: prefill:8100\r\ncontent-type: application/json"
                       b"\r\nx-request-id: abc\r\ncontent-length: 2\r\n\r\n{}")
    assert b"content-length" not in http1.encode_request("GET", "/server_info", "p:1", [], None)


@pytest.mark.parametrize("name,value", [("x-a", "v\r\nx-injected: 1"), ("x-a\n", "v")])
def test_a_newline_in_a_header_is_refused(name: str, value: str) -> None:
    with pytest.raises(ValueError):
        http1.encode_request("POST", "/", "p:1", [(name, value)], b"")


RESPONSE = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 11\r\n\r\n{\"ok\":true}"


@pytest.mark.parametrize("split", ["whole", "bytewise"])
def test_a_content_length_body_is_read_whole_and_the_connection_reused(split: str) -> None:
    connection, head, body = _exchange([RESPONSE] if split == "whole" else _bytewise(RESPONSE))
    assert (head.status, head.get("content-type"), body) == (200, "application/json", b'{"ok":true}')
    assert connection.reusable and connection.usable
    assert connection.waits == (1 if split == "whole" else len(RESPONSE))  # every byte arrived alone


CHUNKED = (b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n"
           b"4;ext=1\r\n{\"a\"\r\n5\r\n:1,\"b\r\n4\r\n\":2}\r\n0\r\nx-trailer: t\r\n\r\n")


@pytest.mark.parametrize("split", ["whole", "bytewise"])
def test_a_chunked_body_is_decoded_with_its_trailers_skipped(split: str) -> None:
    connection, _, body = _exchange([CHUNKED] if split == "whole" else _bytewise(CHUNKED))
    assert body == b'{"a":1,"b":2}'
    assert connection.reusable
    assert connection.waits == (1 if split == "whole" else len(CHUNKED))


def test_interim_responses_are_skipped() -> None:
    _, head, body = _exchange([b"HTTP/1.1 100 Continue\r\n\r\n" + RESPONSE])
    assert (head.status, body) == (200, b'{"ok":true}')


def test_a_body_to_the_end_of_the_connection_is_read_and_the_connection_not_reused() -> None:
    connection, _, body = _exchange([b"HTTP/1.1 200 OK\r\n\r\n{}", b"[]"], close_after=True)
    assert body == b"{}[]" and not connection.reusable


def test_a_reset_ends_a_body_framed_by_the_connection_end_as_an_error_not_a_short_body() -> None:
    with pytest.raises(http1.ConnectionClosed):
        _exchange([b"HTTP/1.1 200 OK\r\n\r\n{\"partial\"", b":"], end="reset")


def test_a_large_response_read_in_one_piece_leaves_the_pooled_connection_reading() -> None:
    """Over MAX_HEAD_BYTES in one read pauses reading while the head is read; the body was all there,
    so nothing asked for more: a connection left paused would never see the worker close it."""
    body = b"x" * (http1.MAX_HEAD_BYTES + 1)
    response = b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n" % len(body) + body
    connection, _, read = _exchange([response], cap=len(body))
    assert read == body and connection.reusable
    assert connection.transport is not None and not connection.transport.paused  # type: ignore[attr-defined]


def test_a_response_framed_by_both_chunked_and_content_length_is_read_but_not_reused() -> None:
    response = (b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\ncontent-length: 99\r\n\r\n"
                b"2\r\n{}\r\n0\r\n\r\n")
    connection, _, body = _exchange([response])
    assert body == b"{}" and not connection.reusable


@pytest.mark.parametrize("response,reusable", [
    (b"HTTP/1.1 200 OK\r\nconnection: close\r\ncontent-length: 0\r\n\r\n", False),
    (b"HTTP/1.0 200 OK\r\ncontent-length: 0\r\n\r\n", False),
    (b"HTTP/1.0 200 OK\r\nconnection: keep-alive\r\ncontent-length: 0\r\n\r\n", True),
    (b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\nHTTP/1.1 200 OK", False),  # bytes nobody asked for
])
def test_only_a_keep_alive_response_read_exactly_leaves_a_reusable_connection(response: bytes, reusable: bool) -> None:
    connection, _, _ = _exchange([response])
    assert connection.reusable is reusable


@pytest.mark.parametrize("response", [
    b"HTTP/1.1 200 OK\r\ncontent-length: 2000\r\n\r\n",  # refused on the header, before any body byte
    b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n" + (b"200\r\n" + b"x" * 0x200 + b"\r\n") * 3,
    b"HTTP/1.1 200 OK\r\n\r\n" + b"x" * 2000,
])
def test_a_body_over_the_cap_is_refused(response: bytes) -> None:
    with pytest.raises(http1.BodyTooLarge):
        _exchange([response], close_after=True)


@pytest.mark.parametrize("response,error", [
    (b"HTTP/1.1 200 OK\r\ncontent-length: 11\r\n\r\n{\"ok\"", http1.ConnectionClosed),
    (b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n4\r\n{\"a\"", http1.ConnectionClosed),
    (b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\nzz\r\n", http1.ProtocolError),
    (b"HTTP/1.1 200 OK\r\ntransfer-encoding: gzip\r\n\r\n", http1.ProtocolError),
    (b"HTTP/1.1 200 OK\r\ntransfer-encoding: gzip, chunked\r\n\r\n0\r\n\r\n", http1.ProtocolError),
    (b"HTTP/1.1 200 OK\r\ntransfer-encoding: gzip\r\ntransfer-encoding: chunked\r\n\r\n0\r\n\r\n",
     http1.ProtocolError),
    (b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n0x2\r\n{}\r\n0\r\n\r\n", http1.ProtocolError),
    (b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n-0\r\n\r\n", http1.ProtocolError),
    (b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n1" + b"0" * (http1.MAX_LINE_BYTES + 1) + b"\r\n",
     http1.ProtocolError),
    (b"HTTP/1.1 200 OK\r\ncontent-length: \xb2\r\n\r\n", http1.ProtocolError),  # latin-1 "2", isdigit()
    (b"HTTP/1.1 200 OK\r\ncontent-length: " + b"9" * 5000 + b"\r\n\r\n", http1.ProtocolError),
    (b"HTTP/1.1 200 OK\r\ncontent-length: 1\r\ncontent-length: 2\r\n\r\nab", http1.ProtocolError),
    (b"HTTP/1.1 200 OK\r\ncontent-length: -1\r\n\r\n", http1.ProtocolError),
])
def test_a_broken_body_is_an_error(response: bytes, error: type[Exception]) -> None:
    with pytest.raises(error):
        _exchange([response], close_after=True)


@pytest.mark.parametrize("response,error", [
    (b"", http1.ConnectionClosed),
    (b"HTTP/1.1 20", http1.ConnectionClosed),
    (b"SSH-2.0-OpenSSH\r\n\r\n", http1.ProtocolError),
    (b"HTTP/1.1 200 OK\r\nno colon here\r\n\r\n", http1.ProtocolError),
    (b"HTTP/1.1 200 OK\r\nx: " + b"y" * (http1.MAX_HEAD_BYTES + 1), http1.ProtocolError),
    (b"HTTP/1.1 200 OK\r\nx: " + b"y" * (http1.MAX_HEAD_BYTES + 1) + b"\r\n\r\n", http1.ProtocolError),
])
def test_a_broken_head_is_an_error(response: bytes, error: type[Exception]) -> None:
    with pytest.raises(error):
        _exchange([response] if response else [], close_after=True)


def test_nothing_arriving_within_the_gap_is_a_read_timeout() -> None:
    async def run() -> None:
        connection = http1.Connection()
        connection.connection_made(FakeTransport())  # type: ignore[arg-type]
        await connection.read_head(gap=0)

    with pytest.raises(http1.ReadTimeout):
        asyncio.run(run())


def test_a_connection_the_peer_closed_is_not_usable() -> None:
    connection = http1.Connection()
    connection.connection_made(FakeTransport())  # type: ignore[arg-type]
    assert connection.usable
    connection.connection_lost(None)
    assert not connection.usable


def test_a_wait_past_the_deadline_is_deadline_exceeded_even_within_the_gap() -> None:
    async def run() -> None:
        connection = FedConnection([b"HTTP/1.1 200 OK\r\n"], None)  # the head never completes
        connection.connection_made(FakeTransport())  # type: ignore[arg-type]
        connection.deadline = asyncio.get_running_loop().time()  # already due; the gap is long
        await connection.read_head(gap=30)

    with pytest.raises(http1.DeadlineExceeded):
        asyncio.run(run())
