"""SGLang PD bootstrap (mooncake / nixl transfer backends), pinned to SGLang 0.5.23.

    client request ─┬─► prefill worker: client body + bootstrap_host/port/room, stream false   (background, drained)
                    └─► local decode worker: client body + the same three fields              (Envoy, at once)
    decode worker ──► prefill worker's bootstrap server (bootstrap_host:bootstrap_port) ──► the KV of bootstrap_room

Both legs start together; the engines meet on ``bootstrap_room`` and the prefill engine pushes the KV.
The decode response is the client's answer; the prefill response is drained, checked and discarded
(a failure there is logged and counted, it cannot reach the client any more).

Field names and JSON types are SGLang's (PROTOCOL.md, "sglang"): ``PDRoutingFields`` in
``sglang/srt/entrypoints/openai/protocol.py``; the bootstrap port default (8998) and the
``/server_info`` key ``disaggregation_bootstrap_port`` in ``srt/arg_groups/fields/disagg.py`` and
``srt/entrypoints/http_server.py``; unchanged since 0.5.19.

Deliberate limits: ``n`` other than 1 and completion batches are refused before any leg
(openai_request.py), so the three fields are always scalars; a client-supplied bootstrap field is
refused as a reserved field (it would point decode at a host of the client's choosing);
``bootstrap_host`` is the address the processor resolved and checked against the prefill policy
(never a name the decode engine would resolve again); neither leg is retried (but for the
transport's resend on a stale reused connection).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar, Literal

import orjson

from extproc.adapters.base import (
    ConcurrentAdapter,
    ConcurrentPlan,
    DecodeAbort,
    DecodeWith,
    Demo,
    Engine,
    Flow,
    Options,
    PlanInput,
    QueueGauges,
)
from extproc.adapters.prefill_request import one_token_unstreamed
from extproc.protocol import jsonspan
from extproc.protocol.errors import Problem
from extproc.protocol.fields import ReservedField, handoff_error, handoff_members, is_port, set_members
from extproc.protocol.openai_request import OPENAI_ENDPOINTS, ClientRequest, Endpoint
from extproc.protocol.prefill_json import parse_prefill_object
from extproc.protocol.settings_spec import SettingSpec, existing_file, positive_duration, read_token_file
from extproc.protocol.transport import WorkerReply

PROTOCOL_0_5_23 = "sglang-0.5.23-bootstrap"
PROTOCOLS = (PROTOCOL_0_5_23,)
DEFAULT_BOOTSTRAP_PORT = 8998  # SGLang's --disaggregation-bootstrap-port default
SERVER_INFO_PATH = "/server_info"
BOOTSTRAP_FIELDS = ("bootstrap_host", "bootstrap_port", "bootstrap_room")
RID = "rid"  # protocol.py: ``rid: Optional[Union[List[str], str]]``, passed to GenerateReqInput as is
ABORT_PATH = "/abort_request"  # http_server.py, abort_request: AbortReq {"rid", "abort_all"}, 200 empty
SERVER_INFO_KEYS = ("disaggregation_mode", "disaggregation_bootstrap_port")
# entrypoints/request_headers.py, _HEADER_OVERRIDES: with SGLANG_ENABLE_REQUEST_HEADER_OVERRIDES=1 these
# headers replace the fields we set (chat and /generate). A client's copy would re-point a leg at
# another room, rid or prefill rank, so they are removed from both legs, whatever the engine's setting.
OVERRIDE_HEADERS = frozenset({"x-override-rid", "x-override-bootstrap-host", "x-override-bootstrap-port",
                              "x-override-bootstrap-room", "x-override-disagg-prefill-dp-rank"})
API_KEY_SETTING = "sglang_api_key_file"
ADMIN_KEY_SETTING = "sglang_admin_api_key_file"
BOOTSTRAP_PORT_SETTING = "sglang_bootstrap_port"
PREFILL_DEADLINE_SETTING = "sglang_prefill_deadline"
# SGLang's own bounds on a P/D request: SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT (prefill waits for
# decode) and SGLANG_DISAGGREGATION_WAITING_TIMEOUT (decode waits for the KV), 300 s each
# (srt/environ.py). Ours is longer, so the engines' own timeouts end a stuck request first.
ENGINE_TIMEOUT = 300.0
DEFAULT_PREFILL_DEADLINE = ENGINE_TIMEOUT + 30.0
# bootstrap_room is stored in an int64/uint64 metadata buffer on both engines; 0 there means "no
# metadata landed yet", so a room of 0 would never complete. Rooms are 1 <= room < 2**63.
ROOM_LIMIT = 1 << 63


def room_from_nonce(nonce: int) -> int:
    """A bootstrap room in [1, 2**63) from the processor's 63-bit random nonce."""
    return 1 + nonce % (ROOM_LIMIT - 1)


def rid_from_nonce(nonce: int) -> str:
    """Our request id on both legs. Fixed length: SGLang's scheduler aborts every rid that *starts
    with* the aborted one (scheduler.py, abort_request), so no rid of ours may prefix another."""
    return f"pd-{nonce:016x}"


