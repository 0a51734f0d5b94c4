"""``python -m bench.floor.h2 unix:/path``: floor-aio's do-nothing servicer (bench/floor/replies.py
plain_reply) on our own gRPC server (extproc/envoy/h2server.py) instead of grpc.aio: the floor of the
transport ``pd-extproc serve`` runs on. Same uvloop and health service. Prints ``ready`` once listening."""

from __future__ import annotations

import asyncio
import sys

import uvloop
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from bench.floor.replies import plain_reply
from extproc.envoy.h2server import Call, GrpcServer
from extproc.envoy.h2wire import Status
from extproc.envoy.health import SERVING, Health

SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"
MAX_MESSAGE = 64 << 20


async def process(call: Call) -> tuple[int, str]:
    while (message := await call.recv()) is not None:
        call.send(plain_reply(pb.ProcessingRequest.FromString(message)).SerializeToString())
    return Status.OK, ""


async def serve(target: str) -> None:
    health = Health()
    server = GrpcServer({f"/{SERVICE}/Process": process, **health.handlers()}, MAX_MESSAGE)
    await server.listen_unix(target.removeprefix("unix:"))
    for service in ("", SERVICE):
        health.set(service, SERVING)
    print("ready", flush=True)
    await asyncio.Event().wait()


def main(argv: list[str]) -> int:
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        runner.run(serve(argv[1]))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
