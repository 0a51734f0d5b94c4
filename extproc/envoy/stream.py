"""The ext_proc stream loop: reads Envoy's messages on one gRPC stream and answers each.

Only this module reads from and writes to the gRPC stream. A client that goes away makes Envoy reset
the stream; grpc.aio then cancels the handler task, and the prefill call awaited inside it is
cancelled with it, so decode is never dispatched.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc

from extproc.core.background import BackgroundPrefill
from extproc.core.processor import PdProcessor, Pending
from extproc.envoy import messages as msg
from extproc.errors import Code

log = logging.getLogger("extproc.server")
EXT_PROC_SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"


@dataclass(slots=True)
class _Stream:
    """One ext_proc stream's state, owned by its Process call."""

    head: msg.RequestHead | None = None
    pending: Pending | None = None
    background: BackgroundPrefill | None = None  # a concurrent engine's prefill, still running
    decode_answered: bool = False


class ExtProcServicer(pb_grpc.ExternalProcessorServicer):  # type: ignore[misc]
    def __init__(self, processor: PdProcessor) -> None:
        self._processor = processor

    async def Process(
        self, request_iterator: AsyncIterator[pb.ProcessingRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.ProcessingResponse]:
        stream = _Stream()
        try:
            async for request in request_iterator:
                response, done = await self._step(stream, request)
                yield response
                if done:
                    return
        finally:
            # Envoy ended the stream (normally, or with a reset) before decode's response headers: the
            # client is gone, and nobody will use the KV of a concurrent prefill that still runs.
            if stream.background is not None and not stream.decode_answered:
                stream.background.task.cancel()

    async def _step(self, stream: _Stream, request: pb.ProcessingRequest) -> tuple[pb.ProcessingResponse, bool]:
        """The reply to one message, and whether the stream is done."""
        kind = request.WhichOneof("request")
        if kind == "request_headers":
            stream.head = msg.head_from_headers(request.request_headers)
            outcome = await self._processor.on_headers(stream.head)
            if isinstance(outcome, pb.ProcessingResponse):
                return outcome, True
            stream.pending = outcome
            if request.request_headers.end_of_stream:  # a P/D POST without a body
                return self._processor.refuse_now(outcome, Code.INVALID_REQUEST_BODY), True
            return msg.continue_headers(), False
        if kind == "request_body":
            if stream.head is None or stream.pending is None:
                log.error("request body arrived before its headers: check the Envoy processing mode")
                return msg.error_reply(Code.INTERNAL_ERROR, 500), True
            body = await self._processor.on_body(stream.head, stream.pending, request.request_body.body)
            stream.background = body.background
            return body.response, False
        if kind == "response_headers" and stream.background is not None:
            stream.decode_answered = True
            status = msg.response_status(request.response_headers)
            return await self._processor.on_decode_answer(stream.background, status), False
        # Not configured to arrive; answer so Envoy does not treat the stream as broken.
        response = pb.ProcessingResponse()
        if kind is not None:
            getattr(response, kind).SetInParent()
        return response, False
