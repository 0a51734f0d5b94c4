"""Everything the P/D route checks in the client's body, as one pure step: bytes in, a small picklable
answer out. Small bodies are inspected on the event loop; large ones in a worker process
(pipeline/inspector.py), so the answer carries no large value and no exception object.

The answer keeps the parsed top-level members whose values are at most ``KEPT_VALUE_BYTES`` long (what
the adapters read after the checks: ``stream``, ``stream_options``); large values (the messages, a
prompt) are checked here and reach the engines as the client's bytes, never as parsed objects.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from extproc.protocol import jsonspan
from extproc.protocol.errors import Code, PdError, Problem
from extproc.protocol.fields import ReservedField, refuse_reserved
from extproc.protocol.openai_request import OPENAI_ENDPOINTS, ClientRequest, Endpoint, parse_client_request
from extproc.protocol.steering import refuse_steering

# A member kept parsed; with MAX_MEMBERS this bounds what a worker's answer costs to unpickle on the loop.
KEPT_VALUE_BYTES = 1 << 10
# The flags an adapter reads from a member whose value is larger (a client may pad it): kept alone
# (trtllm reads stream_options.include_usage for its direct answer's usage chunk).
KEPT_FLAGS = {"stream_options": ("include_usage", "continuous_usage_stats")}


@dataclass(frozen=True, slots=True)
class Rules:
    """What the route refuses besides the OpenAI checks (fixed for the server's life)."""

    max_bytes: int
    reserved: tuple[ReservedField, ...] = ()
    own_fields: frozenset[str] = frozenset()  # the adapter's own reserved names: the steering check skips them
    served: frozenset[Endpoint] = OPENAI_ENDPOINTS  # the endpoints the adapter serves P/D


@dataclass(frozen=True, slots=True)
class Inspected:
    endpoint: Endpoint
    members: tuple[jsonspan.Member, ...]
    kept: dict[str, Any]
    unsupported: str | None
    nested: dict[str, tuple[jsonspan.Member, ...]]


@dataclass(frozen=True, slots=True)
class Refusal:
    """A PdError as data: an exception with keyword-only arguments does not survive pickling."""

    code: Code
    field: str | None
    problem: Problem | None

    def error(self) -> PdError:
        return PdError(self.code, field=self.field, problem=self.problem)


def inspect(path: str, content_type: str | None, raw: bytes, rules: Rules) -> Inspected:
    """Parse and check the body; raise PdError for anything refused. An unsupported variant is
    returned (``unsupported`` names it), not refused: the processor decides what to do with it."""
    request = parse_client_request(path, content_type, raw, rules.max_bytes, allow_unsupported=True,
                                   served=rules.served)
    refuse_reserved(request.body, rules.reserved)
    refuse_steering(request.body, rules.own_fields)
    kept = {}
    for member in request.members:
        value = request.body[member.name]
        if member.end - member.value_start <= KEPT_VALUE_BYTES:
            kept[member.name] = value
        elif member.name in KEPT_FLAGS and isinstance(value, dict):
            kept[member.name] = {flag: value[flag] for flag in KEPT_FLAGS[member.name]
                                 if isinstance(value.get(flag), bool)}
    return Inspected(request.endpoint, request.members, kept, request.unsupported, dict(request.nested))


def inspect_answer(path: str, content_type: str | None, raw: bytes, rules: Rules) -> Inspected | Refusal:
    """``inspect`` with its refusal as data: what a worker process runs."""
    try:
        return inspect(path, content_type, raw, rules)
    except PdError as error:
        return Refusal(error.code, error.field, error.problem)


def client_request(path: str, raw: bytes, inspected: Inspected) -> ClientRequest:
    return ClientRequest(endpoint=inspected.endpoint, path=path, raw=raw, body=inspected.kept,
                         members=inspected.members, unsupported=inspected.unsupported, nested=inspected.nested)
