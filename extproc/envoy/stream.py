"""The ext_proc stream loop: reads Envoy's messages on one gRPC stream and answers each.

Only this module reads from and writes to the gRPC stream. A client that goes away makes Envoy reset
the stream; the server (extproc/envoy/h2server.py) then cancels the call's task, and the prefill call
awaited inside it is cancelled with it, so decode is never dispatched.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from dataclasses import dataclass
from enum import Enum
from typing import Any

from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from google.protobuf.message import DecodeError

from extproc.envoy import gateway
from extproc.envoy import messages as msg
from extproc.envoy.h2server import Call, Handler
from extproc.envoy.h2wire import Status
from extproc.pipeline.background import BackgroundPrefill
from extproc.pipeline.processor import PdProcessor, Pending
from extproc.protocol.errors import Code, PdError
from extproc.protocol.request_head import RequestHead

log = logging.getLogger("extproc.server")
EXT_PROC_SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"


class Phase(Enum):
    """Where one ext_proc stream is; each phase accepts one message kind (``EXPECTS``), as h11's
    ``_state.py`` does for a connection. Envoy's configured processing mode (envoy/bootstrap.py:
    headers SEND, body BUFFERED, response headers SEND for a concurrent engine, nothing else) sends
    exactly that order; any other message (a body chunk of a STREAMED mode, a second headers
    message, trailers) is refused with a JSON 500 and a log line, never processed twice."""

    HEADERS = "headers"
    BODY = "body"  # the whole body, in one message (end_of_stream)
    INSPECT = "inspect"  # gateway mode: the body of a tagged request that is not P/D (gateway.steering_refusal)
    DECODE_ANSWER = "decode_answer"  # decode's response headers, if Envoy sends them
    DONE = "done"


EXPECTS = {Phase.HEADERS: "request_headers", Phase.BODY: "request_body", Phase.INSPECT: "request_body",
           Phase.DECODE_ANSWER: "response_headers"}


@dataclass(slots=True)
class _Stream:
    """One ext_proc stream's state, owned by its Process call."""

    phase: Phase = Phase.HEADERS
    head: RequestHead | None = None
    pending: Pending | None = None  # set in BODY: the request's record, not yet finished
    background: BackgroundPrefill | None = None  # a concurrent engine's prefill, still running
    decode_answered: bool = False