def bootstrap_port_from(server_info: Mapping[str, Any]) -> int:
    """The prefill engine's bootstrap port from its /server_info; it must be a prefill-mode engine."""
    if server_info.get("disaggregation_mode") != "prefill":
        raise handoff_error("server_info.disaggregation_mode", Problem.INVALID)
    if "disaggregation_bootstrap_port" not in server_info:
        raise handoff_error("server_info.disaggregation_bootstrap_port", Problem.MISSING)
    port = server_info["disaggregation_bootstrap_port"]
    if not is_port(port):
        raise handoff_error("server_info.disaggregation_bootstrap_port", Problem.INVALID)
    assert isinstance(port, int)
    return port


def bootstrap_members(host: str, port: int, room: int, rid: str) -> list[tuple[str, bytes]]:
    """The members both legs get: the three bootstrap fields (a string and two JSON integers, never
    floats) and our request id."""
    return [("bootstrap_host", orjson.dumps(host)), ("bootstrap_port", str(port).encode()),
            ("bootstrap_room", str(room).encode()), (RID, orjson.dumps(rid))]


def _without_client_bootstrap() -> dict[str, bytes | None]:
    return {name: None for name in (*BOOTSTRAP_FIELDS, RID)}  # drops a tolerated null: each key once


def prefill_body(request: ClientRequest, bootstrap: list[tuple[str, bytes]]) -> bytes:
    """The client's body with the bootstrap fields, as one JSON response (its result is only checked)."""
    return set_members(request.raw, request.members, {**_without_client_bootstrap(), **one_token_unstreamed()},
                       last=bootstrap)


def decode_body(request: ClientRequest, bootstrap: list[tuple[str, bytes]]) -> bytes:
    """The client's body, byte for byte, plus the bootstrap fields."""
    return set_members(request.raw, request.members, _without_client_bootstrap(), last=bootstrap)


def check_prefill_reply(reply: WorkerReply) -> None:
    """A drained prefill reply is a success only if it is SGLang's non-aborted completion: OpenAI's
    ``choices`` (chat, completions) or /generate's ``meta_info`` (http_server.py generate_request)."""
    parsed, spans = parse_prefill_object(reply)
    if "choices" not in parsed and "meta_info" in parsed:
        _check_generate_reply(reply, parsed, spans)
        return
    choices = parsed.get("choices")
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        raise handoff_error("choices", Problem.MISSING)
    choice_raw = jsonspan.first_element(jsonspan.member_value(reply.body, spans, "choices") or b"[]")
    assert choice_raw is not None
    handoff_members(choice_raw, "choices")  # finish_reason once: "abort" cannot hide behind a second copy
    if choices[0].get("finish_reason") == "abort":
        raise handoff_error("choices.finish_reason", Problem.ABORTED)


def _check_generate_reply(reply: WorkerReply, parsed: dict[str, Any], spans: list[jsonspan.Member]) -> None:
    """/generate: ``meta_info.finish_reason`` is an object whose ``type`` is "abort" for an aborted
    request (srt/managers/schedule_batch.py FINISH_ABORT.to_json)."""
    meta = parsed["meta_info"]
    if not isinstance(meta, dict):
        raise handoff_error("meta_info", Problem.NOT_AN_OBJECT)
    meta_raw = jsonspan.member_value(reply.body, spans, "meta_info")
    assert meta_raw is not None
    meta_spans = handoff_members(meta_raw, "meta_info")  # finish_reason once
    finish = meta.get("finish_reason")
    if isinstance(finish, dict):
        finish_raw = jsonspan.member_value(meta_raw, meta_spans, "finish_reason")
        assert finish_raw is not None
        handoff_members(finish_raw, "meta_info.finish_reason")  # its type once
        if finish.get("type") == "abort":
            raise handoff_error("meta_info.finish_reason", Problem.ABORTED)


