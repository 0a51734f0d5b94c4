"""Scripted emulator behaviours are typed: a misspelt key or a wrong type is refused when posted,
so a negative test cannot pass by running the happy path."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from extproc.observability.httpserver import Request
from pd_extproc_lab.emulator.behaviour import BehaviourError
from pd_extproc_lab.emulator.control import Control
from pd_extproc_lab.emulator.sglang import SglangBehaviour
from pd_extproc_lab.emulator.trtllm import TrtllmBehaviour
from pd_extproc_lab.emulator.vllm import KEEP, VllmBehaviour


@pytest.mark.parametrize("kind,raw", [
    (VllmBehaviour, {"stauts": 500}),  # misspelt
    (VllmBehaviour, {"status": "500"}),  # wrong type
    (VllmBehaviour, {"delay": True}),  # a bool is not a number of seconds
    (SglangBehaviour, {"first_token_eos": True}),  # another emulator's key
    (TrtllmBehaviour, {"params_set": ["x"]}),
    (VllmBehaviour, ["status", 500]),
])
def test_unknown_keys_and_wrong_types_are_refused(kind: Any, raw: Any) -> None:
    with pytest.raises(BehaviourError):
        kind.parse(raw)


def test_known_keys_parse_and_only_what_was_given_is_noted() -> None:
    behaviour = VllmBehaviour.parse({"status": 503, "delay": 1, "kv_set": {"tp_size": 2}})
    assert (behaviour.status, behaviour.delay, behaviour.kv_set) == (503, 1, {"tp_size": 2})
    assert behaviour.kv_transfer_params is KEEP
    assert behaviour.given() == {"status": 503, "delay": 1, "kv_set": {"tp_size": 2}}
    assert VllmBehaviour.parse({"kv_transfer_params": None}).kv_transfer_params is None


def test_the_control_endpoint_answers_400_and_queues_nothing() -> None:
    control: Control[VllmBehaviour] = Control({}, VllmBehaviour)
    body = json.dumps({"behaviours": [{"status": 500}, {"hnag": True}]}).encode()
    response = asyncio.run(control.handle(Request("POST", "/_emulator/script", [], body, "test")))
    assert response is not None and response.status == 400 and b"hnag" in response.body
    assert len(control.script) == 0, "not even the valid entry before it"


def test_a_held_request_goes_on_only_when_released_and_reset_releases_too() -> None:
    """``hold`` keeps a request in flight until the test says so (no wall-clock window): release answers
    every request held at that moment, and a later hold waits for the next release."""
    async def scenario() -> tuple[list[bool], int, int, bool, int]:
        control: Control[VllmBehaviour] = Control({}, VllmBehaviour)
        first, second = (asyncio.ensure_future(control.held()) for _ in range(2))
        await asyncio.sleep(0)  # both reach their wait (one loop turn; no time passes)
        waiting = [not task.done() for task in (first, second)]
        released = control.release()
        await asyncio.gather(first, second)
        later = asyncio.ensure_future(control.held())
        await asyncio.sleep(0)
        later_waits = not later.done()
        response = await control.handle(Request("POST", "/_emulator/reset", [], b"{}", "test"))
        assert response is not None and response.status == 200
        await later
        return waiting, released, control.release(), later_waits, response.status

    waiting, released, none_left, later_waits, _ = asyncio.run(scenario())
    assert waiting == [True, True] and released == 2
    assert later_waits, "a hold after a release waits for the next one"
    assert none_left == 0
