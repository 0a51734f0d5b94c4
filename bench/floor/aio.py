"""``python -m bench.floor.aio [--variant plain|shape|delay|burn] unix:/path/to.sock``: our transport's floor,
a grpc.aio ext_proc servicer that does nothing (see bench/floor/__init__.py), and its variants for the Envoy
share A/B. Same grpcio, uvloop, server options and gRPC health service as ``pd-extproc serve``; an
async-generator servicer, as ours. Prints ``ready`` once listening.

  plain   floor-aio: the body back at once (bench/floor/replies.py plain_reply)
  shape   floor-aio-shape: our exact reply to a successful vllm_nixl request, at once (replies.shape_reply)
  delay   floor-aio-delay: the plain reply after ``asyncio.sleep(--delay-ms)``: the request held as long as
          our server holds one at c=1, no CPU spent
  burn    floor-aio-burn: the plain reply after spinning ``--burn-us`` of this thread's CPU on the event loop:
          our own work per request, without the wait for a prefill leg
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable

import grpc
import uvloop
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer

from bench.floor.replies import plain_reply, shape_reply

SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"
MAX_MESSAGE = 64 << 20
VARIANTS = ("plain", "shape", "delay", "burn")
# How long our server holds a non-streaming P/D request at c=1 (bench/RESULTS.md: its log's total_ms,
# 0.5-0.7 ms). uvloop 0.23 rounds a timer to whole milliseconds (loop.pyx Loop.call_later:
# round(delay * 1000)), so this sleep is a 1 ms timer: 1.1 ms median at c=1, measured.
DELAY_MS = 0.6
# Our own work per P/D request at c=64: our server's CPU minus floor-aio's (bench/RESULTS.md, 792 - 363 µs).
BURN_US = 430.0
Reply = Callable[[pb.ProcessingRequest], pb.ProcessingResponse]
BeforeBody = Callable[[], Awaitable[None]]


def burn(microseconds: float) -> None:
    """Spin until this thread has used ``microseconds`` of CPU (not wall time: preemption does not shorten it)."""
    end = time.thread_time_ns() + int(microseconds * 1000)
    while time.thread_time_ns() < end:
        pass


def variant_behaviour(variant: str, delay_ms: float = DELAY_MS, burn_us: float = BURN_US
                      ) -> tuple[Reply, BeforeBody | None]:
    """The reply function of a variant and what it does before it answers a body (None: nothing)."""
    if variant == "shape":
        return shape_reply, None
    if variant == "delay":
        async def sleep() -> None:
            await asyncio.sleep(delay_ms / 1000)
        return plain_reply, sleep
    if variant == "burn":
        async def spin() -> None:
            burn(burn_us)
        return plain_reply, spin
    if variant == "plain":
        return plain_reply, None
    raise ValueError(variant)


class Servicer(pb_grpc.ExternalProcessorServicer):  # type: ignore[misc]
    def __init__(self, reply: Reply = plain_reply, before_body: BeforeBody | None = None) -> None:
        self._reply, self._before_body = reply, before_body

    async def Process(self, request_iterator: AsyncIterator[pb.ProcessingRequest],
                      context: grpc.aio.ServicerContext) -> AsyncIterator[pb.ProcessingResponse]:
        async for request in request_iterator:
            if self._before_body is not None and request.HasField("request_body"):
                await self._before_body()
            yield self._reply(request)


async def serve(target: str, servicer: Servicer) -> None:
    server = grpc.aio.server(options=[("grpc.max_receive_message_length", MAX_MESSAGE),
                                      ("grpc.max_send_message_length", MAX_MESSAGE),
                                      ("grpc.max_concurrent_streams", 0x7FFFFFFF)])
    pb_grpc.add_ExternalProcessorServicer_to_server(servicer, server)
    health = HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    server.add_insecure_port(target)
    await server.start()
    for service in ("", SERVICE):
        await health.set(service, health_pb2.HealthCheckResponse.SERVING)
    print("ready", flush=True)
    await server.wait_for_termination()


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.floor.aio", description=__doc__.split("\n", 1)[0])
    parser.add_argument("target", help="where to listen: unix:/path or host:port")
    parser.add_argument("--variant", choices=VARIANTS, default="plain")
    parser.add_argument("--delay-ms", type=float, default=DELAY_MS, help="delay: how long each body is held")
    parser.add_argument("--burn-us", type=float, default=BURN_US, help="burn: CPU spun before each body's answer")
    args = parser.parse_args(argv[1:])
    servicer = Servicer(*variant_behaviour(args.variant, args.delay_ms, args.burn_us))
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        runner.run(serve(args.target, servicer))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
