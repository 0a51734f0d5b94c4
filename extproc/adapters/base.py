"""What an engine is to pd-extproc: an ``Engine`` (its name, protocol pins, flow, settings and emulator)
and an adapter for the flow it follows. Adapters are pure: no I/O, no logging, no clocks; randomness
only through ``PlanInput.nonce``. They raise only PdError; any other exception is a bug.

Two flows, each with only the methods it has:
  * ``SequentialAdapter`` (vLLM, TensorRT-LLM): the prefill request, then from its reply either the
    decode body or a direct answer (``decide``).
  * ``ConcurrentAdapter`` (SGLang): both bodies at once (``plan``); the prefill reply arrives after decode
    started and is only checked (``check_prefill``); a failed prefill aborts the decode request
    (``ConcurrentPlan.abort``), since the engines would otherwise wait for each other.
If ``server_info_path`` is set, the processor GETs that path on the prefill worker (cached per endpoint)
and passes the JSON object in ``PlanInput.server_info``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, ClassVar

from extproc.protocol.fields import ReservedField
from extproc.protocol.openai_request import OPENAI_ENDPOINTS, ClientRequest, Endpoint
from extproc.protocol.settings_spec import SettingSpec
from extproc.protocol.transport import WorkerAddress, WorkerReply


class Flow(Enum):
    SEQUENTIAL = "sequential"  # prefill, validate its handoff, then decode
    CONCURRENT = "concurrent"  # prefill and decode start together and rendezvous inside the engines


ServerInfo = Mapping[str, Any]
Headers = tuple[tuple[str, bytes], ...]


@dataclass(frozen=True, slots=True)
class PlanInput:
    """What the processor knows when an adapter plans the legs."""

    target: WorkerAddress  # the address we resolved and checked (host is the IP's text)
    nonce: int  # 63 random bits, for the ids an engine needs (rooms, request ids)
    server_info: ServerInfo | None = None


@dataclass(frozen=True, slots=True)
class DecodeWith:
    """Let Envoy send this body, with these extra headers, to the local decode worker."""

    body: bytes
    headers: Headers = ()


@dataclass(frozen=True, slots=True)
class AnswerDirectly:
    """The prefill leg already finished the request; answer the client without a decode leg."""

    status: int
    content_type: str
    body: bytes


Decision = DecodeWith | AnswerDirectly


@dataclass(frozen=True, slots=True)
class DecodeAbort:
    """A request to the local decode worker that ends a waiting decode request at once."""

    path: str
    body: bytes
    headers: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True, slots=True)
class ConcurrentPlan:
    prefill_body: bytes
    decode: DecodeWith
    abort: DecodeAbort | None = None  # sent to decode when the prefill leg fails


class _Adapter:
    """What both flows have: a name, a protocol pin, the client fields and headers the route owns."""

    name: ClassVar[str]
    flow: ClassVar[Flow]
    reserved_fields: ClassVar[tuple[ReservedField, ...]] = ()
    # The endpoints served P/D; a request on another path is unsupported_endpoint (the routes send only these).
    endpoints: ClassVar[frozenset[Endpoint]] = OPENAI_ENDPOINTS
    # Headers the P/D route owns: a client's copy never reaches either leg.
    reserved_headers: frozenset[str] = frozenset()
    server_info_path: str | None = None

    def __init__(self, protocol: str) -> None:
        self._protocol = protocol

    @property
    def protocol(self) -> str:
        return self._protocol

    # The keys of the server-info document the adapter reads (the cache keeps nothing else: SGLang's
    # /server_info, for one, carries its API keys).
    server_info_keys: tuple[str, ...] = ()

    def aggregated(self, request: ClientRequest) -> DecodeWith:
        """The request served whole by the local decode worker (PD_EXTPROC_PREFILL_FALLBACK=aggregated):
        the client's own body, which holds no P/D field of ours (reserved fields are refused)."""
        return DecodeWith(request.raw)

    @property
    def discovery_headers(self) -> tuple[tuple[str, str], ...]:
        """Headers of our own server-info request (never a client's): e.g. the workers' API key."""
        return ()


