"""Adapter registry: one line per engine protocol. ``none`` is the kill switch (no adapter)."""

from __future__ import annotations

from collections.abc import Callable, Mapping

from extproc.adapters.base import Adapter, Flow
from extproc.adapters.vllm_nixl import VllmNixlAdapter

# name -> (supported protocol pins, the default pin first; factory taking the pin; flow)
REGISTRY: Mapping[str, tuple[tuple[str, ...], Callable[[str], Adapter], Flow]] = {
    VllmNixlAdapter.name: (VllmNixlAdapter.protocols, VllmNixlAdapter, VllmNixlAdapter.flow),
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


def build_adapter(adapter: str, protocol: str) -> Adapter | None:
    """The adapter for a validated setting pair; None for the ``none`` kill switch."""
    if adapter == "none":
        return None
    pins, factory, _ = REGISTRY[adapter]
    return factory(protocol or pins[0])
