"""HTTP/2 and gRPC wire pieces for the ext_proc server (extproc/envoy/h2server.py): pure functions.

RFC 9113 (HTTP/2) frames, the few RFC 7541 (HPACK) header blocks we send, and gRPC's length-prefixed
messages and status trailers (grpc/grpc doc/PROTOCOL-HTTP2.md). Decoding a peer's header blocks is
hpack's (python-hyper hpack 4.2.0, its ``Decoder``); this module only encodes what we send, with no
dynamic table (after the peer changes HEADER_TABLE_SIZE our next block says so: ``TABLE_SIZE_ZERO``).
"""

from __future__ import annotations

import struct
from enum import IntEnum
from typing import NamedTuple

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
FRAME_HEAD = 9
UINT32 = struct.Struct(">I")
FRAME = struct.Struct(">IBI")  # a frame's head: length << 8 | type, flags, stream id
_SETTING = struct.Struct(">HI")
MAX_WINDOW = 0x7FFFFFFF
DEFAULT_WINDOW = 65535
DEFAULT_FRAME = 16384
MAX_FRAME_LIMIT = (1 << 24) - 1


class Frame(IntEnum):
    DATA = 0
    HEADERS = 1
    PRIORITY = 2
    RST_STREAM = 3
    SETTINGS = 4
    PUSH_PROMISE = 5
    PING = 6
    GOAWAY = 7
    WINDOW_UPDATE = 8
    CONTINUATION = 9


END_STREAM = 0x1
ACK = 0x1
END_HEADERS = 0x4
PADDED = 0x8
PRIORITY = 0x20


class H2Error(IntEnum):
    NO_ERROR = 0
    PROTOCOL_ERROR = 1
    INTERNAL_ERROR = 2
    FLOW_CONTROL_ERROR = 3
    STREAM_CLOSED = 5
    FRAME_SIZE_ERROR = 6
    REFUSED_STREAM = 7
    CANCEL = 8
    COMPRESSION_ERROR = 9


class Setting(IntEnum):
    HEADER_TABLE_SIZE = 1
    ENABLE_PUSH = 2
    MAX_CONCURRENT_STREAMS = 3
    INITIAL_WINDOW_SIZE = 4
    MAX_FRAME_SIZE = 5
    MAX_HEADER_LIST_SIZE = 6


class Status(IntEnum):
    """gRPC status codes (grpc/grpc doc/statuscodes.md) that this server sends."""

    OK = 0
    UNKNOWN = 2
    INVALID_ARGUMENT = 3
    NOT_FOUND = 5
    RESOURCE_EXHAUSTED = 8
    UNIMPLEMENTED = 12
    INTERNAL = 13
    UNAVAILABLE = 14


class ConnectionError_(Exception):
    """A connection error (RFC 9113 section 5.4.1): GOAWAY with ``code``, then close."""

    def __init__(self, code: H2Error, reason: str) -> None:
        super().__init__(reason)
        self.code = code


def frame_head(length: int, kind: int, flags: int, stream_id: int) -> bytes:
    return FRAME.pack(length << 8 | kind, flags, stream_id)


def frame(kind: int, flags: int, stream_id: int, payload: bytes = b"") -> bytes:
    return frame_head(len(payload), kind, flags, stream_id) + payload


def settings_frame(settings: dict[Setting, int]) -> bytes:
    return frame(Frame.SETTINGS, 0, 0, b"".join(_SETTING.pack(key, value) for key, value in settings.items()))


