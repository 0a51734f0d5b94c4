"""Cases every gateway shape must pass the same way (the shipped Envoy Gateway and Istio shapes, the parts)."""

from __future__ import annotations

import json
from typing import Any

import httpx

from tests.gateway.stack import DECODES, GatewayStack
from tests.helpers import CHAT, assert_error, chat_body

JSON = {"content-type": "application/json"}

# A member of each engine's that would steer the decode engine (extproc/envoy/guard.py refuses each).
STEERING_FIELDS = ["kv_transfer_params", "bootstrap_host", "disaggregated_params", "vllm_xargs.kv_transfer_params"]


def post(gw: GatewayStack, path: str, body: dict[str, Any] | bytes, **headers: str) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    with gw.client() as client:
        return client.post(path, content=content, headers={**JSON, **headers})


def served(gw: GatewayStack) -> dict[str, int]:
    """How many requests each decode worker received."""
    return {name: len(gw.decode(name).requests()) for name in DECODES}


def assert_nothing_reached_an_engine(gw: GatewayStack) -> None:
    assert gw.prefill.requests() == [], "the prefill leg must not run"
    assert served(gw) == dict.fromkeys(DECODES, 0), "no decode worker may be reached"


def steering_body(field: str) -> dict[str, Any]:
    """A chat body whose ``field`` (``a.b`` for a nested one) names a KV source of the client's choosing."""
    steering: Any = {"remote_host": "10.0.0.9", "remote_port": 5600, "do_remote_prefill": True}
    if field == "bootstrap_host":
        steering = "10.0.0.9"
    head, _, tail = field.partition(".")
    return chat_body(max_tokens=2, **{head: {tail: steering} if tail else steering})


def assert_steering_refused_before_the_picker(stack: GatewayStack, field: str) -> None:
    """A decode-only pick whose body steers the engine: 400 reserved_request_field naming the member, no
    engine reached, and neither the picker nor pd-extproc saw the request (the guard runs first)."""
    stack.pick("decode-b", pd=False)
    streams = stack.pd_streams()
    error = assert_error(post(stack, CHAT, steering_body(field)), 400, "reserved_request_field")
    assert error["param"] == field
    assert_nothing_reached_an_engine(stack)
    assert stack.picker.seen() == [] and stack.pd_streams() == streams


_STEERS = b'{"model": "emulated", "prompt": "hi", "kv_transfer_params": {"remote_host": "10.0.0.9"}}'
# Bodies the guard cannot read as the engine would, or reads only as Python does (docs/security.md): each
# with its headers, the refusal's status, code and param.
UNREADABLE_BODIES = {
    "x-body-compressed": ({**JSON, "x-body-compressed": "zstd"}, _STEERS, 415, "uninspectable_request_body",
                          "x-body-compressed"),
    "vllm_xargs-form": ({"content-type": "application/x-www-form-urlencoded"},
                        b"model=emulated&vllm%5Fxargs=%7B%22kv_transfer_params%22%3A%22x%22%7D", 415,
                        "uninspectable_request_body", "vllm_xargs"),
    "nbsp-json": ({"content-type": "application/json\xa0"}, _STEERS, 400, "reserved_request_field",
                  "kv_transfer_params"),
}


def assert_unreadable_body_refused_before_the_picker(stack: GatewayStack, case: str) -> None:
    """A decode-only pick whose body the engine would read otherwise than as plain JSON (SGLang's zstd
    decompression, vLLM's vllm_xargs form field, a media type only Python strips): refused by the guard,
    no engine reached, the picker and pd-extproc never asked."""
    headers, body, status, code, param = UNREADABLE_BODIES[case]
    stack.pick("decode-b", pd=False)
    streams = stack.pd_streams()
    with stack.client() as client:
        response = client.post(CHAT, content=body, headers={k: v.encode("latin-1") for k, v in headers.items()})
    assert assert_error(response, status, code)["param"] == param
    assert_nothing_reached_an_engine(stack)
    assert stack.picker.seen() == [] and stack.pd_streams() == streams


def assert_picker_down_is_gateway_error(stack: GatewayStack) -> None:
    """With the picker stopped: its failure (Envoy's 500) as gateway_error, never our pd_extproc_unavailable;
    our filter never called, no engine reached."""
    stack.picker.stop()
    response = post(stack, CHAT, chat_body(max_tokens=2))
    assert assert_error(response, 500, "gateway_error")["type"] == "server_error"
    assert "pd_extproc" not in response.text
    assert stack.pd_streams() == 0
    assert_nothing_reached_an_engine(stack)
