"""The vllm_nixl adapter as pure functions: derived prefill body, handoff validation, decode body."""

from __future__ import annotations

import json
from typing import Any

import pytest

from extproc.adapters.base import PlanInput
from extproc.adapters.vllm_nixl import (
    PROTOCOL_0_32,
    PROTOCOL_0_33,
    VllmNixlAdapter,
    decode_body,
    prefill_body,
    validate_handoff,
)
from extproc.protocol.errors import Code, PdError
from extproc.protocol.openai_request import parse_client_request
from extproc.protocol.prefill_target import parse_prefill_target
from extproc.protocol.transport import WorkerReply

HANDOFF = {"do_remote_prefill": True, "do_remote_decode": False, "remote_block_ids": [[1, 2], []],
           "remote_engine_id": "e-1", "remote_request_id": "cmpl-1-0-ab", "remote_host": "10.0.0.1",
           "remote_port": 5600, "tp_size": 1, "dcp_size": 1, "pp_size": 1, "remote_num_tokens": 3,
           "remote_blocks_expiry_time": None, "transfer_mode": "pull", "remote_prefill_cached_tokens": 0}


def request(path: str, body: dict[str, Any] | bytes) -> Any:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    return parse_client_request(path, "application/json", raw, 1 << 20)


def test_prefill_body_for_chat_is_one_non_streaming_token_with_the_producer_params() -> None:
    client = request("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "stream": True,
                                              "stream_options": {"include_usage": True}, "min_tokens": 2,
                                              "max_tokens": 50, "tools": [{"type": "function"}]})
    body = json.loads(prefill_body(client))
    assert body == {"messages": [{"role": "user", "content": "x"}], "stream": False, "max_tokens": 1,
                    "tools": [{"type": "function"}], "max_completion_tokens": 1,
                    "kv_transfer_params": {"do_remote_decode": True, "do_remote_prefill": False,
                                           "remote_engine_id": None, "remote_block_ids": None,
                                           "remote_host": None, "remote_port": None}}


def test_prefill_body_for_completions_does_not_invent_max_completion_tokens() -> None:
    body = json.loads(prefill_body(request("/v1/completions", {"prompt": "p"})))
    assert "max_completion_tokens" not in body and body["max_tokens"] == 1 and body["stream"] is False


def test_decode_body_is_the_client_bytes_plus_the_handoff_bytes() -> None:
    raw = b'{"prompt": "p",  "seed": 123456789012345678901234567890, "kv_transfer_params": null}'
    handoff = b'{"remote_port":5600,"x":1.0}'
    out = decode_body(request("/v1/completions", raw), handoff)
    assert out == b'{"prompt": "p","seed": 123456789012345678901234567890,"kv_transfer_params":' + handoff + b"}"


def test_valid_handoff_passes_both_pins() -> None:
    validate_handoff(HANDOFF, PROTOCOL_0_32)
    validate_handoff({**HANDOFF, "remote_registration_generation": 0}, PROTOCOL_0_33)


def test_registration_generation_is_checked_only_under_the_0_33_pin() -> None:
    validate_handoff({**HANDOFF, "remote_registration_generation": "x"}, PROTOCOL_0_32)
    with pytest.raises(PdError) as caught:
        validate_handoff({**HANDOFF, "remote_registration_generation": "x"}, PROTOCOL_0_33)
    assert caught.value.param == "kv_transfer_params.remote_registration_generation is invalid"


@pytest.mark.parametrize("params,param", [
    (None, "kv_transfer_params is missing"),
    ([HANDOFF], "kv_transfer_params is not an object"),
    ({**HANDOFF, "remote_block_ids": []}, "kv_transfer_params.remote_block_ids is invalid"),
    ({**HANDOFF, "remote_block_ids": [[True]]}, "kv_transfer_params.remote_block_ids is invalid"),
    ({**HANDOFF, "remote_block_ids": [[*range(4000), -1]]}, "kv_transfer_params.remote_block_ids is invalid"),
    ({**HANDOFF, "remote_block_ids": [[1], [*range(4000), 2.0]]}, "kv_transfer_params.remote_block_ids is invalid"),
    ({**HANDOFF, "remote_block_ids": [[1], 2]}, "kv_transfer_params.remote_block_ids is invalid"),
    ({**HANDOFF, "remote_port": 5600.0}, "kv_transfer_params.remote_port is invalid"),
    ({**HANDOFF, "tp_size": False}, "kv_transfer_params.tp_size is invalid"),
    ({**HANDOFF, "remote_num_tokens": -1}, "kv_transfer_params.remote_num_tokens is invalid"),
    ({**HANDOFF, "remote_blocks_expiry_time": "soon"}, "kv_transfer_params.remote_blocks_expiry_time is invalid"),
    ({k: v for k, v in HANDOFF.items() if k != "remote_request_id"}, "kv_transfer_params.remote_request_id is missing"),
], ids=lambda v: v if isinstance(v, str) else "")
def test_invalid_handoffs_name_the_field(params: Any, param: str) -> None:
    with pytest.raises(PdError) as caught:
        validate_handoff(params, PROTOCOL_0_32)
    assert (caught.value.code, caught.value.param) == (Code.INVALID_PREFILL_HANDOFF, param)


def test_adapter_forwards_the_reply_handoff_verbatim() -> None:
    adapter = VllmNixlAdapter()
    client = request("/v1/completions", {"prompt": "p", "max_tokens": 4})
    prefill_body = adapter.prefill_body(client, PlanInput(parse_prefill_target(["10.0.0.1:8000"]), 0))
    assert json.loads(prefill_body)["max_tokens"] == 1
    handoff = json.dumps(HANDOFF, indent=1).encode()
    reply = WorkerReply(200, "application/json", b'{"id": "x", "kv_transfer_params": ' + handoff + b"}")
    assert adapter.decide(client, reply).body.endswith(b'"kv_transfer_params":' + handoff + b"}")


def test_unknown_protocol_pin_is_refused() -> None:
    with pytest.raises(ValueError):
        VllmNixlAdapter("vllm-0.10-nixl-pull")
