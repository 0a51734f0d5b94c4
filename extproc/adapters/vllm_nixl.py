"""vLLM NIXL pull handoff (NixlConnector / NixlPullConnector), pinned to vLLM 0.32 and 0.33.

    client request ──► derived prefill-only request ──► prefill worker (kv_producer)
                                                   ◄── kv_transfer_params (the handoff)
    validate the handoff ──► client request + handoff verbatim ──► local decode worker (kv_consumer)

The field contract, the fixtures and the upgrade checklist are in PROTOCOL.md ("vllm_nixl").
Deliberate limits: neither leg is retried (the transport resends a prefill request only when a reused
connection closed before any answer); ``n`` other than 1 is refused before any leg
(openai_request.py) and so is a client-supplied ``kv_transfer_params`` (a reserved field); the
handoff's remote_host/remote_port are connector side-channel data and never an HTTP destination.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

import orjson

from extproc.adapters.base import (
    DecodeWith,
    Engine,
    Flow,
    Options,
    PlanInput,
    QueueGauges,
    SequentialAdapter,
)
from extproc.adapters.prefill_request import one_token_unstreamed
from extproc.adapters.vllm_apis import PREFILLS
from extproc.protocol.fields import (
    FieldRule,
    FieldRules,
    ReservedField,
    all_ints,
    equals,
    int_at_least,
    is_port,
    non_empty_str,
    refuse_repeated_handoff_keys,
    set_members,
)
from extproc.protocol.openai_request import OPENAI_ENDPOINTS, ClientRequest, Endpoint
from extproc.protocol.prefill_json import parse_prefill_member
from extproc.protocol.transport import WorkerReply

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
# Fields that only make sense when tokens are generated; vLLM rejects min_tokens > max_tokens.
_PREFILL_DROPPED = ("min_tokens", "min_completion_tokens")


def _null_or_number(value: object) -> bool:
    return value is None or (isinstance(value, int | float) and not isinstance(value, bool))



def _block_groups(value: object) -> bool:
    """list[list[int]] with at least one group. Empty groups are legal (a full prefix-cache hit on
    decode still needs the notification that frees the producer's blocks); an empty outer list is
    not: vLLM's decode scheduler asserts on a falsy remote_block_ids with a non-empty prompt."""
    if not isinstance(value, list) or not value:
        return False
    # A long prompt hands over thousands of block ids: checked at C speed (type(b) is int, as is_int,
    # refuses JSON's true and false, whose type is bool).
    return all(isinstance(group, list) and all_ints(group) and (not group or min(group) >= 0)
               for group in value)


# The consumer reads required fields with [] (nixl/metadata.py, add_new_req_to_recv): null is not absent.
_RULES_0_32: Mapping[str, FieldRule] = {
    "do_remote_prefill": FieldRule(equals(True), required=True),
    "do_remote_decode": FieldRule(equals(False), required=True),
    "remote_block_ids": FieldRule(_block_groups, required=True),
    "remote_engine_id": FieldRule(non_empty_str, required=True),
    "remote_request_id": FieldRule(non_empty_str, required=True),
    "remote_host": FieldRule(non_empty_str, required=True),
    "remote_port": FieldRule(is_port, required=True),
    "tp_size": FieldRule(int_at_least(1), required=True),
    "dcp_size": FieldRule(int_at_least(1), required=False),
    "pp_size": FieldRule(int_at_least(1), required=False),
    "remote_num_tokens": FieldRule(int_at_least(0), required=False),
    "remote_blocks_expiry_time": FieldRule(_null_or_number, required=False),
    "transfer_mode": FieldRule(equals("pull"), required=False),
    "remote_prefill_cached_tokens": FieldRule(int_at_least(0), required=False),
}
RULES: Mapping[str, FieldRules] = {
    PROTOCOL_0_32: FieldRules(KEY, _RULES_0_32),
    PROTOCOL_0_33: FieldRules(KEY, {**_RULES_0_32, "remote_registration_generation": FieldRule(int_at_least(0),
                                                                                               False)}),
}


def validate_handoff(params: object, protocol: str) -> None:
    """Raise PdError(invalid_prefill_handoff) unless ``params`` is a handoff a decode worker can use.
    The error names the first offending field, always a name from the rule table."""
    RULES[protocol].check(params)


def prefill_body(request: ClientRequest) -> bytes:
    """The derived prefill-only request: the client's members verbatim except the P/D rewrites."""
    other_api = PREFILLS.get(request.endpoint)
    if other_api is not None:
        return other_api(request, (KEY, PRODUCER_PARAMS))
    present = {m.name for m in request.members}
    caps = ["max_tokens"]
    if "max_completion_tokens" in present or request.endpoint is Endpoint.CHAT:
        caps.append("max_completion_tokens")
    dropped = dict.fromkeys(_PREFILL_DROPPED)
    return set_members(request.raw, request.members, {**one_token_unstreamed(caps), **dropped},
                       last=[(KEY, PRODUCER_PARAMS)])


def decode_body(request: ClientRequest, handoff_raw: bytes) -> bytes:
    """The client's request verbatim with the prefill worker's handoff bytes as kv_transfer_params
    (a tolerated null or {} from the client is replaced in place)."""
    return set_members(request.raw, request.members, {KEY: handoff_raw})


def handoff_from_reply(reply: WorkerReply, protocol: str) -> bytes:
    """Validate the prefill reply and return the raw bytes of its kv_transfer_params value."""
    parsed, raw = parse_prefill_member(reply, KEY)
    params: Any = parsed.get(KEY)
    if isinstance(params, dict) and raw is not None:
        refuse_repeated_handoff_keys(raw, params, KEY)  # each field once: what is validated is what decode reads
    validate_handoff(params, protocol)
    assert raw is not None
    return raw


class VllmNixlAdapter(SequentialAdapter):
    name: ClassVar[str] = "vllm_nixl"
    # Null and {} are tolerated as absent (the reference design's C08): some SDKs send an empty one.
    reserved_fields: ClassVar[tuple[ReservedField, ...]] = (ReservedField(KEY, (None, {})),)
    # Every API whose request and response carry kv_transfer_params at the pins (PROTOCOL.md).
    endpoints: ClassVar[frozenset[Endpoint]] = OPENAI_ENDPOINTS | frozenset(PREFILLS)

    def __init__(self, protocol: str = PROTOCOL_0_32) -> None:
        if protocol not in PROTOCOLS:
            raise ValueError(protocol)
        super().__init__(protocol)

    def prefill_body(self, request: ClientRequest, plan: PlanInput) -> bytes:
        return prefill_body(request)

    def decide(self, request: ClientRequest, reply: WorkerReply) -> DecodeWith:
        return DecodeWith(decode_body(request, handoff_from_reply(reply, self.protocol)))


def build(protocol: str, options: Options) -> VllmNixlAdapter:
    return VllmNixlAdapter(protocol)


ENGINE = Engine(
    name=VllmNixlAdapter.name, engine="vllm", pins=PROTOCOLS, flow=Flow.SEQUENTIAL, build=build,
    endpoints=VllmNixlAdapter.endpoints,
    # vllm/v1/metrics/loggers.py, PrometheusStatLogger: "Number of requests waiting to be processed."
    decode_queue=QueueGauges("/metrics", ("vllm:num_requests_waiting",)),
    emulator="pd_extproc_lab.emulator.vllm:VllmEmulator",
    summary="vLLM 0.32/0.33, NixlConnector (pull): prefill, validate kv_transfer_params, then decode",
)
