"""What goes over the wire in the real-engine stage: request bodies, SSE framing, JSON shapes.

A *shape* is the set of ``path: type`` lines of a JSON value (``$.choices[].index: integer``), so two
responses have the same shape when they have the same keys at the same places with the same JSON
types, whatever the values. Streams are compared as the sequence of their chunks' shapes with runs
of equal shapes collapsed (a real stream and an emulated one differ in length, not in structure).
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
PATHS = (CHAT, COMPLETIONS)
MAX_TOKENS = 8
DONE = b"data: [DONE]\n\n"

# The producer request our server sends on the prefill leg (PROTOCOL.md §4.1).
PRODUCER_PARAMS = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                   "remote_block_ids": None, "remote_host": None, "remote_port": None}

Shape = frozenset[str]


def request_body(path: str, model: str, prompt: str, **extra: Any) -> dict[str, Any]:
    """A greedy request of exactly MAX_TOKENS tokens (ignore_eos) for ``prompt``."""
    body: dict[str, Any] = {"model": model, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
    if path == CHAT:
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    body.update(extra)
    return body


def prefill_leg_body(path: str, body: dict[str, Any]) -> dict[str, Any]:
    """What our server derives for the prefill worker (PROTOCOL.md §4.1), for direct legs."""
    derived = {k: v for k, v in body.items() if k not in ("stream_options", "min_tokens", "min_completion_tokens")}
    derived.update(stream=False, max_tokens=1, kv_transfer_params=PRODUCER_PARAMS)
    if path == CHAT:
        derived["max_completion_tokens"] = 1
    return derived


def json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "array"
    if isinstance(value, dict):
        return "object"
    raise TypeError(f"not a JSON value: {type(value).__name__}")


def shape(value: Any, path: str = "$") -> Shape:
    lines = {f"{path}: {json_type(value)}"}
    if isinstance(value, dict):
        for key, member in value.items():
            lines |= shape(member, f"{path}.{key}")
    elif isinstance(value, list):
        for item in value:
            lines |= shape(item, f"{path}[]")
    return frozenset(lines)


def type_signature(value: Any) -> str:
    """A JSON type with nesting for arrays: ``array<array<integer>>`` for ``[[1, 2]]``."""
    if isinstance(value, list):
        inner = sorted({type_signature(item) for item in value})
        return f"array<{'|'.join(inner)}>"
    return json_type(value)


def shape_diff(expected: Shape, actual: Shape, expected_name: str, actual_name: str) -> str:
    only_expected = sorted(expected - actual)
    only_actual = sorted(actual - expected)
    return (f"only in {expected_name}: {only_expected}\nonly in {actual_name}: {only_actual}")


@dataclass(frozen=True)
class SseStream:
    """A text/event-stream body split into its events, with the framing checked."""

    raw: bytes
    events: list[bytes]

    @classmethod
    def parse(cls, raw: bytes) -> SseStream:
        """Every event must be exactly ``data: <payload>`` followed by a blank line (vLLM's framing)."""
        assert raw.endswith(b"\n\n"), f"stream does not end with a blank line: {raw[-80:]!r}"
        events = raw[:-2].split(b"\n\n")
        for event in events:
            assert event.startswith(b"data: "), f"event is not a single data line: {event[:80]!r}"
            assert b"\n" not in event, f"event spans several lines: {event[:80]!r}"
        return cls(raw, events)

    @property
    def ends_with_done(self) -> bool:
        return self.raw.endswith(DONE) and self.raw.count(b"data: [DONE]") == 1

    def chunks(self) -> list[dict[str, Any]]:
        """The JSON events (all but the final [DONE])."""
        payloads = [event.removeprefix(b"data: ") for event in self.events if event != b"data: [DONE]"]
        return [json.loads(payload) for payload in payloads]

    def text(self, path: str) -> str:
        pieces = []
        for chunk in self.chunks():
            for choice in chunk.get("choices", []):
                pieces.append((choice["delta"].get("content") or "") if path == CHAT else choice["text"])
        return "".join(pieces)

    def usage(self) -> dict[str, Any] | None:
        usages = [chunk["usage"] for chunk in self.chunks() if chunk.get("usage")]
        return usages[-1] if usages else None


def chunk_kind(chunk: dict[str, Any]) -> str:
    """What a stream chunk is for: ``role`` (chat's opening delta), ``content``, ``final`` (carries the
    finish_reason) or ``usage`` (no choices)."""
    choices = chunk.get("choices") or []
    if not choices:
        return "usage"
    if choices[0].get("finish_reason") is not None:
        return "final"
    if "role" in (choices[0].get("delta") or {}):
        return "role"
    return "content"


@dataclass(frozen=True)
class StreamOutline:
    """A stream as the order of its chunk kinds (consecutive repeats collapsed) and each kind's shapes."""

    kinds: tuple[str, ...]
    shapes: dict[str, frozenset[Shape]]

    @classmethod
    def of(cls, chunks: Iterable[dict[str, Any]]) -> StreamOutline:
        kinds: list[str] = []
        shapes: dict[str, set[Shape]] = {}
        for chunk in chunks:
            kind = chunk_kind(chunk)
            if not kinds or kinds[-1] != kind:
                kinds.append(kind)
            shapes.setdefault(kind, set()).add(shape(chunk))
        return cls(tuple(kinds), {kind: frozenset(found) for kind, found in shapes.items()})

    def without_content(self) -> StreamOutline:
        """vLLM coalesces the deltas of a stream whose reader falls behind, down to the final chunk alone:
        ``content`` chunks may legitimately be absent from one run and present in the next."""
        kinds = tuple(kind for kind in self.kinds if kind != "content")
        return StreamOutline(kinds, {k: v for k, v in self.shapes.items() if k != "content"})


def output_text(path: str, response: dict[str, Any]) -> str:
    choice = response["choices"][0]
    return str(choice["message"]["content"] if path == CHAT else choice["text"])
