"""prefill_json: the handoff's shortcut (parse_prefill_member: a member count and one raw value) refuses and
returns exactly what the spans (parse_prefill_object + member_value) do."""

from __future__ import annotations

import json
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from extproc.protocol import jsonspan
from extproc.protocol.errors import PdError
from extproc.protocol.prefill_json import parse_prefill_member, parse_prefill_object
from extproc.protocol.transport import WorkerReply

KEY = "kv_transfer_params"


def _by_spans(body: bytes) -> object:
    try:
        parsed, spans = parse_prefill_object(WorkerReply(200, "application/json", body))
    except PdError as error:
        return error.code
    return parsed, jsonspan.member_value(body, spans, KEY)


def _by_count(body: bytes) -> object:
    try:
        return parse_prefill_member(WorkerReply(200, "application/json", body), KEY)
    except PdError as error:
        return error.code


TRICKY = [
    b'{"id": "x", "kv_transfer_params": {"remote_block_ids": [[1, 2]], "h": "a\\"}b"}}',
    b'{"kv_transfer_params": {"a": 1}, "kv_transfer_params": {"a": 2}}',  # a repeated key
    b'{"kv_transfer_param\\u0073": {"a": 1}, "kv_transfer_params": {"a": 2}}',  # repeated, one escaped
    b'{"kv_transfer_param\\u0073": {"a": 1}}',  # escaped, alone
    b'{"a": 1, "\\u0061": 2, "kv_transfer_params": {}}',  # a repeat hidden by an escape
    b'{"text": "\\"kv_transfer_params\\": {\\"x\\": 1}", "kv_transfer_params": null}',  # the key in a string
    b'{"choices": [{"message": {"kv_transfer_params": {"x": 1}}}]}',  # only nested: absent at the top
    b' {\n "kv_transfer_params" :\t[ {"x" : "]}"} ] , "z": "\\\\" }\n',
    '{"é": "日本", "kv_transfer_params": {"remote_host": "ü"}}'.encode(),
    b'{"deep": ' + b"[" * 10 + b"]" * 10 + b', "kv_transfer_params": {"a": [1]}}',
    b'{}',
    b'{"kv_transfer_params": "' + b"x" * 20000 + b'"}',  # beyond the fast path
    b'[]', b'"s"', b'{"a": 1', b'not json', b'data: {"a": 1}',
]


def test_the_count_shortcut_agrees_with_the_spans_on_tricky_replies() -> None:
    for body in TRICKY:
        assert _by_count(body) == _by_spans(body), body


_text = st.text(alphabet=st.sampled_from('"\\[]{}:, ae\u00e9\n'), max_size=6) | st.sampled_from([KEY, "id", "a"])
_values = st.recursive(st.none() | st.booleans() | st.integers() | _text,
                       lambda children: st.lists(children, max_size=3) | st.dictionaries(_text, children, max_size=3),
                       max_leaves=15)


@settings(max_examples=400, deadline=None)
@given(st.lists(st.tuples(_text, _values), max_size=6), st.booleans(), st.sampled_from([None, 1]))
def test_the_count_shortcut_agrees_with_the_spans(members: list[tuple[str, Any]], ascii_only: bool,
                                                   indent: int | None) -> None:
    # Members written one by one, so a repeated key stays repeated in the bytes.
    parts = [json.dumps(name, ensure_ascii=ascii_only) + ":" + json.dumps(value, ensure_ascii=ascii_only, indent=indent)
             for name, value in members]
    body = ("{" + ", ".join(parts) + "}").encode()
    assert _by_count(body) == _by_spans(body)