class SglangAdapter(ConcurrentAdapter):
    """Bootstrap port from the settings (SGLang's default 8998 unless configured), or with
    ``bootstrap_port=None`` read from each prefill worker's /server_info (cached by the processor)."""

    name: ClassVar[str] = "sglang"
    # Chat, completions and the native /generate (its own request, both legs' fields top-level in
    # GenerateReqInput). /v1/messages and /v1/responses stay passthrough (PROTOCOL.md, "Generation APIs").
    endpoints: ClassVar[frozenset[Endpoint]] = OPENAI_ENDPOINTS | {Endpoint.SGLANG_GENERATE}
    reserved_fields: ClassVar[tuple[ReservedField, ...]] = tuple(ReservedField(name) for name in
                                                               (*BOOTSTRAP_FIELDS, RID))
    reserved_headers = OVERRIDE_HEADERS
    server_info_keys = SERVER_INFO_KEYS

    def __init__(self, protocol: str = PROTOCOL_0_5_23, bootstrap_port: int | None = DEFAULT_BOOTSTRAP_PORT,
                 prefill_deadline: float = DEFAULT_PREFILL_DEADLINE, api_key: bytes | None = None,
                 admin_api_key: bytes | None = None) -> None:
        if protocol not in PROTOCOLS:
            raise ValueError(protocol)
        super().__init__(protocol)
        self._bootstrap_port = bootstrap_port
        self.server_info_path = SERVER_INFO_PATH if bootstrap_port is None else None
        self.prefill_deadline = prefill_deadline
        self._api_key = api_key
        # /abort_request is ADMIN_OPTIONAL (utils/auth.py): the admin key when the engine has one,
        # else its API key.
        self._abort_key = admin_api_key or api_key

    @property
    def discovery_headers(self) -> tuple[tuple[str, str], ...]:
        return _bearer(self._api_key)

    def _port(self, plan: PlanInput) -> int:
        if self._bootstrap_port is not None:
            return self._bootstrap_port
        if plan.server_info is None:
            raise AssertionError("the processor passes /server_info to a discovering adapter")
        return bootstrap_port_from(plan.server_info)

    def plan(self, request: ClientRequest, plan: PlanInput) -> ConcurrentPlan:
        rid = rid_from_nonce(plan.nonce)
        bootstrap = bootstrap_members(plan.target.host, self._port(plan), room_from_nonce(plan.nonce), rid)
        abort = DecodeAbort(ABORT_PATH, orjson.dumps({"rid": rid, "abort_all": False}), _bearer(self._abort_key))
        return ConcurrentPlan(prefill_body(request, bootstrap), DecodeWith(decode_body(request, bootstrap)), abort)

    def check_prefill(self, reply: WorkerReply) -> None:
        check_prefill_reply(reply)


def _bootstrap_port(text: str) -> int | Literal["discover"]:
    value = text.strip()
    if value == "discover":
        return "discover"
    if not (value.isascii() and value.isdigit()) or not 1 <= int(value) <= 65535:
        raise ValueError("expected a port 1-65535 or discover")
    return int(value)


def _bearer(key: bytes | None) -> tuple[tuple[str, str], ...]:
    """utils/auth.py, ``_check_bearer_token``: "Bearer", one space, the key."""
    return () if key is None else (("authorization", "Bearer " + key.decode("latin-1")),)


def _key(options: Options, name: str) -> bytes | None:
    path = options.get(name) or ""
    return read_token_file(path) if path else None


def build(protocol: str, options: Options) -> SglangAdapter:
    port = options.get(BOOTSTRAP_PORT_SETTING, DEFAULT_BOOTSTRAP_PORT)
    return SglangAdapter(protocol, None if port == "discover" else int(port),
                         float(options.get(PREFILL_DEADLINE_SETTING, DEFAULT_PREFILL_DEADLINE)),
                         _key(options, API_KEY_SETTING), _key(options, ADMIN_KEY_SETTING))


ENGINE = Engine(
    name=SglangAdapter.name, engine="sglang", pins=PROTOCOLS, flow=Flow.CONCURRENT, build=build,
    endpoints=SglangAdapter.endpoints,
    # observability/metrics_collector.py: the waiting queue and, on a decode engine, the requests still
    # waiting to allocate (and to bootstrap) before their KV can land.
    decode_queue=QueueGauges("/metrics", ("sglang:num_queue_reqs", "sglang:num_decode_prealloc_queue_reqs")),
    emulator="pd_extproc_lab.emulator.sglang:SglangEmulator",
    settings=(SettingSpec(BOOTSTRAP_PORT_SETTING, _bootstrap_port,
                          "sglang adapter: the prefill workers' bootstrap port (1-65535), or discover (read "
                          "disaggregation_bootstrap_port from each prefill worker's /server_info, cached)",
                          default=DEFAULT_BOOTSTRAP_PORT),
              SettingSpec(PREFILL_DEADLINE_SETTING, positive_duration,
                          "sglang adapter: total deadline of the background prefill request (it answers only after "
                          "decode pulled the KV); above SGLang's own 300 s bootstrap and waiting timeouts",
                          default=DEFAULT_PREFILL_DEADLINE),
              SettingSpec(API_KEY_SETTING, existing_file,
                          "sglang adapter: file holding the workers' --api-key, sent on our own requests "
                          "(/server_info discovery, the decode abort); the P/D legs carry the client's own "
                          "authorization", default=""),
              SettingSpec(ADMIN_KEY_SETTING, existing_file,
                          "sglang adapter: file holding the decode worker's --admin-api-key, if it has one "
                          "(/abort_request then needs it); empty = the API key", default="")),
    # scheduler.py, _handle_generate_request: a decode-mode engine refuses a request without a room.
    no_fallback="an SGLang decode worker (--disaggregation-mode decode) refuses a request without a bootstrap "
                "room, and decode has its request before the prefill can fail",
    decode_wait=lambda options: float(options.get(PREFILL_DEADLINE_SETTING, DEFAULT_PREFILL_DEADLINE)),
    # The demo's prefill emulator binds any free bootstrap port: the server discovers it.
    demo=Demo(env={"PD_EXTPROC_SGLANG_BOOTSTRAP_PORT": "discover"}),
    summary="SGLang 0.5.23 PD (--disaggregation-mode): decode starts at once with bootstrap_host/port/room; "
            "the prefill request runs alongside and is drained",
)
