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
