"""A reply object may be shared between requests (the continue replies are built once): nothing on the
way to Envoy may change one after it was built, or the change leaks into every later request that gets
the same object. Driven through the stream loop in gateway mode, the mode that adds to replies."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from extproc.adapters.vllm_nixl import VllmNixlAdapter
from extproc.envoy import messages as msg
from extproc.envoy.stream import ExtProcServicer
from extproc.pipeline.decisions import SendToDecode
from extproc.pipeline.processor import BodyOutcome, Pending
from extproc.protocol.headers import PICKER_HEADERS
from extproc.protocol.request_head import RequestHead
from tests.ext_proc_messages import body_message, headers_message
from tests.unit.test_processor import CHAT_BODY, HANDOFF, PREFILL, ok, rig


async def one_stream(servicer: ExtProcServicer, *messages: pb.ProcessingRequest) -> list[msg.Response]:
    async def requests() -> AsyncIterator[pb.ProcessingRequest]:
        for message in messages:
            yield message

    return [response async for response in servicer.Process(requests(), None)]


def pd_stream() -> tuple[pb.ProcessingRequest, pb.ProcessingRequest]:
    return headers_message("/v1/chat/completions", {"x-prefiller-host-port": PREFILL}), body_message(CHAT_BODY)


def test_a_shared_body_decision_leaves_the_stream_as_it_was_made() -> None:
    """A processor that hands out one decision for every body must see it unchanged by the gateway's
    stream loop, and each request's reply built from it alone: the picker's headers are the processor's
    to remove, when it makes the decision."""
    shared = SendToDecode(b"{}", remove_headers=("x-a",))
    pristine = SendToDecode(b"{}", remove_headers=("x-a",))

    async def run() -> None:
        r = rig(VllmNixlAdapter())
        servicer = ExtProcServicer(r.processor, passthrough=lambda: None)

        async def shared_body(head: RequestHead, pending: Pending, body: bytes) -> BodyOutcome:
            return BodyOutcome(shared)

        r.processor.on_body = shared_body  # type: ignore[method-assign]
        for _ in range(2):
            replies = await one_stream(servicer, *pd_stream())
            assert replies[1] == msg.reply(pristine)
            assert shared == pristine, "a decision shared with later requests was changed on its way out"

    asyncio.run(run())


def test_no_gateway_path_changes_the_shared_continue_replies() -> None:
    """Every gateway path once (P/D, tagged but not P/D, untagged), then the shared replies are compared
    with ones built fresh."""
    async def run() -> None:
        r = rig(VllmNixlAdapter(), strip_before_decode=PICKER_HEADERS)
        servicer = ExtProcServicer(r.processor, passthrough=lambda: None)
        r.transport.answers.append(ok({"id": "x", "kv_transfer_params": HANDOFF}))
        pd = await one_stream(servicer, *pd_stream())
        assert isinstance(pd[1], msg.EncodedResponse)
        assert set(pd[1].message().request_body.response.header_mutation.remove_headers) >= PICKER_HEADERS
        body: dict[str, Any] = {"model": "m", "input": "hi"}
        await one_stream(servicer, headers_message("/v1/embeddings", {"x-prefiller-host-port": PREFILL}),
                         body_message(body))
        await one_stream(servicer, headers_message("/v1/embeddings", {}), body_message(json.dumps(body).encode()))
        assert msg.continue_headers() == pb.ProcessingResponse(request_headers=pb.HeadersResponse())
        assert msg.continue_response_headers() == pb.ProcessingResponse(response_headers=pb.HeadersResponse())

    asyncio.run(run())
