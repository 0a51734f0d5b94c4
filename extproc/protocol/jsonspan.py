"""Byte spans of the top-level members of a JSON object, so bodies can be edited without re-encoding.

Both legs are built by splicing the client's own bytes: members we do not touch reach the engines
exactly as the client wrote them (number spelling, big integers, escapes, key order). Callers must
pass a document that a strict JSON parser already accepted as an object; this module only locates
members, it does not validate.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sized
from typing import NamedTuple

import orjson

_WS = re.compile(rb"[ \t\r\n]*")
_BACKSLASH = ord("\\")
_SCALAR = re.compile(rb"[^,}\] \t\r\n]+")
_STRUCTURAL = re.compile(rb'["\[\]{}]')
# A nested value up to this long is measured by orjson (C) instead of the scanner below: parsing the
# rest of the document from the value's first byte stops with "unexpected content after document"
# exactly where the value (and the whitespace after it) ends. orjson reports that place in characters,
# which are bytes only in ASCII text, so only an ASCII window is measured this way. Each try parses
# (and, failing, copies into its error) up to a window of what follows, so a document gets at most
# _MEASURE_BUDGET bytes of tries: many nested members cannot make it quadratic.
_WINDOW = 8 << 10
_MEASURE_BUDGET = 64 << 10
_AFTER_DOCUMENT = "unexpected content after document"
_CLOSING = {ord("{"): ord("}"), ord("["): ord("]")}
_PLAIN_KEY = re.compile(rb'"([^"\\]*+)"[ \t\r\n]*+:[ \t\r\n]*+')  # a key without escapes
_SEPARATOR = re.compile(rb"[ \t\r\n]*+(?:(,)[ \t\r\n]*+|})")  # after a value: the next member, or the end

# The fast path for documents up to _FAST_MAX bytes: one match per member (a plain key, its value, the
# separator after it), in C. A string is taken up to its first quote, which must not follow a backslash
# (so an escaped quote, or a string ending in a backslash, is not matched here: the scanner reads it). A
# nested value is matched whole when it is at most _NESTING deep: strings inside it are skipped as above
# (brackets in them do not count), anything else between brackets is taken as it is; the document is
# valid JSON, so the bracket that closes at the same depth is the matching one. Whatever the pattern does
# not take (a key with an escape, such a string, a deeper value) fails the match and the scanner below
# reads that member: both find the same spans (tests/unit/test_jsonspan.py compares them). Larger
# documents go to the scanner only: its memchr over long strings is faster than the regex engine there.
_FAST_MAX = 16 << 10
_NESTING = 8
_STRING = rb'"[^"]*+(?<!\\)"'


def _nested(depth: int) -> bytes:
    inner = rb"|" + _nested(depth - 1) if depth > 1 else b""
    return rb'[\[{](?:' + _STRING + rb'|[^"\[\]{}]++' + inner + rb')*+[\]}]'


_MEMBER = re.compile(rb'"([^"\\]*+)"[ \t\r\n]*+:[ \t\r\n]*+(' + _STRING + rb'|[^,}\] \t\r\n"\[{]++|'
                     + _nested(_NESTING) + rb')[ \t\r\n]*+(?:(,)[ \t\r\n]*+|})')


class Member(NamedTuple):  # a tuple: three times cheaper to make than a frozen dataclass
    name: str  # the decoded key: escapes in a key cannot hide it from an edit
    start: int  # offset of the key's opening quote
    value_start: int
    end: int  # offset just past the value


def _skip_ws(raw: bytes, pos: int) -> int:
    match = _WS.match(raw, pos)
    return match.end() if match else pos


def _string_end(raw: bytes, pos: int) -> int:
    """The offset just past the string whose opening quote is at ``pos``. bytes.find (memchr) skips
    the content at C speed; a quote is the end unless an odd run of backslashes precedes it."""
    start = pos + 1
    while True:
        quote = raw.find(b'"', start)
        assert quote >= 0
        backslash = quote - 1
        while raw[backslash] == _BACKSLASH:
            backslash -= 1
        if (quote - 1 - backslash) % 2 == 0:
            return quote + 1
        start = quote + 1


def _value_end(raw: bytes, pos: int, measure: bool = False) -> int:
    first = raw[pos:pos + 1]
    if first == b'"':
        return _string_end(raw, pos)
    if first not in (b"{", b"["):
        match = _SCALAR.match(raw, pos)
        assert match is not None
        return match.end()
    measured = _measured_end(raw, pos) if measure else None
    if measured is not None:
        return measured
    depth = 0
    while True:
        match = _STRUCTURAL.search(raw, pos)
        assert match is not None
        char = match.group()
        if char == b'"':
            pos = _string_end(raw, match.start())
            continue
        pos = match.end()
        depth += 1 if char in (b"{", b"[") else -1
        if depth == 0:
            return pos


def _measured_end(raw: bytes, pos: int) -> int | None:
    """The end of the object or array at ``pos`` as orjson finds it, or None (long, non-ASCII, or any
    answer but the expected one: the scanner decides then)."""
    window = raw[pos:pos + _WINDOW]
    if not window.isascii():
        return None
    try:
        orjson.loads(window)
    except orjson.JSONDecodeError as exc:
        if exc.msg != _AFTER_DOCUMENT:
            return None
        window = window[:exc.pos]
    end = pos + len(window.rstrip(b" \t\r\n"))
    return end if raw[end - 1] == _CLOSING[raw[pos]] else None


def members(raw: bytes) -> list[Member]:
    """The top-level members of the JSON object in ``raw``, in document order."""
    pos = _skip_ws(raw, 0)
    assert raw[pos:pos + 1] == b"{"
    pos = _skip_ws(raw, pos + 1)
    found: list[Member] = []
    if raw[pos:pos + 1] == b"}":
        return found
    budget = _MEASURE_BUDGET
    fast = _MEMBER.match if len(raw) <= _FAST_MAX else None
    while True:
        whole = fast(raw, pos) if fast is not None else None
        if whole is not None:
            value_start, end = whole.span(2)
            found.append(Member(whole.group(1).decode(), pos, value_start, end))
            if whole.group(3) is None:
                return found
            pos = whole.end()
            continue
        plain = _PLAIN_KEY.match(raw, pos)
        if plain is not None:  # one match for the key, the colon and the whitespace around it
            name, value_start = plain.group(1).decode(), plain.end()
        else:
            key_end = _string_end(raw, pos)
            key = raw[pos:key_end]
            value_start = _skip_ws(raw, _skip_ws(raw, key_end) + 1)
            name = key[1:-1].decode() if b"\\" not in key else orjson.loads(key)
        end = _value_end(raw, value_start, budget > 0)
        if raw[value_start] in _CLOSING:
            budget -= _WINDOW
        found.append(Member(name, pos, value_start, end))
        separator = _SEPARATOR.match(raw, end)
        assert separator is not None
        if separator.group(1) is None:
            return found
        pos = separator.end()


class RepeatedKey(ValueError):
    """An object names a key twice. Parsers disagree on which copy wins (orjson and Python's json keep
    the last, a reader of spans the first), so a value is read only from an object where every key is
    there once: what we check is then what we forward."""


def unique_members(raw: bytes) -> list[Member]:
    """The members of an object read field by field: the one helper for "exactly one member". Raises
    RepeatedKey when any key repeats; the caller turns that into its documented error."""
    found = members(raw)
    if len({m.name for m in found}) != len(found):
        raise RepeatedKey()
    return found


def unique_value(raw: bytes, name: str, parsed: Sized) -> bytes | None:
    """``member_value(raw, unique_members(raw), name)`` for ``raw`` whose parsed object is ``parsed``,
    without building the members: a repeated key shows as fewer parsed keys than members."""
    count, value = count_and_value(raw, name)
    if count != len(parsed):
        raise RepeatedKey()
    return value


def first_element(array_raw: bytes) -> bytes | None:
    """The raw bytes of the first element of a JSON array (None if it is empty)."""
    pos = _skip_ws(array_raw, 0)
    assert array_raw[pos:pos + 1] == b"["
    pos = _skip_ws(array_raw, pos + 1)
    if array_raw[pos:pos + 1] == b"]":
        return None
    return array_raw[pos:_value_end(array_raw, pos)]


def count_and_value(raw: bytes, name: str) -> tuple[int, bytes | None]:
    """How many top-level members ``raw`` has, and the raw value of the member ``name`` (None if absent),
    as ``members`` and ``member_value`` would give them, without building the members: with the parsed
    object, ``len(parsed) != count`` is a repeated key (the parser keeps one of them)."""
    if len(raw) <= _FAST_MAX:
        pos = _skip_ws(raw, 0)
        if raw[pos:pos + 1] == b"{":
            pos = _skip_ws(raw, pos + 1)
            if raw[pos:pos + 1] == b"}":
                return 0, None
            wanted, count, value, fast = name.encode(), 0, None, _MEMBER.match
            while (whole := fast(raw, pos)) is not None:
                count += 1
                if value is None and whole.group(1) == wanted:  # a plain key: its bytes are its name
                    value = raw[whole.start(2):whole.end(2)]
                if whole.group(3) is None:
                    return count, value
                pos = whole.end()
    found = members(raw)  # a member the pattern does not take: the whole document the slow way
    return len(found), member_value(raw, found, name)


def member_count(raw: bytes) -> int:
    """How many top-level members ``raw`` has (``len(members(raw))``), without building them."""
    return count_and_value(raw, "")[0]


def member_value(raw: bytes, spans: Iterable[Member], name: str) -> bytes | None:
    """The raw bytes of a top-level member's value, or None if the member is absent."""
    for member in spans:
        if member.name == name:
            return raw[member.value_start:member.end]
    return None


def rebuild(
    raw: bytes,
    spans: Iterable[Member],
    replace: Mapping[str, bytes | None],
    append: Iterable[tuple[str, bytes]] = (),
) -> bytes:
    """A new object: each member of ``raw`` verbatim, unless ``replace`` maps its name to new value
    bytes (or to None, which drops it); then the ``append`` members (name, value bytes).

    The kept members are views of ``raw`` and the object is joined once: a long prompt is copied once,
    into the result (a large allocation costs its page faults too: docs/decisions.md)."""
    view = memoryview(raw)
    pieces: list[bytes | memoryview] = [b"{"]
    for member in spans:
        if member.name in replace:
            new_value = replace[member.name]
            if new_value is None:
                continue
            pieces += (orjson.dumps(member.name), b":", new_value, b",")
        else:
            pieces += (view[member.start:member.end], b",")
    for name, value in append:
        pieces += (orjson.dumps(name), b":", value, b",")
    if len(pieces) > 1:
        pieces.pop()  # the last member's comma
    pieces.append(b"}")
    return b"".join(pieces)
