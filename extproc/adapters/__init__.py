"""Adapter registry: one line per engine protocol. ``none`` is the kill switch (no adapter).

A registry entry is ``name -> (protocol pins, default first; factory(pin, settings); flow)``. Adding an
engine means one module in this package and one line here.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

from extproc.adapters import sglang, trtllm
from extproc.adapters.base import Adapter, Flow
from extproc.adapters.vllm_nixl import VllmNixlAdapter

if TYPE_CHECKING:
    from extproc.config import Settings

Factory = Callable[[str, "Settings"], Adapter]

REGISTRY: Mapping[str, tuple[tuple[str, ...], Factory, Flow]] = {
    VllmNixlAdapter.name: (VllmNixlAdapter.protocols, lambda pin, _: VllmNixlAdapter(pin), VllmNixlAdapter.flow),
    sglang.SglangAdapter.name: (sglang.PROTOCOLS, sglang.build, sglang.SglangAdapter.flow),
    trtllm.TrtllmAdapter.name: (trtllm.PROTOCOLS, trtllm.build, trtllm.TrtllmAdapter.flow),
}


def adapter_flow(adapter: str) -> Flow | None:
    """The flow of a registered adapter (None for the ``none`` kill switch)."""
    return REGISTRY[adapter][2] if adapter in REGISTRY else None


def protocol_problem(adapter: str, protocol: str) -> str | None:
    """Why this adapter/protocol pair cannot start, or None if it can."""
    if adapter == "none":
        return None
    if adapter not in REGISTRY:
        return f"unknown adapter {adapter!r}"
    pins = REGISTRY[adapter][0]
    if protocol and protocol not in pins:
        return f"adapter {adapter} does not implement protocol {protocol!r} (supported: {', '.join(pins)})"
    return None


def build_adapter(adapter: str, protocol: str, settings: Settings | None = None) -> Adapter | None:
    """The adapter for a validated setting pair; None for the ``none`` kill switch. ``settings``
    carries adapter-specific settings (sglang_bootstrap_port); without it the defaults apply."""
    if adapter == "none":
        return None
    if settings is None:
        from extproc.config import Settings

        settings = Settings()
    pins, factory, _ = REGISTRY[adapter]
    return factory(protocol or pins[0], settings)