class SequentialAdapter(_Adapter, ABC):
    flow: ClassVar[Flow] = Flow.SEQUENTIAL

    @abstractmethod
    def prefill_body(self, request: ClientRequest, plan: PlanInput) -> bytes:
        """The derived prefill-only request."""

    @abstractmethod
    def decide(self, request: ClientRequest, reply: WorkerReply) -> Decision:
        """From the prefill reply: the decode body, or the client's answer."""


class ConcurrentAdapter(_Adapter, ABC):
    flow: ClassVar[Flow] = Flow.CONCURRENT
    # The whole background prefill request, silence included: a concurrent engine answers the prefill
    # only after decode has pulled the KV, so this follows the engine's own timeouts.
    prefill_deadline: float

    @abstractmethod
    def plan(self, request: ClientRequest, plan: PlanInput) -> ConcurrentPlan:
        """Both legs' bodies, sent together."""

    @abstractmethod
    def check_prefill(self, reply: WorkerReply) -> None:
        """Raise PdError unless the prefill reply, arriving after decode started, is a success."""


Adapter = SequentialAdapter | ConcurrentAdapter


@dataclass(frozen=True, slots=True)
class Disabled:
    """The kill switch (PD_EXTPROC_ADAPTER=none) as an adapter that serves nothing: every P/D request is
    refused with 501 pd_adapter_unavailable before any leg; the passthrough route is untouched."""

    name: str = "none"
    endpoints: frozenset[Endpoint] = OPENAI_ENDPOINTS
    reserved_fields: tuple[ReservedField, ...] = ()
    reserved_headers: frozenset[str] = frozenset()
    discovery_headers: tuple[tuple[str, str], ...] = ()
    server_info_keys: tuple[str, ...] = ()


Options = Mapping[str, Any]


def no_option_problems(pin: str, options: Options) -> list[str]:
    return []


def no_decode_wait(options: Options) -> float:
    return 0.0


@dataclass(frozen=True, slots=True)
class Demo:
    """What ``pd-extproc up --demo`` needs for an engine beyond its two emulated workers: settings
    (PD_EXTPROC_* variables) for the server, and optionally one shared key, which ``up`` generates into
    a file and passes to the server (the ``key_setting`` variable) and to both workers (``key_flag``)."""

    env: Mapping[str, str] = field(default_factory=dict)
    key_setting: str = ""
    key_flag: str = ""


@dataclass(frozen=True, slots=True)
class QueueGauges:
    """Where an engine reports its waiting requests: a Prometheus text page and the gauges to sum."""

    path: str
    names: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class Engine:
    """One engine's declaration; its module is all a new engine needs (plus its steering fields and headers
    in protocol/steering.py, its emulator and its tests).

    ``settings`` are its own PD_EXTPROC_* settings; ``build`` gets the pin and those settings' values
    by name; ``option_problems`` adds the cross-field rules (e.g. a pin that needs a key).
    ``emulator`` is ``module:Class`` of its emulated worker (loaded only by ``pd-extproc emulate``)."""

    name: str  # the adapter's name (PD_EXTPROC_ADAPTER)
    engine: str  # the inference engine's name (`pd-extproc emulate --engine`)
    pins: tuple[str, ...]  # the default first
    flow: Flow
    build: Callable[[str, Options], Adapter]
    emulator: str
    settings: tuple[SettingSpec, ...] = ()
    option_problems: Callable[[str, Options], list[str]] = no_option_problems
    demo: Demo = Demo()
    # How long a decode request may legitimately wait in silence for its KV (a concurrent engine's decode
    # starts before the prefill): Envoy's idle timeouts for decode are rendered above it.
    decode_wait: Callable[[Options], float] = no_decode_wait
    # The decode worker's waiting-request gauges, for PD_EXTPROC_DECODE_QUEUE_LIMIT (None: not offered).
    decode_queue: QueueGauges | None = None
    # The endpoints its adapter serves P/D (the adapter class's ``endpoints``): the routes take these paths.
    endpoints: frozenset[Endpoint] = OPENAI_ENDPOINTS
    # Why the engine's decode worker cannot serve a request whole, if it cannot (PD_EXTPROC_PREFILL_FALLBACK).
    no_fallback: str = ""
    summary: str = ""  # one line for the README's engine table and --help
