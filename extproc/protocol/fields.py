"""Validation pieces every engine adapter shares: value checks, field-rule tables for handoffs, the
client fields an engine reserves, and setting members in a body. Pure.

One meaning everywhere: a field that is absent is ``missing``; a field present with a value its rule
refuses is ``invalid``. Only an engine whose models read ``null`` as "not set" (pydantic ``Optional``
fields, e.g. TensorRT-LLM) declares ``null_is_absent``, and then a required ``null`` is ``missing``
too. Errors name fields from the rule tables only, never anything a worker sent.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sized
from dataclasses import dataclass

from extproc.protocol import jsonspan
from extproc.protocol.errors import Code, PdError, Problem

Check = Callable[[object], bool]


def is_int(value: object) -> bool:
    """A JSON integer: Python's bool is an int subclass, and JSON's true is not a number."""
    return isinstance(value, int) and not isinstance(value, bool)


_INT_ONLY = frozenset({int})


def all_ints(values: Iterable[object]) -> bool:
    """Every item a JSON integer (as ``is_int``: true and false, whose type is bool, are not), at C
    speed: token ids and handoff block ids run to tens of thousands."""
    return set(map(type, values)) <= _INT_ONLY


def int_at_least(minimum: int) -> Check:
    def check(value: object) -> bool:
        return is_int(value) and value >= minimum  # type: ignore[operator]

    return check


def non_empty_str(value: object) -> bool:
    return isinstance(value, str) and value != ""


def is_port(value: object) -> bool:
    return is_int(value) and 1 <= value <= 65535  # type: ignore[operator]


def equals(expected: object) -> Check:
    """The value is exactly ``expected`` (``True`` is not ``1``)."""
    return lambda value: type(value) is type(expected) and value == expected


def null_or(check: Check) -> Check:
    return lambda value: value is None or check(value)


def list_of(check: Check, *, non_empty: bool = False) -> Check:
    return lambda value: isinstance(value, list) and (bool(value) or not non_empty) and all(check(v) for v in value)


def handoff_error(field: str, problem: Problem) -> PdError:
    return PdError(Code.INVALID_PREFILL_HANDOFF, field=field, problem=problem)


def handoff_members(raw: bytes, field: str) -> list[jsonspan.Member]:
    """The members of an object inside a prefill reply that an adapter reads (``raw`` a JSON object a
    parser accepted), each key once: a repeated key is ``<field> has a duplicate field``."""
    try:
        return jsonspan.unique_members(raw)
    except jsonspan.RepeatedKey:
        raise handoff_error(field, Problem.DUPLICATE_FIELD) from None


def refuse_repeated_handoff_keys(raw: bytes, parsed: Sized, field: str) -> None:
    """``handoff_members``' refusal without the members: ``raw`` is the JSON object a parser read as
    ``parsed`` (which keeps one copy of a repeated key), so more members than parsed keys is a repeat."""
    if jsonspan.member_count(raw) != len(parsed):
        raise handoff_error(field, Problem.DUPLICATE_FIELD)


@dataclass(frozen=True, slots=True)
class FieldRule:
    check: Check
    required: bool


@dataclass(frozen=True, slots=True)
class FieldRules:
    """The rule table of one JSON object an engine hands back (vLLM's kv_transfer_params, TensorRT-LLM's
    disaggregated_params). Fields without a rule are forwarded unchecked."""

    name: str
    rules: Mapping[str, FieldRule]
    null_is_absent: bool = False

    def check(self, value: object) -> None:
        """Raise invalid_prefill_handoff naming the first offending field, in table order."""
        if value is None:
            raise handoff_error(self.name, Problem.MISSING)
        if not isinstance(value, dict):
            raise handoff_error(self.name, Problem.NOT_AN_OBJECT)
        for name, rule in self.rules.items():
            absent = name not in value or (self.null_is_absent and value[name] is None)
            if absent:
                if rule.required:
                    raise handoff_error(f"{self.name}.{name}", Problem.MISSING)
                continue
            if not rule.check(value[name]):
                raise handoff_error(f"{self.name}.{name}", Problem.INVALID)


@dataclass(frozen=True, slots=True)
class ReservedField:
    """A request field the P/D route sets itself. A client value is refused unless it is one of
    ``tolerated`` (e.g. ``null``, or the ``{}`` some SDKs send for kv_transfer_params)."""

    name: str
    tolerated: tuple[object, ...] = (None,)

    def allows(self, value: object) -> bool:
        return any(type(value) is type(ok) and value == ok for ok in self.tolerated)


def refuse_reserved(body: Mapping[str, object], reserved: Iterable[ReservedField]) -> None:
    """Raise reserved_request_field for the first reserved field the client set to a value of its own."""
    for field in reserved:
        if field.name in body and not field.allows(body[field.name]):
            raise PdError(Code.RESERVED_REQUEST_FIELD, field=field.name)


def set_members(raw: bytes, spans: Iterable[jsonspan.Member], values: Mapping[str, bytes | None],
                last: Iterable[tuple[str, bytes]] = ()) -> bytes:
    """``raw`` with each named member set: replaced in place where present, appended (in ``values``'
    order) where absent; a None value drops the member. Then each ``last`` member is dropped where
    present and appended at the end. Every other member keeps its bytes."""
    spans = list(spans)
    last = list(last)
    present = {member.name for member in spans}
    append = [(name, value) for name, value in values.items() if name not in present and value is not None]
    replace = {**values, **{name: None for name, _ in last}} if last else values
    return jsonspan.rebuild(raw, spans, replace, [*append, *last])
