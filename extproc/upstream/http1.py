"""A small HTTP/1.1 client connection on an asyncio Protocol: what the prefill leg needs, nothing more.

One request at a time per connection (no pipelining), keep-alive, bodies framed by Content-Length,
chunked transfer coding or the end of the connection. No proxies, no redirects, no decompression, no
cookies: a request goes out with exactly the headers it is given plus ``host`` and ``content-length``.

Bounds:
  * every wait for bytes is bounded by a gap timeout: ReadTimeout when nothing arrives for that long,
    and by the caller's total deadline when it sets one (``deadline``): DeadlineExceeded;
  * a response head is at most MAX_HEAD_BYTES;
  * a body is read only up to the caller's cap (BodyTooLarge), checked on Content-Length before
    reading and on the bytes counted while reading; the connection then stops reading.
Errors are this module's exceptions (OSError or TimeoutError subclasses, and BodyTooLarge);
``upstream.client.classify`` maps the first two to error codes.

Measured against aiohttp 3.14 as we used it (bench/clients.py, docs/decisions.md): one sequential
prefill-sized POST to a cheap worker, 98 µs p50 and 58 µs client CPU vs 457 µs and 422 µs.
"""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass

MAX_HEAD_BYTES = 64 << 10
MAX_LINE_BYTES = 8 << 10  # a chunk-size or trailer line
MAX_LENGTH_DIGITS = 18  # a Content-Length or chunk size beyond this is refused, not parsed
_HEX_DIGITS = frozenset(b"0123456789abcdefABCDEF")


class ReadTimeout(TimeoutError):
    """Nothing arrived for the gap timeout (waiting for the head, or between body bytes)."""


class DeadlineExceeded(ReadTimeout):
    """The caller's total deadline (``Connection.deadline``) passed while waiting for bytes."""


class ConnectTimeout(TimeoutError):
    """The connection (TCP, and TLS when configured) was not up within the connect timeout."""


class ConnectionClosed(ConnectionError):
    """The peer closed the connection before the response (or its body) was complete."""


class ProtocolError(OSError):
    """The peer's bytes are not an HTTP/1.1 response we can read."""


class BodyTooLarge(Exception):
    """The body is larger than the caller's cap."""


@dataclass(frozen=True, slots=True)
class Head:
    status: int
    headers: tuple[tuple[str, str], ...]  # lower-case names, in order
    keep_alive: bool

    def get(self, name: str) -> str | None:
        for key, value in self.headers:
            if key == name:
                return value
        return None


class InvalidRequest(ValueError):
    """A request that cannot be written as HTTP/1.1; ``part`` is "path" or "headers"."""

    def __init__(self, part: str) -> None:
        super().__init__(f"invalid request {part}")
        self.part = part


# The origin-form target (RFC 9112 3.2.1) in the characters h11 allows in a request target
# (h11/_abnf.py at v0.16.0: request_target = vchar+, vchar = [\x21-\x7e], matched whole by
# _events.Request): no space, control or non-ASCII character can split or extend the request line.
_TARGET = re.compile(r"/[\x21-\x7e]*")
_TOKEN = re.compile(r"[-!#$%&'*+.^_`|~0-9A-Za-z]+")  # a field name (RFC 9110 5.1), h11's _abnf.token


def encode_request(method: str, path: str, authority: str, headers: Sequence[tuple[str, str]],
                   body: bytes | None) -> bytes:
    """The request head (and body). A target that is not an origin-form path of visible ASCII, a header
    name that is not a token, or a CR, LF or NUL in a value is refused (InvalidRequest)."""
    if _TARGET.fullmatch(path) is None:
        raise InvalidRequest("path")
    lines = [f"{method} {path} HTTP/1.1", f"host: {authority}"]
    for name, value in headers:
        if _TOKEN.fullmatch(name) is None or "\r" in value or "\n" in value or "\0" in value:
            raise InvalidRequest("headers")
        lines.append(f"{name}: {value}")
    if body is not None:
        lines.append(f"content-length: {len(body)}")
    try:
        head = ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")
    except UnicodeEncodeError:  # a value beyond latin-1 (the authority is ours and ASCII)
        raise InvalidRequest("headers") from None
    return head + body if body else head


