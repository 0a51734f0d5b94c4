"""Imported at start-up by every Python process of the real vLLM workers (the stage puts this directory
on their PYTHONPATH; nothing else loads it). It sets one NIXL knob that vLLM 0.32 does not expose.

NIXL's agent runs a UCX progress thread whose poll delay (``nixlAgentConfig.pthrDelay``, in
microseconds) the Python API (nixl 1.5.1, ``nixl_agent.__init__``) hard-codes to 0: the thread
busy-polls a whole core for as long as the worker lives. Measured on the 2-core test machine: two idle
workers used 2.0 cores; with a 1000 us delay, 0.04. At 2.0 cores everything else starved (in CI the
test process went unscheduled for up to 120 s and a concurrent-request check timed out).
``PD_REALVLLM_NIXL_PROGRESS_DELAY_US`` (set by the stage) makes the thread sleep that long between
polls instead; the thread itself stays on.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import os
import sys
from importlib.machinery import ModuleSpec
from types import ModuleType
from typing import Any

PROGRESS_DELAY_ENV = "PD_REALVLLM_NIXL_PROGRESS_DELAY_US"
NIXL_API_MODULES = {"nixl_cu12._api", "nixl_cu13._api"}
APPLIED_MARKER = "pd-realvllm: NIXL progress-thread poll delay"  # the stage looks for it in the logs


def _with_progress_delay(module: ModuleType, delay_us: int) -> None:
    bindings = module.nixlBind
    create_agent = bindings.nixlAgent

    def agent(name: str, config: Any) -> Any:
        config.pthrDelay = delay_us
        print(f"{APPLIED_MARKER} {delay_us} us for agent {name}", file=sys.stderr, flush=True)
        return create_agent(name, config)

    bindings.nixlAgent = agent


class _NixlProgressDelay(importlib.abc.MetaPathFinder):
    def __init__(self, delay_us: int) -> None:
        self.delay_us = delay_us

    def find_spec(self, name: str, path: Any, target: Any = None) -> ModuleSpec | None:
        if name not in NIXL_API_MODULES:
            return None
        sys.meta_path.remove(self)  # let the normal finders locate the real module
        try:
            spec = importlib.util.find_spec(name)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None:
            return spec
        loader: Any = spec.loader
        execute = loader.exec_module

        def exec_module(module: ModuleType) -> None:
            execute(module)
            _with_progress_delay(module, self.delay_us)

        loader.exec_module = exec_module
        return spec


if os.environ.get(PROGRESS_DELAY_ENV):
    sys.meta_path.insert(0, _NixlProgressDelay(int(os.environ[PROGRESS_DELAY_ENV])))
