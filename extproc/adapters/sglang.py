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
refused (it would point decode at a host of the client's choosing); ``bootstrap_host`` is the address
the processor resolved and checked against the prefill policy (never a name the decode engine would
resolve again); neither leg is retried.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, ClassVar, Literal

import orjson

from extproc import jsonspan
from extproc.adapters.base import Decision, Flow, Plan, PrefillReply, ServerInfo
from extproc.adapters.prefill_json import parse_prefill_object
from extproc.errors import Code, PdError
from extproc.openai_request import ClientRequest
from extproc.prefill_target import PrefillTarget

if TYPE_CHECKING:
    from extproc.config import Settings

PROTOCOL_0_5_23 = "sglang-0.5.23-bootstrap"
PROTOCOLS = (PROTOCOL_0_5_23,)
DEFAULT_BOOTSTRAP_PORT = 8998  # SGLang's --disaggregation-bootstrap-port default
SERVER_INFO_PATH = "/server_info"
BOOTSTRAP_FIELDS = ("bootstrap_host", "bootstrap_port", "bootstrap_room")
# bootstrap_room is stored in an int64/uint64 metadata buffer on both engines; 0 there means "no
# metadata landed yet", so a room of 0 would never complete. Rooms are 1 <= room < 2**63.
ROOM_LIMIT = 1 << 63
_FALSE = b"false"


def room_from_nonce(nonce: int) -> int:
    """A bootstrap room in [1, 2**63) from the processor's 63-bit random nonce."""
    return 1 + nonce % (ROOM_LIMIT - 1)


def refuse_client_bootstrap(request: ClientRequest) -> None:
    """The P/D route sets the bootstrap fields; a client's own value (other than null) is refused."""
    for name in BOOTSTRAP_FIELDS:
        if request.body.get(name) is not None:
            raise PdError(Code.INVALID_REQUEST_FIELD, param=name)


def bootstrap_port_from(server_info: Mapping[str, Any]) -> int:
    """The prefill engine's bootstrap port from its /server_info; it must be a prefill-mode engine."""
    if server_info.get("disaggregation_mode") != "prefill":
        raise PdError(Code.INVALID_PREFILL_HANDOFF, param="server_info.disaggregation_mode is invalid")
    if "disaggregation_bootstrap_port" not in server_info:
        raise PdError(Code.INVALID_PREFILL_HANDOFF, param="server_info.disaggregation_bootstrap_port is missing")
    port = server_info["disaggregation_bootstrap_port"]
    if not isinstance(port, int) or isinstance(port, bool) or not 1 <= port <= 65535:
        raise PdError(Code.INVALID_PREFILL_HANDOFF, param="server_info.disaggregation_bootstrap_port is invalid")
    return port


def bootstrap_members(host: str, port: int, room: int) -> list[tuple[str, bytes]]:
    """The three members both legs get: a string and two JSON integers (never floats)."""
    return [("bootstrap_host", orjson.dumps(host)), ("bootstrap_port", str(port).encode()),
            ("bootstrap_room", str(room).encode())]


def _without_client_bootstrap() -> dict[str, bytes | None]:
    return {name: None for name in BOOTSTRAP_FIELDS}  # drops a tolerated null, so each key appears once


def prefill_body(request: ClientRequest, bootstrap: list[tuple[str, bytes]]) -> bytes:
    """The client's body with the bootstrap fields, as one JSON response (its result is only checked)."""
    replace = {**_without_client_bootstrap(), "stream": _FALSE, "stream_options": None}
    append = [] if any(m.name == "stream" for m in request.members) else [("stream", _FALSE)]
    return jsonspan.rebuild(request.raw, request.members, replace, [*append, *bootstrap])


def decode_body(request: ClientRequest, bootstrap: list[tuple[str, bytes]]) -> bytes:
    """The client's body, byte for byte, plus the bootstrap fields."""
    return jsonspan.rebuild(request.raw, request.members, _without_client_bootstrap(), bootstrap)


def check_prefill_reply(reply: PrefillReply) -> None:
    """A drained prefill reply is a success only if it is SGLang's non-aborted completion."""
    parsed, _ = parse_prefill_object(reply)
    choices = parsed.get("choices")
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        raise PdError(Code.INVALID_PREFILL_HANDOFF, param="choices is missing")
    if choices[0].get("finish_reason") == "abort":
        raise PdError(Code.INVALID_PREFILL_HANDOFF, param="choices.finish_reason is abort")


class SglangAdapter:
    """Bootstrap port from the settings (SGLang's default 8998 unless configured)."""

    name: ClassVar[str] = "sglang"
    flow: ClassVar[Flow] = Flow.CONCURRENT
    server_info_path: ClassVar[str | None] = None
    protocols: ClassVar[tuple[str, ...]] = PROTOCOLS

    def __init__(self, protocol: str = PROTOCOL_0_5_23, bootstrap_port: int = DEFAULT_BOOTSTRAP_PORT) -> None:
        if protocol not in PROTOCOLS:
            raise ValueError(protocol)
        self._protocol = protocol
        self._bootstrap_port = bootstrap_port

    @property
    def protocol(self) -> str:
        return self._protocol

    def _port(self, server_info: ServerInfo | None) -> int:
        return self._bootstrap_port

    def plan(self, request: ClientRequest, target: PrefillTarget, nonce: int, server_info: ServerInfo | None) -> Plan:
        refuse_client_bootstrap(request)
        bootstrap = bootstrap_members(target.host, self._port(server_info), room_from_nonce(nonce))
        return Plan(prefill_body=prefill_body(request, bootstrap), decode_body=decode_body(request, bootstrap))

    def decide(self, request: ClientRequest, reply: PrefillReply) -> Decision:
        raise AssertionError("a concurrent adapter decides nothing after the prefill reply")

    def check_background(self, reply: PrefillReply) -> None:
        check_prefill_reply(reply)


class SglangDiscoveringAdapter(SglangAdapter):
    """Bootstrap port read from each prefill worker's /server_info (cached per endpoint by the processor)."""

    server_info_path: ClassVar[str | None] = SERVER_INFO_PATH

    def _port(self, server_info: ServerInfo | None) -> int:
        if server_info is None:
            raise AssertionError("the processor passes /server_info to a discovering adapter")
        return bootstrap_port_from(server_info)


def build(protocol: str, settings: Settings) -> SglangAdapter:
    """The registry factory: discovery when the setting says so, else the configured port."""
    port: int | Literal["discover"] = settings.sglang_bootstrap_port
    if port == "discover":
        return SglangDiscoveringAdapter(protocol)
    return SglangAdapter(protocol, int(port))