def _expire(waiter: asyncio.Future[None], error: type[ReadTimeout]) -> None:
    if not waiter.done():
        waiter.set_exception(error())


class Connection(asyncio.Protocol):
    """One client connection. ``exchange`` reads a whole response; ``reusable`` says whether the
    connection may serve another request afterwards."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.buffer = bytearray()
        self.closed = False
        self.idle_since = time.monotonic()
        # The caller's total deadline for the current exchange, in loop time: no wait outlasts it. One
        # timer per wait bounds both (an asyncio.timeout around the exchange cost ~7 us per request).
        self.deadline: float | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._limit = MAX_HEAD_BYTES
        self._paused = False
        self._reset = False  # the connection ended with an error (a reset), not a clean end
        self.reusable = False  # set by read_body: the response was complete and framed, keep-alive allowed
        self.received_any = False  # a byte arrived since the client last cleared it (before a request)

    # --- asyncio.Protocol ------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # uvloop's transports are not subclasses

    def data_received(self, data: bytes) -> None:
        self.received_any = True
        self.buffer += data
        if len(self.buffer) > self._limit and self.transport is not None and not self._paused:
            self._paused = True  # the reader will refuse the body; read no further meanwhile
            self.transport.pause_reading()
        self._wake()

    def eof_received(self) -> bool:
        self.closed = True
        self._wake()
        return False  # close the transport

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._reset = self._reset or exc is not None
        self._wake()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    # --- the client side -------------------------------------------------------------------------

    @property
    def usable(self) -> bool:
        return not self.closed and self.transport is not None and not self.transport.is_closing() \
            and not self.buffer

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()

    def _resume(self) -> None:
        if self._paused and self.transport is not None:
            self._paused = False
            self.transport.resume_reading()

    async def _more(self, gap: float) -> None:
        """Wait until more bytes arrive (or the connection ends), at most ``gap`` seconds (ReadTimeout)
        and not past ``deadline`` (DeadlineExceeded)."""
        if self.closed:
            raise ConnectionClosed()
        loop = asyncio.get_running_loop()
        now, deadline = loop.time(), self.deadline
        if deadline is not None and now >= deadline:  # a peer that always has bytes ready never lets
            raise DeadlineExceeded()  # the timer below fire: the deadline is checked before each wait too
        self._resume()  # the reader drained the buffer: read again
        waiter = self._waiter = loop.create_future()
        when = now + gap
        if deadline is not None and deadline < when:
            timer = loop.call_at(deadline, _expire, waiter, DeadlineExceeded)
        else:
            timer = loop.call_at(when, _expire, waiter, ReadTimeout)
        try:
            await waiter
        finally:
            timer.cancel()
            self._waiter = None

    async def read_head(self, gap: float) -> Head:
        """The response head (1xx interim responses skipped)."""
        while True:
            self._limit = MAX_HEAD_BYTES
            while True:
                end = self.buffer.find(b"\r\n\r\n")
                if end > MAX_HEAD_BYTES:  # one large read can hold a whole head over the cap
                    raise ProtocolError("response head too large")
                if end >= 0:
                    break
                if len(self.buffer) > MAX_HEAD_BYTES:
                    raise ProtocolError("response head too large")
                if self.closed:
                    raise ConnectionClosed()
                await self._more(gap)
            raw = bytes(self.buffer[:end])
            del self.buffer[:end + 4]
            head = _parse_head(raw)
            if not 100 <= head.status < 200:
                return head

    async def read_body(self, head: Head, cap: int, gap: float) -> bytes:
        """The whole body, at most ``cap`` bytes; afterwards ``reusable`` tells if the connection can go
        back to the pool."""
        self._limit = cap + MAX_LINE_BYTES
        codings = [coding.strip().lower() for key, value in head.headers if key == "transfer-encoding"
                   for coding in value.split(",")]
        framed_twice = False
        if codings:
            # No decompression here: any coding but chunked alone would hand the caller encoded bytes.
            if codings != ["chunked"]:
                raise ProtocolError("unsupported transfer coding")
            framed_twice = head.get("content-length") is not None  # RFC 9112 6.3: close afterwards
            body = await self._read_chunked(cap, gap)
        else:
            length_text = head.get("content-length")
            if length_text is None:
                body = await self._read_to_end(cap, gap)
                self.reusable = False
                return body
            length = _content_length(head)
            if length > cap:
                raise BodyTooLarge()
            while len(self.buffer) < length:
                if self.closed:
                    raise ConnectionClosed()
                await self._more(gap)
            body = bytes(self.buffer[:length])
            del self.buffer[:length]
        # Reading may have been paused on a large buffer that already held the whole body: a pooled
        # connection must read again, or it would never see the peer close it.
        self._resume()
        self.reusable = head.keep_alive and not framed_twice and not self.buffer and not self.closed
        return body

    async def _read_to_end(self, cap: int, gap: float) -> bytes:
        while not self.closed:
            if len(self.buffer) > cap:
                raise BodyTooLarge()
            await self._more(gap)
        if len(self.buffer) > cap:
            raise BodyTooLarge()
        if self._reset:  # a reset mid-body is not the end of a body framed by the connection's end
            raise ConnectionClosed()
        body = bytes(self.buffer)
        self.buffer.clear()
        return body

    async def _line(self, gap: float) -> bytes:
        while True:
            end = self.buffer.find(b"\r\n")
            if end > MAX_LINE_BYTES:
                raise ProtocolError("chunk line too long")
            if end >= 0:
                line = bytes(self.buffer[:end])
                del self.buffer[:end + 2]
                return line
            if len(self.buffer) > MAX_LINE_BYTES:
                raise ProtocolError("chunk line too long")
            if self.closed:
                raise ConnectionClosed()
            await self._more(gap)

    async def _read_chunked(self, cap: int, gap: float) -> bytes:
        parts: list[bytes] = []
        size = 0
        while True:
            token = (await self._line(gap)).split(b";", 1)[0].strip()
            # int(token, 16) alone would also take "0x10", "1_0", "+5" and "-0".
            if not token or len(token) > MAX_LENGTH_DIGITS or not _HEX_DIGITS.issuperset(token):
                raise ProtocolError("bad chunk size")
            chunk = int(token, 16)
            if chunk == 0:
                while await self._line(gap):  # trailers, up to the empty line
                    pass
                return b"".join(parts)
            size += chunk
            if size > cap:
                raise BodyTooLarge()
            while len(self.buffer) < chunk + 2:
                if self.closed:
                    raise ConnectionClosed()
                await self._more(gap)
            if self.buffer[chunk:chunk + 2] != b"\r\n":
                raise ProtocolError("chunk not followed by CRLF")
            parts.append(bytes(self.buffer[:chunk]))
            del self.buffer[:chunk + 2]


def _parse_head(raw: bytes) -> Head:
    lines = raw.split(b"\r\n")
    parts = lines[0].split(b" ", 2)
    if len(parts) < 2 or not parts[0].startswith(b"HTTP/1.") or len(parts[1]) != 3 or not parts[1].isdigit():
        raise ProtocolError("bad status line")
    headers = []
    for line in lines[1:]:
        name, sep, value = line.partition(b":")
        if not sep or not name or name != name.strip():
            raise ProtocolError("bad header line")
        headers.append((name.decode("latin-1").lower(), value.strip().decode("latin-1")))
    connection = ",".join(value for key, value in headers if key == "connection").lower()
    # HTTP/1.1 keeps the connection unless told to close it; HTTP/1.0 only when asked to keep it.
    keep_alive = "keep-alive" in connection if parts[0] == b"HTTP/1.0" else "close" not in connection
    return Head(int(parts[1]), tuple(headers), keep_alive)


def _content_length(head: Head) -> int:
    values = {value.strip() for key, value in head.headers if key == "content-length"}
    if len(values) != 1:
        raise ProtocolError("conflicting content-length")
    text = values.pop()
    # isdigit alone is true for "²" too, which int() refuses.
    if not (text.isascii() and text.isdigit()) or len(text) > MAX_LENGTH_DIGITS:
        raise ProtocolError("bad content-length")
    return int(text)
