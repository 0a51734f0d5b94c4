"""``python -m bench.floor.aio unix:/path/to.sock``: our transport's floor, a grpc.aio ext_proc servicer that
does nothing (see bench/floor/__init__.py). Same grpcio, uvloop, server options and gRPC health service
as ``pd-extproc serve``; an async-generator servicer, as ours. Prints ``ready`` once listening."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import AsyncIterator

import grpc
import uvloop
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer

SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"
MAX_MESSAGE = 64 << 20


def reply(request: pb.ProcessingRequest) -> pb.ProcessingResponse:
    """Continue on headers; the same body back, with its content-length, on the body."""
    response = pb.ProcessingResponse()
    kind = request.WhichOneof("request")
    if kind == "request_body":
        body = request.request_body.body
        common = response.request_body.response
        common.header_mutation.set_headers.append(base_pb2.HeaderValueOption(
            header=base_pb2.HeaderValue(key="content-length", raw_value=str(len(body)).encode()),
            append_action=base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD))
        common.body_mutation.body = body
    elif kind is not None:
        getattr(response, kind).SetInParent()
    return response


class Servicer(pb_grpc.ExternalProcessorServicer):  # type: ignore[misc]
    async def Process(self, request_iterator: AsyncIterator[pb.ProcessingRequest],
                      context: grpc.aio.ServicerContext) -> AsyncIterator[pb.ProcessingResponse]:
        async for request in request_iterator:
            yield reply(request)


async def serve(target: str) -> None:
    server = grpc.aio.server(options=[("grpc.max_receive_message_length", MAX_MESSAGE),
                                      ("grpc.max_send_message_length", MAX_MESSAGE),
                                      ("grpc.max_concurrent_streams", 0x7FFFFFFF)])
    pb_grpc.add_ExternalProcessorServicer_to_server(Servicer(), server)
    health = HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    server.add_insecure_port(target)
    await server.start()
    for service in ("", SERVICE):
        await health.set(service, health_pb2.HealthCheckResponse.SERVING)
    print("ready", flush=True)
    await server.wait_for_termination()


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        runner.run(serve(argv[1]))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
