"""The emulator author's API: what an engine's emulated worker needs from the lab, and nothing else.

An engine outside this package names its emulator in ``Engine.emulator`` (``module:Class``); that class
imports from here (and its adapter from ``extproc.plugin``), so the lab's layout can change without
breaking it. tests/plugin_engine/toy_engine.py is a whole engine written against these two modules.
"""

from __future__ import annotations

from extproc.observability.httpserver import Request, Response
from pd_extproc_lab.emulator import text
from pd_extproc_lab.emulator.behaviour import Behaviour, BehaviourError
from pd_extproc_lab.emulator.control import Control, Received
from pd_extproc_lab.emulator.http import EmulatorHttpServer, RawResponse, Reply, StreamResponse

__all__ = [
    "Behaviour",
    "BehaviourError",
    "Control",
    "EmulatorHttpServer",
    "RawResponse",
    "Received",
    "Reply",
    "Request",
    "Response",
    "StreamResponse",
    "text",
]