class ExtProcServicer:
    def __init__(self, processor: PdProcessor, passthrough: Callable[[], None] | None = None) -> None:
        """``passthrough`` (gateway mode): called for each request that is not P/D, which is then let
        through after its headers message, or after its body when the picker tagged it
        (extproc/envoy/gateway.py)."""
        self._processor = processor
        self._passthrough = passthrough

    def handlers(self) -> dict[str, Handler]:
        """Envoy's ext_proc method on our gRPC server (app.py)."""
        return {f"/{EXT_PROC_SERVICE}/Process": self.serve_call}

    async def serve_call(self, call: Call) -> tuple[int, str]:
        """One ext_proc stream on the server: each message answered as it comes (a body reply arrives
        already encoded, in pieces: messages.EncodedResponse)."""
        stream = _Stream()
        try:
            while (message := await call.recv()) is not None:
                try:
                    request = pb.ProcessingRequest.FromString(message)
                except DecodeError:
                    return Status.INTERNAL, "a message that is not a ProcessingRequest"
                response, done = await self._step(stream, request)
                call.send(*msg.wire_parts(response))
                if done:
                    break
            return Status.OK, ""
        finally:
            _ended(stream)

    async def Process(
        self, request_iterator: AsyncIterator[pb.ProcessingRequest], context: Any
    ) -> AsyncGenerator[msg.Response, None]:
        """The same as ``serve_call`` over protobuf messages, without a server (the benches and tests
        that drive the servicer in-process)."""
        stream = _Stream()
        try:
            async for request in request_iterator:
                response, done = await self._step(stream, request)
                yield response
                if done:
                    return
        finally:
            _ended(stream)

    async def _step(self, stream: _Stream, request: pb.ProcessingRequest) -> tuple[msg.Response, bool]:
        """The reply to one message, and whether the stream is done."""
        kind = request.WhichOneof("request")
        if EXPECTS.get(stream.phase) != kind:
            return self._out_of_order(stream, kind), True
        if stream.phase is Phase.HEADERS:
            return await self._on_headers(stream, request.request_headers)
        if stream.phase is Phase.BODY:
            return await self._on_body(stream, request.request_body)
        if stream.phase is Phase.INSPECT:
            return await self._on_tagged_body(stream, request.request_body)
        stream.phase = Phase.DONE
        if stream.background is None:  # a sequential engine with response headers sent anyway
            return msg.continue_response_headers(), False
        stream.decode_answered = True
        status = msg.response_status(request.response_headers)
        answer = await self._processor.on_decode_answer(stream.background, status)
        return (msg.continue_response_headers() if answer is None else msg.reply(answer)), False

    async def _on_headers(self, stream: _Stream, headers: pb.HttpHeaders) -> tuple[msg.Response, bool]:
        stream.phase = Phase.DONE
        stream.head = msg.head_from_headers(headers)
        if self._passthrough is not None and not gateway.is_pd_request(stream.head, self._processor.pd_paths):
            if gateway.is_tagged(stream.head) and not headers.end_of_stream:
                stream.phase = Phase.INSPECT  # the guard in front skipped it only if P/D: never past us unseen
                return msg.continue_headers(), False
            self._passthrough()
            return gateway.passthrough(), True
        outcome = await self._processor.on_headers(stream.head)
        if not isinstance(outcome, Pending):
            return msg.reply(outcome), True
        if headers.end_of_stream:  # a P/D POST without a body
            return msg.reply(self._processor.refuse_now(outcome, Code.INVALID_REQUEST_BODY)), True
        stream.pending, stream.phase = outcome, Phase.BODY
        return msg.continue_headers(), False

    async def _on_body(self, stream: _Stream, body: pb.HttpBody) -> tuple[msg.Response, bool]:
        assert stream.head is not None and stream.pending is not None
        pending, stream.pending = stream.pending, None
        if not body.end_of_stream:  # a chunk: the mode is not BUFFERED, and we read whole bodies only
            _log_out_of_order(stream.phase, "request_body chunk")
            stream.phase = Phase.DONE
            return msg.reply(self._processor.refuse_now(pending, Code.INTERNAL_ERROR)), True
        outcome = await self._processor.on_body(stream.head, pending, body.body)
        stream.background, stream.phase = outcome.background, Phase.DECODE_ANSWER
        return msg.reply(outcome.decision), False

    async def _on_tagged_body(self, stream: _Stream, body: pb.HttpBody) -> tuple[msg.Response, bool]:
        stream.phase = Phase.DONE
        if not body.end_of_stream:
            _log_out_of_order(Phase.INSPECT, "request_body chunk")
            return msg.error_reply(Code.INTERNAL_ERROR, 500), True
        try:  # a large body is parsed in a worker process, off the event loop
            refusal = await self._processor.inspector.check(gateway.steering_refusal, body.body)
        except PdError as error:  # too many large bodies waiting, or a worker died
            extra = [("retry-after", b"1")] if error.code is Code.PD_OVERLOADED else []
            return msg.error_reply(error.code, error.status, error.param, extra), True
        response = gateway.tagged_reply(refusal)
        if response.WhichOneof("response") == "immediate_response":
            log.info("refused a tagged request that is not P/D: its body carries a steering member")
            return response, True
        assert self._passthrough is not None
        self._passthrough()
        stream.phase = Phase.DECODE_ANSWER  # answered with a plain continue if Envoy sends it
        return response, False

    def _out_of_order(self, stream: _Stream, kind: str | None) -> msg.Response:
        """A message the phase does not expect: the request is refused, counted once (its record is
        finished here only if no phase finished it yet)."""
        _log_out_of_order(stream.phase, kind or "empty message")
        pending, stream.pending, stream.phase = stream.pending, None, Phase.DONE
        if pending is not None:
            return msg.reply(self._processor.refuse_now(pending, Code.INTERNAL_ERROR))
        return msg.error_reply(Code.INTERNAL_ERROR, 500)


def _ended(stream: _Stream) -> None:
    """Envoy ended the stream (normally, or with a reset) before decode's response headers: the client is
    gone, and nobody will use the KV of a concurrent prefill that still runs."""
    if stream.background is not None and not stream.decode_answered:
        stream.background.task.cancel()


def _log_out_of_order(phase: Phase, kind: str) -> None:
    log.error("ext_proc message out of order: check the Envoy processing mode (headers SEND, body BUFFERED)",
              extra={"phase": phase.value, "ext_proc_message": kind})
