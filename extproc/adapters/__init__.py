"""The engine registry: the built-in engines, plus any installed package's ``pd_extproc.engines`` entry
points (each names an ``Engine``). ``none`` is the kill switch (no adapter). The registry is read on
first use, not at import, so a broken plugin is an ``EngineLoadError`` the CLI reports in one line.
What is installed does not change while the process runs, so it is read once per process and kept
read-only (a mapping nobody can change, of frozen ``Engine`` values): a constant, not shared state.

Adding a built-in engine is its module (an ``ENGINE``, its adapter) named in ``BUILTIN_MODULES``, its
steering fields and headers (protocol/steering.py), its emulator module and its tests: the settings, the
CLI and the stack read everything else from the ``Engine``.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from functools import cache
from importlib.metadata import entry_points
from types import MappingProxyType

from extproc.adapters.base import Adapter, Disabled, Engine, Flow, Options
from extproc.protocol.openai_request import OPENAI_ENDPOINTS, Endpoint

BUILTIN_MODULES = ("extproc.adapters.vllm_nixl", "extproc.adapters.sglang", "extproc.adapters.trtllm")
ENTRY_POINT_GROUP = "pd_extproc.engines"
KILL_SWITCH = "none"


class EngineLoadError(RuntimeError):
    """An installed engine plugin is broken; the message names it."""


def _discover() -> dict[str, Engine]:
    found: dict[str, Engine] = {}
    candidates: list[tuple[str, object]] = [(m, importlib.import_module(m).ENGINE) for m in BUILTIN_MODULES]
    for point in entry_points(group=ENTRY_POINT_GROUP):
        try:
            candidates.append((f"entry point {point.value}", point.load()))
        except Exception as exc:  # a plugin's import error must say which plugin
            raise EngineLoadError(f"engine plugin {point.value} cannot be loaded: {exc!r}") from exc
    for origin, engine in candidates:
        if not isinstance(engine, Engine):
            raise EngineLoadError(f"{origin} is not an extproc.adapters.base.Engine")
        if engine.name in found or engine.name == KILL_SWITCH:
            raise EngineLoadError(f"{origin} registers the engine name {engine.name!r} a second time")
        found[engine.name] = engine
    return found


@cache
def engines() -> Mapping[str, Engine]:
    """Every registered engine by adapter name (built-ins first), read-only; raises EngineLoadError for a
    broken plugin."""
    return MappingProxyType(_discover())


@cache
def by_engine() -> Mapping[str, Engine]:
    """The same engines by inference engine name (vllm, sglang, trtllm), for `pd-extproc emulate --engine`."""
    return MappingProxyType({engine.engine: engine for engine in reversed(list(engines().values()))})


def adapter_flow(adapter: str) -> Flow | None:
    """The flow of a registered adapter (None for the ``none`` kill switch)."""
    engine = engines().get(adapter)
    return engine.flow if engine is not None else None


def served(adapter: str) -> frozenset[Endpoint]:
    """The endpoints the adapter serves P/D: one source for the sidecar's route (envoy/bootstrap.py), the
    gateway parts' matcher and the manifests (chat and completions for the kill switch, whose route refuses
    them all)."""
    if adapter == KILL_SWITCH or adapter not in engines():
        return OPENAI_ENDPOINTS
    return engines()[adapter].endpoints


def protocol_problem(adapter: str, protocol: str) -> str | None:
    """Why this adapter/protocol pair cannot start, or None if it can."""
    if adapter == KILL_SWITCH:
        return None
    if adapter not in engines():
        return f"unknown adapter {adapter!r}"
    pins = engines()[adapter].pins
    if protocol and protocol not in pins:
        return f"adapter {adapter} does not implement protocol {protocol!r} (supported: {', '.join(pins)})"
    return None


def build_adapter(adapter: str, protocol: str, options: Options) -> Adapter | Disabled:
    """The adapter for a validated setting pair; ``Disabled`` for the ``none`` kill switch. ``options``
    holds the engines' own settings by name (defaults where unset)."""
    if adapter == KILL_SWITCH:
        return Disabled()
    engine = engines()[adapter]
    return engine.build(protocol or engine.pins[0], options)
