"""Every ext_proc reply, byte for byte: each expected message is written field by field with protobuf's own
API (not through extproc/envoy/messages.py), as the replies were before the pipeline returned decisions,
so any change to what Envoy receives fails here (serialised deterministically, then compared)."""

from __future__ import annotations

import asyncio
import json

import pytest
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from extproc.adapters.vllm_nixl import VllmNixlAdapter
from extproc.envoy import messages as msg
from extproc.pipeline.decisions import LocalReply, SendToDecode
from extproc.protocol.errors import Code, error_body
from extproc.protocol.headers import PICKER_HEADERS
from extproc.protocol.steering import STEERING_HEADER_NAMES
from tests.unit.test_processor import CHAT_BODY, HANDOFF, ok, rig, start

_OVERWRITE = base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD


def wire(response: msg.Response) -> bytes:
    """What Envoy receives: an encoded reply's own bytes, or protobuf's (deterministic) serialisation."""
    return b"".join(msg.wire_parts(response)) if isinstance(response, msg.EncodedResponse) \
        else response.SerializeToString(deterministic=True)


def set_header(options: pb.HeaderMutation, key: str, value: bytes) -> None:
    options.set_headers.add(append_action=_OVERWRITE, header={"key": key, "raw_value": value})


def test_a_body_for_decode_is_its_length_then_the_set_headers_then_the_removals_and_metadata() -> None:
    expected = pb.ProcessingResponse()
    expected.dynamic_metadata.update({"pd_extproc": {"fallback": "aggregated; reason=x"}})
    mutation = expected.request_body.response.header_mutation
    set_header(mutation, "content-length", b"7")
    set_header(mutation, "x-a", b"1")
    mutation.remove_headers.extend(["x-b", "x-c"])
    expected.request_body.response.body_mutation.body = b'{"a":1}'
    decision = SendToDecode(b'{"a":1}', [("x-a", b"1")], ["x-b", "x-c"], {"fallback": "aggregated; reason=x"})
    assert wire(msg.reply(decision)) == wire(expected)


def test_a_body_for_decode_without_metadata_carries_none() -> None:
    expected = pb.ProcessingResponse()
    set_header(expected.request_body.response.header_mutation, "content-length", b"2")
    expected.request_body.response.body_mutation.body = b"{}"
    assert wire(msg.reply(SendToDecode(b"{}"))) == wire(expected)
    assert wire(msg.reply(SendToDecode(b"{}", metadata={}))) == wire(expected)


@pytest.mark.parametrize("status,envoy", [(429, 429), (503, 503), (499, 400), (529, 502), (200, 200)])
def test_a_local_reply_maps_its_status_and_sets_its_type_then_its_headers(status: int, envoy: int) -> None:
    expected = pb.ProcessingResponse()
    reply = expected.immediate_response
    reply.status.code = envoy  # type: ignore[assignment]
    set_header(reply.headers, "content-type", b"text/event-stream")
    set_header(reply.headers, "retry-after", b"1")
    reply.body = b"data: x\n\n"
    reply.details = "pd_answered_by_prefill"
    decision = LocalReply(status, b"data: x\n\n", "pd_answered_by_prefill", [("retry-after", b"1")],
                          content_type=b"text/event-stream")
    assert wire(msg.reply(decision)) == wire(expected)


def test_an_error_reply_is_json_with_its_code_as_details() -> None:
    expected = pb.ProcessingResponse()
    reply = expected.immediate_response
    reply.status.code = 400  # type: ignore[assignment]
    set_header(reply.headers, "content-type", b"application/json")
    reply.body = error_body(Code.INVALID_REQUEST_BODY, "n")
    reply.details = "pd_invalid_request_body"
    assert wire(msg.error_reply(Code.INVALID_REQUEST_BODY, 400, "n")) == wire(expected)
    assert wire(msg.reply(LocalReply(400, error_body(Code.INVALID_REQUEST_BODY, "n"), "pd_invalid_request_body"))) \
        == wire(expected)


def test_the_continue_replies_are_empty_headers_responses() -> None:
    assert wire(msg.continue_headers()) == wire(pb.ProcessingResponse(request_headers=pb.HeadersResponse()))
    assert wire(msg.continue_response_headers()) == wire(pb.ProcessingResponse(response_headers=pb.HeadersResponse()))


@pytest.mark.parametrize("gateway", [False, True], ids=["sidecar", "gateway"])
def test_a_pd_body_removes_the_steering_headers_then_in_gateway_mode_the_pickers(gateway: bool) -> None:
    """The order the stream loop gave it when it appended the picker's headers to the processor's reply."""
    async def run() -> msg.Response:
        r = rig(VllmNixlAdapter(), strip_before_decode=PICKER_HEADERS if gateway else frozenset())
        r.transport.answers.append(ok({"id": "x", "kv_transfer_params": HANDOFF}))
        request_head, pending = await start(r, CHAT_BODY)
        outcome = await r.processor.on_body(request_head, pending, json.dumps(CHAT_BODY).encode())
        return msg.reply(outcome.decision)

    reply = asyncio.run(run())
    assert isinstance(reply, msg.EncodedResponse)
    removed = list(reply.message().request_body.response.header_mutation.remove_headers)
    assert removed == sorted(STEERING_HEADER_NAMES) + (sorted(PICKER_HEADERS) if gateway else [])


@pytest.mark.parametrize("size", [0, 1, 127, 128, 16383, 16384, 300_000, (1 << 20) + 7, (1 << 21) - 600,
                                  (1 << 21) - 1, 1 << 21, 3 << 21])
@pytest.mark.parametrize("metadata", [None, {"fallback": "aggregated; reason=prefill_upstream_timeout"}])
def test_an_encoded_body_reply_is_the_message_protobuf_writes_at_every_length(
        size: int, metadata: dict[str, str] | None) -> None:
    """Each length prefix on the way to the body crosses a varint boundary somewhere in these sizes; the
    set headers have values of every kind (empty, non-ASCII bytes, long) and long removal lists."""
    body = bytes(range(256)) * (size // 256) + b"x" * (size % 256)
    set_headers = [("x-a", b"1"), ("x-empty", b""), ("x-long", b"v" * 300), ("x-bytes", "\u00fc".encode())]
    removals = [f"x-r{i}" for i in range(40)]
    expected = pb.ProcessingResponse()
    if metadata:
        expected.dynamic_metadata.update({"pd_extproc": metadata})
    mutation = expected.request_body.response.header_mutation
    set_header(mutation, "content-length", str(len(body)).encode())
    for key, value in set_headers:
        set_header(mutation, key, value)
    mutation.remove_headers.extend(removals)
    expected.request_body.response.body_mutation.body = body
    encoded = msg.reply(SendToDecode(body, set_headers, removals, metadata))
    assert isinstance(encoded, msg.EncodedResponse)
    assert encoded.wire == expected.SerializeToString(deterministic=True)
    assert encoded.message() == expected
