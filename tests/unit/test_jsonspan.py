"""jsonspan: member spans of real documents, and edits that equal dict edits (property-based)."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from extproc.protocol import jsonspan

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=20,
)
objects = st.dictionaries(st.text(max_size=12), json_values, max_size=8)


def test_members_of_a_document_with_whitespace_escapes_and_nesting() -> None:
    raw = b' {\n "a" : [1, {"x": "]}\\"{"}],\t"b\\u0022c":"s\\\\", "n": -1.5e3 , "o": {} }  '
    spans = jsonspan.members(raw)
    assert [m.name for m in spans] == ["a", 'b"c', "n", "o"]
    assert [raw[m.value_start:m.end] for m in spans] == [b'[1, {"x": "]}\\"{"}]', b'"s\\\\"', b"-1.5e3", b"{}"]


def test_empty_object_has_no_members() -> None:
    assert jsonspan.members(b" { } ") == []


def test_rebuild_replaces_drops_and_appends_keeping_other_bytes() -> None:
    raw = b'{"keep": 1.0, "drop": true, "swap": 3, "big": 123456789012345678901234567890}'
    out = jsonspan.rebuild(raw, jsonspan.members(raw), {"drop": None, "swap": b"4"}, [("new", b"[1]")])
    assert out == b'{"keep": 1.0,"swap":4,"big": 123456789012345678901234567890,"new":[1]}'


def test_rebuild_with_every_member_dropped_or_none_kept_is_an_object() -> None:
    raw = b'{"a": 1, "b": [2]}'
    assert jsonspan.rebuild(raw, jsonspan.members(raw), {"a": None, "b": None}) == b"{}"
    assert jsonspan.rebuild(raw, jsonspan.members(raw), {"a": None, "b": None}, [("c", b"3")]) == b'{"c":3}'
    out = jsonspan.rebuild(raw, jsonspan.members(raw), {})
    assert out == b'{"a": 1,"b": [2]}' and type(out) is bytes


def test_an_escaped_key_cannot_hide_from_an_edit() -> None:
    raw = b'{"str\\u0065am": true}'
    out = jsonspan.rebuild(raw, jsonspan.members(raw), {"stream": b"false"})
    assert json.loads(out) == {"stream": False}


@settings(max_examples=300, deadline=None)
@given(objects, st.sampled_from([None, 1, 2]), st.data())
def test_edits_on_bytes_equal_edits_on_the_parsed_object(obj: dict[str, Any], indent: int | None,
                                                         data: st.DataObject) -> None:
    raw = json.dumps(obj, indent=indent, ensure_ascii=data.draw(st.booleans())).encode()
    spans = jsonspan.members(raw)
    assert [m.name for m in spans] == list(obj)
    for member in spans:
        assert json.loads(raw[member.value_start:member.end]) == json.loads(json.dumps(obj[member.name]))
    keys = list(obj)
    dropped = set(data.draw(st.lists(st.sampled_from(keys), max_size=3))) if keys else set()
    replace: dict[str, bytes | None] = {key: None for key in dropped}
    out = jsonspan.rebuild(raw, spans, replace, [("appended\u00e9", b'{"v": [1, 2.5]}')])
    expected = {k: v for k, v in obj.items() if k not in dropped}
    expected["appended\u00e9"] = {"v": [1, 2.5]}
    assert json.loads(out) == json.loads(json.dumps(expected))


def test_orjson_measured_values_and_the_scanner_agree(monkeypatch: Any) -> None:
    """Nested values are measured by orjson when short and ASCII, by the scanner otherwise: same spans."""
    documents = [
        b'{"a" : {"x": [1, {"y": "]}"}]}\n ,"b":[[], {}],"c\\"": "v", "d": {"e": "\\u00e9\\"}"}}',
        '{"ascii": [1], "non-ascii": {"k": "é]}"}, "after": []}'.encode(),
        b'{"long": [' + b'"0123456789",' * 10000 + b'1], "z": {"q": 1}}',  # longer than the window
        b'{"deep": ' + b"[" * 300 + b"]" * 300 + b' , "tail" : {} }',
    ]
    measured = [[(m.name, m.start, m.value_start, m.end) for m in jsonspan.members(d)] for d in documents]
    monkeypatch.setattr(jsonspan, "_WINDOW", 0)  # nothing is measured: the scanner alone
    scanned = [[(m.name, m.start, m.value_start, m.end) for m in jsonspan.members(d)] for d in documents]
    assert measured == scanned
    assert [m[0] for m in measured[1]] == ["ascii", "non-ascii", "after"]


def _spans(raw: bytes) -> list[tuple[str, int, int, int]]:
    return [(m.name, m.start, m.value_start, m.end) for m in jsonspan.members(raw)]


def _fast_and_scanned(raw: bytes, monkeypatch: Any) -> tuple[list[tuple[str, int, int, int]],
                                                              list[tuple[str, int, int, int]]]:
    """The spans with the one-match-per-member fast path, and with the scanner alone."""
    fast = _spans(raw)
    with monkeypatch.context() as patch:
        patch.setattr(jsonspan, "_MEMBER", re.compile(rb"(?!)"))  # never matches: every member scanned
        scanned = _spans(raw)
    return fast, scanned


TRICKY = [
    b'{"a": "x\\"}", "b": 1}',  # an escaped quote then a bracket in a string
    b'{"a": "x\\\\", "b": "\\\\\\"", "c": "\\\\\\\\"}',  # strings ending in escaped backslashes
    b'{"a": ["\\"]", {"k": "}\\\\"}], "b": {"c": "{[\\"]}"}}',  # brackets and escapes in nested strings
    b'{"k\\"ey": 1, "k\\u0065y": 2, "\\\\": 3}',  # keys with escapes
    b'{"a": 1, "a": 2}',  # a duplicate
    b'{"a": 1, "\\u0061": 2}',  # a duplicate hidden by an escape
    b'{"a" :\n\t[ 1 ,\r\n 2 ] ,\n"b"\t:\t{ }\n,"c":""}',  # whitespace everywhere
    '{"é": "ü]}", "日本": ["語", {"x": "}"}], "z": -0.5e-3}'.encode(),  # non-ASCII
    b'{"deep": ' + b"[" * 8 + b'"]"' + b"]" * 8 + b', "deeper": ' + b"[" * 9 + b"1" + b"]" * 9 + b"}",
    b'{"e": [], "o": {}, "n": null, "t": true, "f": false, "s": "", "x": [[[]], {"": {}}]}',
    b'{"a": "' + b"x" * 20000 + b'", "b": [1]}',  # larger than the fast path takes
]


def test_fast_path_and_scanner_agree_on_tricky_documents(monkeypatch: Any) -> None:
    for raw in TRICKY:
        json.loads(raw)  # each is valid JSON, as the callers guarantee
        fast, scanned = _fast_and_scanned(raw, monkeypatch)
        assert fast == scanned, raw
    assert [m[0] for m in _spans(TRICKY[3])] == ['k"ey', "key", "\\"]
    for repeated in TRICKY[4:6]:
        with pytest.raises(jsonspan.RepeatedKey):
            jsonspan.unique_members(repeated)


# Text heavy in what the fast path must get right: quotes, backslashes, brackets, separators, non-ASCII.
_tricky_text = st.text(alphabet=st.sampled_from('"\\[]{}:, a\u00e9\u65e5\n\t'), max_size=10) | st.text(max_size=6)
tricky_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | _tricky_text,
    lambda children: st.lists(children, max_size=4) | st.dictionaries(_tricky_text, children, max_size=4),
    max_leaves=30,
)
tricky_objects = st.dictionaries(_tricky_text, tricky_values, max_size=8)


@settings(max_examples=500, deadline=None)
@given(tricky_objects, st.sampled_from([None, 0, 2]), st.booleans(), st.booleans())
def test_fast_path_and_scanner_agree(obj: dict[str, Any], indent: int | None, ascii_only: bool,
                                     duplicate: bool) -> None:
    raw = json.dumps(obj, indent=indent, ensure_ascii=ascii_only).encode()
    if duplicate and obj:  # the first member again at the end
        first = next(iter(obj))
        raw = raw.rstrip()[:-1] + b', ' + json.dumps(first).encode() + b': ' + json.dumps(obj[first]).encode() + b"}"
    fast = _spans(raw)
    saved = jsonspan._MEMBER
    jsonspan._MEMBER = re.compile(rb"(?!)")
    try:
        scanned = _spans(raw)
    finally:
        jsonspan._MEMBER = saved
    assert fast == scanned
    try:
        jsonspan.unique_members(raw)
        repeated = False
    except jsonspan.RepeatedKey:
        repeated = True
    assert repeated == (duplicate and bool(obj))


@settings(max_examples=300, deadline=None)
@given(tricky_objects, st.sampled_from([None, 0, 2]), st.booleans())
def test_member_count_is_the_number_of_members(obj: dict[str, Any], indent: int | None, duplicate: bool) -> None:
    raw = json.dumps(obj, indent=indent).encode()
    if duplicate and obj:  # the first member again at the end: one more member than parsed keys
        first = next(iter(obj))
        raw = raw.rstrip()[:-1] + b', ' + json.dumps(first).encode() + b': ' + json.dumps(obj[first]).encode() + b"}"
    assert jsonspan.member_count(raw) == len(jsonspan.members(raw)) == len(obj) + (duplicate and bool(obj))
    for raw in TRICKY:
        assert jsonspan.member_count(raw) == len(jsonspan.members(raw))
