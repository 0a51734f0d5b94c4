"""An ext_proc client's side of a stream, as Envoy speaks it: the messages for a request's head and
body, one exchange over a gRPC channel, and the JSON error an immediate response carries. The servicer
tests drive an in-process server with it; the workers test reaches one worker's socket on purpose."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import grpc
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc


def headers_message(path: str, extra: dict[str, str], end_of_stream: bool = False) -> pb.ProcessingRequest:
    request = pb.ProcessingRequest()
    request.request_headers.end_of_stream = end_of_stream
    for key, value in {":method": "POST", ":path": path, "content-type": "application/json", **extra}.items():
        request.request_headers.headers.headers.append(base_pb2.HeaderValue(key=key, raw_value=value.encode()))
    return request


def body_message(body: dict[str, Any] | bytes) -> pb.ProcessingRequest:
    request = pb.ProcessingRequest()
    request.request_body.body = body if isinstance(body, bytes) else json.dumps(body).encode()
    request.request_body.end_of_stream = True
    return request


async def exchange(channel: grpc.aio.Channel, *messages: pb.ProcessingRequest) -> list[pb.ProcessingResponse]:
    """Send ``messages`` on one Process stream; every response, once the server ends the stream."""
    async def requests() -> AsyncIterator[pb.ProcessingRequest]:
        for message in messages:
            yield message

    stub: Any = pb_grpc.ExternalProcessorStub(channel)
    return [response async for response in stub.Process(requests())]


def error_of(response: pb.ProcessingResponse) -> tuple[int, str]:
    """The status and error code of an immediate response (our JSON error shape)."""
    assert response.WhichOneof("response") == "immediate_response"
    reply = response.immediate_response
    assert reply.headers.set_headers[0].header.raw_value == b"application/json"
    return reply.status.code, json.loads(reply.body)["error"]["code"]