def parse_settings(payload: bytes | memoryview) -> list[tuple[int, int]]:
    """A SETTINGS frame's (identifier, value) pairs, each checked as RFC 9113 section 6.5.2 asks."""
    if len(payload) % 6:
        raise ConnectionError_(H2Error.FRAME_SIZE_ERROR, "SETTINGS length not a multiple of 6")
    pairs = [_SETTING.unpack_from(payload, offset) for offset in range(0, len(payload), 6)]
    for key, value in pairs:
        if key == Setting.INITIAL_WINDOW_SIZE and value > MAX_WINDOW:
            raise ConnectionError_(H2Error.FLOW_CONTROL_ERROR, "INITIAL_WINDOW_SIZE over 2^31-1")
        if key == Setting.MAX_FRAME_SIZE and not DEFAULT_FRAME <= value <= MAX_FRAME_LIMIT:
            raise ConnectionError_(H2Error.PROTOCOL_ERROR, "MAX_FRAME_SIZE out of range")
        if key == Setting.ENABLE_PUSH and value > 1:
            raise ConnectionError_(H2Error.PROTOCOL_ERROR, "ENABLE_PUSH not 0 or 1")
    return pairs


def unpad(flags: int, payload: memoryview, priority: bool = False) -> memoryview:
    """A DATA or HEADERS payload without its padding (and a HEADERS frame's priority fields)."""
    if flags & PADDED:
        if not payload:
            raise ConnectionError_(H2Error.PROTOCOL_ERROR, "padded frame without a pad length")
        pad = payload[0]
        if pad >= len(payload):
            raise ConnectionError_(H2Error.PROTOCOL_ERROR, "padding longer than the frame")
        payload = payload[1:len(payload) - pad]
    if priority and flags & PRIORITY:
        if len(payload) < 5:
            raise ConnectionError_(H2Error.FRAME_SIZE_ERROR, "HEADERS priority fields cut short")
        payload = payload[5:]
    return payload


def _integer(value: int, prefix_bits: int, first: int) -> bytes:
    """An HPACK integer (RFC 7541 section 5.1) with ``first``'s high bits above an N-bit prefix."""
    limit = (1 << prefix_bits) - 1
    if value < limit:
        return bytes((first | value,))
    out = bytearray((first | limit,))
    value -= limit
    while value >= 128:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def literal(name: bytes, value: bytes) -> bytes:
    """A header field as a literal without indexing with a new name, no Huffman (RFC 7541 section 6.2.2)."""
    return b"\x00" + _integer(len(name), 7, 0) + name + _integer(len(value), 7, 0) + value


TABLE_SIZE_ZERO = b"\x20"  # a dynamic table size update to 0 (RFC 7541 section 6.3): we index nothing
# :status 200 is static entry 8; content-type is static entry 31, its value a literal (section 6.2.2).
RESPONSE_HEADERS = b"\x88" + _integer(31, 4, 0) + _integer(16, 7, 0) + b"application/grpc"


def _percent_encoded(message: str) -> bytes:
    """grpc-message's percent-encoding: every byte outside 0x20-0x7E, and ``%``, as %XX (UTF-8 first)."""
    return b"".join(bytes((byte,)) if 0x20 <= byte <= 0x7E and byte != 0x25 else b"%%%02X" % byte
                    for byte in message.encode())


def trailers(status: int, message: str = "", *, with_headers: bool = False) -> bytes:
    """The header block that ends a call: grpc-status and grpc-message; ``with_headers`` for a
    trailers-only response (no message was sent)."""
    block = (RESPONSE_HEADERS if with_headers else b"") + literal(b"grpc-status", b"%d" % status)
    if message:
        block += literal(b"grpc-message", _percent_encoded(message[:1024]))
    return block


def message_prefix(length: int) -> bytes:
    """gRPC's length prefix of an uncompressed message."""
    return b"\x00" + UINT32.pack(length)


class MessageError(Exception):
    """A message breaks gRPC's framing or our limit: its call ends with ``status``."""

    def __init__(self, status: Status, reason: str) -> None:
        super().__init__(reason)
        self.status = status


