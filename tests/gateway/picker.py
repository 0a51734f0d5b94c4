"""A fake endpoint picker: an ext_proc server speaking the endpoint-picker protocol, its choices set by
the test.

What it does follows the Gateway API Inference Extension's EPP (kubernetes-sigs/gateway-api-inference-
extension, docs/proposals/004-endpoint-picker-protocol/README.md; pkg/epp/handlers/request.go
``generateRequestHeaderResponse``; pkg/common/envoy ``BuildChunkedBodyResponses``) with llm-d-router
v0.10.0's P/D header (pkg/common/routing/common.go ``PrefillEndpointHeader``):
- request body mode FULL_DUPLEX_STREAMED: the headers are answered only once the whole body is in; the
  headers reply sets ``x-gateway-destination-endpoint`` (the decode endpoint), ``x-prefiller-host-port``
  (when P/D is picked), ``content-length``, ``clear_route_cache: true``, and dynamic metadata
  ``envoy.lb / x-gateway-destination-endpoint``; then the body goes back as ``streamed_response`` chunks
  of at most 62000 bytes, the last one with end_of_stream;
- response headers, body chunks and trailers are answered unchanged (Envoy AI Gateway's filter sends
  them all: internal/extensionserver/inferencepool.go ``buildHTTPFilterForInferencePool``).
"""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import grpc
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from google.protobuf import struct_pb2

from extproc import ready
from pd_extproc_lab.process import Child

DESTINATION = "x-gateway-destination-endpoint"
PREFILL = "x-prefiller-host-port"
LB_NAMESPACE = "envoy.lb"
CHUNK = 62000  # GIE pkg/common/envoy BodyByteLimit


@dataclass
class Pick:
    decode: str  # host:port
    prefill: str | None = None  # None: decode-only


def _header(key: str, value: str) -> base_pb2.HeaderValueOption:
    return base_pb2.HeaderValueOption(header=base_pb2.HeaderValue(key=key, raw_value=value.encode()),
                                      append_action=base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD)


def _headers_reply(pick: Pick, body_size: int) -> pb.ProcessingResponse:
    response = pb.ProcessingResponse()
    common = response.request_headers.response
    common.clear_route_cache = True
    mutation = common.header_mutation
    mutation.set_headers.append(_header(DESTINATION, pick.decode))
    if pick.prefill is not None:
        mutation.set_headers.append(_header(PREFILL, pick.prefill))
    if body_size:
        mutation.set_headers.append(_header("content-length", str(body_size)))
    metadata = struct_pb2.Struct()
    metadata.update({LB_NAMESPACE: {DESTINATION: pick.decode}})
    response.dynamic_metadata.CopyFrom(metadata)
    return response


def _body_replies(body: bytes, response_side: bool = False, end_of_stream: bool = True) -> list[pb.ProcessingResponse]:
    pieces = [body[i:i + CHUNK] for i in range(0, len(body), CHUNK)] or [b""]
    replies = []
    for index, piece in enumerate(pieces):
        reply = pb.ProcessingResponse()
        body_reply = reply.response_body if response_side else reply.request_body
        streamed = body_reply.response.body_mutation.streamed_response
        streamed.body = piece
        streamed.end_of_stream = end_of_stream and index == len(pieces) - 1
        replies.append(reply)
    return replies


class FakePicker(pb_grpc.ExternalProcessorServicer):  # type: ignore[misc]
    """Reads the test's current pick from ``pick_file`` at each request, appends what it saw to
    ``seen_file`` (one JSON line per stream: the request headers as Envoy sent them)."""

    def __init__(self, pick_file: Path, seen_file: Path) -> None:
        self._pick_file = pick_file
        self._seen_file = seen_file

    def _pick(self) -> Pick:
        data = json.loads(self._pick_file.read_text())
        return Pick(decode=data["decode"], prefill=data["prefill"])

    async def Process(self, request_iterator: AsyncIterator[pb.ProcessingRequest],
                      context: grpc.aio.ServicerContext) -> AsyncIterator[pb.ProcessingResponse]:
        pick = self._pick()
        body = bytearray()
        async for request in request_iterator:
            kind = request.WhichOneof("request")
            if kind == "request_headers":
                headers = {h.key: (h.raw_value.decode("latin-1") if h.raw_value else h.value)
                           for h in request.request_headers.headers.headers}
                with self._seen_file.open("a") as seen:
                    seen.write(json.dumps(headers) + "\n")
                if request.request_headers.end_of_stream:
                    yield _headers_reply(pick, 0)
            elif kind == "request_body":
                body += request.request_body.body
                if request.request_body.end_of_stream:
                    yield _headers_reply(pick, len(body))
                    for reply in _body_replies(bytes(body)):
                        yield reply
            elif kind == "request_trailers":
                yield pb.ProcessingResponse(request_trailers=pb.TrailersResponse())
            elif kind == "response_headers":
                yield pb.ProcessingResponse(response_headers=pb.HeadersResponse())
            elif kind == "response_body":
                chunk = request.response_body
                for reply in _body_replies(chunk.body, response_side=True, end_of_stream=chunk.end_of_stream):
                    yield reply
            elif kind == "response_trailers":
                yield pb.ProcessingResponse(response_trailers=pb.TrailersResponse())


class PickerProcess:
    """The fake picker in a child process (``python -m tests.gateway.picker``): the test process runs no
    gRPC threads of its own, so starting the stack's other children never forks a process with them."""

    def __init__(self, log_dir: Path, env: Mapping[str, str]) -> None:
        self.pick_file = log_dir / "picker-pick.json"
        self.seen_file = log_dir / "picker-seen.jsonl"
        self.pick_file.write_text(json.dumps({"decode": "127.0.0.1:9", "prefill": None}))
        self.seen_file.write_text("")
        self.child = Child("picker", [sys.executable, "-m", "tests.gateway.picker", str(self.pick_file),
                                      str(self.seen_file)], env, log_dir)
        self.port = 0

    def start(self, timeout: float) -> None:
        self.child.start()
        self.port = int(ready.parse(self.child.wait_ready(timeout))["grpc"])

    def choose(self, pick: Pick) -> None:
        staged = self.pick_file.with_suffix(".tmp")
        staged.write_text(json.dumps({"decode": pick.decode, "prefill": pick.prefill}))
        staged.replace(self.pick_file)  # atomic: a request reads the old pick or the new one, whole

    def seen(self) -> list[dict[str, str]]:
        return [json.loads(line) for line in self.seen_file.read_text().splitlines() if line]

    def forget(self) -> None:
        self.seen_file.write_text("")

    def stop(self) -> None:
        self.child.stop()


async def _serve(pick_file: Path, seen_file: Path) -> None:
    server = grpc.aio.server()
    pb_grpc.add_ExternalProcessorServicer_to_server(FakePicker(pick_file, seen_file), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    sys.stdout.write(ready.format_line(grpc=port) + "\n")
    sys.stdout.flush()
    await server.wait_for_termination()


if __name__ == "__main__":
    asyncio.run(_serve(Path(sys.argv[1]), Path(sys.argv[2])))
