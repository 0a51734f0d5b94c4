"""The adapter interface: what an engine's P/D protocol must provide. Adapters are pure: no I/O,
no logging, no clocks; randomness only through the ``nonce`` argument.

An adapter answers these questions:
  * ``plan``: from the validated client request, what does the prefill worker get (and, for
    CONCURRENT engines, what does decode get, right away)?
  * ``decide`` (SEQUENTIAL engines): from the prefill worker's reply, what does the decode worker
    get, or what does the client get instead (a direct answer, or a PdError)?
  * ``check_background`` (CONCURRENT engines): the prefill reply arrives after decode started; is
    it a success? A PdError here is logged and counted, it cannot reach the client any more.
If ``server_info_path`` is set, the processor GETs that path on the prefill worker (once per
endpoint, cached with a bound and a TTL) and passes the JSON object to ``plan``.
Adapters raise only PdError; any other exception is a bug.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from enum import Enum
from typing import Any, ClassVar, Protocol

from extproc.openai_request import ClientRequest
from extproc.prefill_target import PrefillTarget


class Flow(Enum):
    SEQUENTIAL = "sequential"  # prefill, validate its handoff, then decode
    CONCURRENT = "concurrent"  # prefill and decode start together and rendezvous inside the engines


@dataclass(frozen=True, slots=True)
class PrefillReply:
    status: int
    content_type: str | None
    body: bytes


@dataclass(frozen=True, slots=True)
class Plan:
    prefill_body: bytes
    decode_body: bytes | None = None  # set by CONCURRENT adapters only


@dataclass(frozen=True, slots=True)
class DecodeWith:
    """Let Envoy send this body to the local decode worker."""

    body: bytes


@dataclass(frozen=True, slots=True)
class AnswerDirectly:
    """The prefill leg already finished the request; answer the client without a decode leg."""

    status: int
    content_type: str
    body: bytes


Decision = DecodeWith | AnswerDirectly


ServerInfo = Mapping[str, Any]


class Adapter(Protocol):
    name: ClassVar[str]
    flow: ClassVar[Flow]
    server_info_path: ClassVar[str | None]

    @property
    def protocol(self) -> str: ...

    def plan(self, request: ClientRequest, target: PrefillTarget, nonce: int, server_info: ServerInfo | None) -> Plan:
        ...

    def decide(self, request: ClientRequest, reply: PrefillReply) -> Decision: ...

    def check_background(self, reply: PrefillReply) -> None: ...