class MessageReader:
    """gRPC's length-prefixed messages out of one stream's DATA payloads. Each message is copied once,
    into a buffer of its announced length, as its payloads arrive: nothing keeps the reads alive."""

    __slots__ = ("_buffer", "_filled", "_head", "limit")

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._head = b""  # a length prefix cut by a frame boundary
        self._buffer: bytearray | None = None  # the message being filled, once its prefix is read
        self._filled = 0

    @property
    def inside_message(self) -> bool:
        return self._buffer is not None or bool(self._head)

    def feed(self, data: memoryview) -> list[bytearray]:
        """The messages this payload completes (MessageError if one breaks the rules)."""
        done: list[bytearray] = []
        while data:
            buffer = self._buffer
            if buffer is None:
                need = 5 - len(self._head)
                self._head += data[:need]
                data = data[need:]
                if len(self._head) < 5:
                    break
                head, self._head = self._head, b""
                if head[0]:
                    raise MessageError(Status.INTERNAL, "compressed message without grpc-encoding")
                length = UINT32.unpack_from(head, 1)[0]
                if length > self.limit:
                    raise MessageError(Status.RESOURCE_EXHAUSTED,
                                       f"received message larger than max ({length} vs. {self.limit})")
                buffer = self._buffer = bytearray(length)
                self._filled = 0
            filled = self._filled
            take = min(len(buffer) - filled, len(data))
            if take:
                buffer[filled:filled + take] = data[:take]
                data = data[take:]
                filled = self._filled = filled + take
            if filled == len(buffer):
                done.append(buffer)
                self._buffer = None
        return done


def _skip_integer(block: bytes, i: int, prefix_bits: int) -> tuple[int, int]:
    """An HPACK integer at ``block[i]`` (RFC 7541 section 5.1): its value and the index after it."""
    value = block[i] & ((1 << prefix_bits) - 1)
    i += 1
    if value == (1 << prefix_bits) - 1:
        shift = 0
        while True:
            byte = block[i]
            i += 1
            value += (byte & 0x7F) << shift
            shift += 7
            if not byte & 0x80:
                break
    return value, i


def table_unchanged(block: bytes) -> bool:
    """Whether decoding a header block leaves the dynamic table as it was: indexed fields and literals
    without (or never) indexing only, no incremental indexing, no size update (RFC 7541 section 6).
    Then the same bytes mean the same headers until a block that changes the table. A block cut short
    answers False (the decoder refuses it)."""
    i, size = 0, len(block)
    try:
        while i < size:
            byte = block[i]
            if byte & 0x80:  # indexed field
                _, i = _skip_integer(block, i, 7)
            elif byte & 0xE0:  # 01xxxxxx: incremental indexing; 001xxxxx: a table size update
                return False
            else:  # 0000xxxx, 0001xxxx: literal without indexing, never indexed
                name, i = _skip_integer(block, i, 4)
                for _ in range(1 if name else 2):  # the name's string if not indexed, then the value's
                    length, i = _skip_integer(block, i, 7)
                    i += length
    except IndexError:
        return False
    return i == size


class Headers(NamedTuple):
    """What this server reads of a request's headers."""

    method: bytes
    path: str
    content_type: bytes
    encoding: bytes


def request_headers(fields: list[tuple[bytes, bytes]]) -> Headers:
    method = path = content_type = encoding = b""
    for name, value in fields:
        if name == b":path":
            path = value
        elif name == b":method":
            method = value
        elif name == b"content-type":
            content_type = value
        elif name == b"grpc-encoding":
            encoding = value
    return Headers(method, path.decode("latin-1"), content_type, encoding)


def call_refusal(headers: Headers, known: bool) -> tuple[Status, str] | None:
    """Why a request cannot be a call we serve (gRPC over HTTP/2's rules), or None."""
    if headers.method != b"POST":
        return Status.INTERNAL, f"method {headers.method.decode('latin-1')} is not POST"
    if not headers.content_type.startswith(b"application/grpc"):
        return Status.INTERNAL, "content-type is not application/grpc"
    if headers.encoding not in (b"", b"identity"):
        return Status.UNIMPLEMENTED, f"grpc-encoding {headers.encoding.decode('latin-1')} is not supported"
    if not known:
        return Status.UNIMPLEMENTED, f"unknown method {headers.path}"
    return None
