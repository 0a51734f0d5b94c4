"""vLLM NIXL pull handoff (NixlConnector / NixlPullConnector), pinned to vLLM 0.32 and 0.33.

    client request ──► derived prefill-only request ──► prefill worker (kv_producer)
                                                   ◄── kv_transfer_params (the handoff)
    validate the handoff ──► client request + handoff verbatim ──► local decode worker (kv_consumer)

The field contract, the fixtures and the upgrade checklist are in PROTOCOL.md ("vllm_nixl").
Deliberate limits, each enforced where noted below: neither leg is retried; ``n`` other than 1 and
client-supplied ``kv_transfer_params`` are refused before any leg (openai_request.py); the handoff's
remote_host/remote_port are connector side-channel data and never an HTTP destination.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import orjson

from extproc import jsonspan
from extproc.adapters.base import DecodeWith, Flow, Plan, PrefillReply, ServerInfo
from extproc.adapters.prefill_json import member_value, parse_prefill_object
from extproc.errors import Code, PdError
from extproc.openai_request import ClientRequest, Endpoint
from extproc.prefill_target import PrefillTarget

PROTOCOL_0_32 = "vllm-0.32-nixl-pull"
PROTOCOL_0_33 = "vllm-0.33-nixl-pull"
PROTOCOLS = (PROTOCOL_0_32, PROTOCOL_0_33)
KEY = "kv_transfer_params"

# What the producer (prefill) request carries: vLLM keys on do_remote_decode alone.
PRODUCER_PARAMS = orjson.dumps({
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
})
_ONE = b"1"
_FALSE = b"false"
# Fields that only make sense when tokens are generated; vLLM rejects min_tokens > max_tokens.
_PREFILL_DROPPED = ("stream_options", "min_tokens", "min_completion_tokens")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_true(value: object) -> bool:
    return value is True


def _is_false(value: object) -> bool:
    return value is False


def _non_empty_str(value: object) -> bool:
    return isinstance(value, str) and value != ""


def _port(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 1 <= value <= 65535


def _int_at_least(minimum: int) -> Callable[[object], bool]:
    def check(value: object) -> bool:
        return isinstance(value, int) and not isinstance(value, bool) and value >= minimum

    return check


def _null_or_number(value: object) -> bool:
    return value is None or (isinstance(value, int | float) and not isinstance(value, bool))


def _pull_mode(value: object) -> bool:
    return value == "pull"


def _block_groups(value: object) -> bool:
    """list[list[int]] with at least one group. Empty groups are legal (a full prefix-cache hit on
    decode still needs the notification that frees the producer's blocks); an empty outer list is
    not: vLLM's decode scheduler asserts on a falsy remote_block_ids with a non-empty prompt."""
    if not isinstance(value, list) or not value:
        return False
    return all(isinstance(group, list) and all(_is_int(b) and b >= 0 for b in group) for group in value)


@dataclass(frozen=True, slots=True)
class FieldRule:
    check: Callable[[object], bool]
    required: bool


_RULES_0_32: Mapping[str, FieldRule] = {
    "do_remote_prefill": FieldRule(_is_true, required=True),
    "do_remote_decode": FieldRule(_is_false, required=True),
    "remote_block_ids": FieldRule(_block_groups, required=True),
    "remote_engine_id": FieldRule(_non_empty_str, required=True),
    "remote_request_id": FieldRule(_non_empty_str, required=True),
    "remote_host": FieldRule(_non_empty_str, required=True),
    "remote_port": FieldRule(_port, required=True),
    "tp_size": FieldRule(_int_at_least(1), required=True),
    "dcp_size": FieldRule(_int_at_least(1), required=False),
    "pp_size": FieldRule(_int_at_least(1), required=False),
    "remote_num_tokens": FieldRule(_int_at_least(0), required=False),
    "remote_blocks_expiry_time": FieldRule(_null_or_number, required=False),
    "transfer_mode": FieldRule(_pull_mode, required=False),
    "remote_prefill_cached_tokens": FieldRule(_int_at_least(0), required=False),
}
_RULES: Mapping[str, Mapping[str, FieldRule]] = {
    PROTOCOL_0_32: _RULES_0_32,
    PROTOCOL_0_33: {**_RULES_0_32, "remote_registration_generation": FieldRule(_int_at_least(0), False)},
}


def validate_handoff(params: object, protocol: str) -> None:
    """Raise PdError(invalid_prefill_handoff) unless ``params`` is a handoff a decode worker can use.
    The error names the first offending field, always a name from the rule table."""
    if params is None:
        raise PdError(Code.INVALID_PREFILL_HANDOFF, param=KEY + " is missing")
    if not isinstance(params, dict):
        raise PdError(Code.INVALID_PREFILL_HANDOFF, param=KEY + " is not an object")
    for name, rule in _RULES[protocol].items():
        if name not in params:
            if rule.required:
                raise PdError(Code.INVALID_PREFILL_HANDOFF, param=f"{KEY}.{name} is missing")
            continue
        if not rule.check(params[name]):
            raise PdError(Code.INVALID_PREFILL_HANDOFF, param=f"{KEY}.{name} is invalid")


def prefill_body(request: ClientRequest) -> bytes:
    """The derived prefill-only request: the client's members verbatim except the P/D rewrites."""
    replace: dict[str, bytes | None] = {name: None for name in _PREFILL_DROPPED}
    replace.update({"stream": _FALSE, "max_tokens": _ONE, KEY: None})
    present = {m.name for m in request.members}
    append = [("stream", _FALSE)] if "stream" not in present else []
    if "max_tokens" not in present:
        append.append(("max_tokens", _ONE))
    if "max_completion_tokens" in present:
        replace["max_completion_tokens"] = _ONE
    elif request.endpoint is Endpoint.CHAT:
        append.append(("max_completion_tokens", _ONE))
    append.append((KEY, PRODUCER_PARAMS))
    return jsonspan.rebuild(request.raw, request.members, replace, append)


def decode_body(request: ClientRequest, handoff_raw: bytes) -> bytes:
    """The client's request verbatim with the prefill worker's handoff bytes as kv_transfer_params."""
    if any(m.name == KEY for m in request.members):  # a tolerated null or {} from the client
        return jsonspan.rebuild(request.raw, request.members, {KEY: handoff_raw})
    return jsonspan.rebuild(request.raw, request.members, {}, [(KEY, handoff_raw)])


def handoff_from_reply(reply: PrefillReply, protocol: str) -> bytes:
    """Validate the prefill reply and return the raw bytes of its kv_transfer_params value."""
    parsed, spans = parse_prefill_object(reply)
    params: Any = parsed.get(KEY)
    validate_handoff(params, protocol)
    raw = member_value(reply.body, spans, KEY)
    assert raw is not None
    return raw


class VllmNixlAdapter:
    name: ClassVar[str] = "vllm_nixl"
    flow: ClassVar[Flow] = Flow.SEQUENTIAL
    server_info_path: ClassVar[str | None] = None
    protocols: ClassVar[tuple[str, ...]] = PROTOCOLS

    def __init__(self, protocol: str = PROTOCOL_0_32) -> None:
        if protocol not in PROTOCOLS:
            raise ValueError(protocol)
        self._protocol = protocol

    @property
    def protocol(self) -> str:
        return self._protocol

    def plan(self, request: ClientRequest, target: PrefillTarget, nonce: int, server_info: ServerInfo | None) -> Plan:
        return Plan(prefill_body=prefill_body(request))

    def decide(self, request: ClientRequest, reply: PrefillReply) -> DecodeWith:
        return DecodeWith(decode_body(request, handoff_from_reply(reply, self._protocol)))

    def check_background(self, reply: PrefillReply) -> None:
        raise AssertionError("a sequential adapter has no background prefill")
