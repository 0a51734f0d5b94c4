"""gRPC health (grpc.health.v1.Health, grpc/grpc doc/health-checking.md) on our HTTP/2 server: Envoy's
health checker calls Check on the ext_proc cluster; Watch streams each change, as grpcio's servicer does."""

from __future__ import annotations

import asyncio

from grpc_health.v1 import health_pb2

from extproc.envoy.h2server import Call, Handler
from extproc.envoy.h2wire import Status

SERVICE = "grpc.health.v1.Health"
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
SERVICE_UNKNOWN = health_pb2.HealthCheckResponse.SERVICE_UNKNOWN


class Health:
    """Each service's status, set by the application (serving, then not serving while it drains)."""

    def __init__(self) -> None:
        self._status: dict[str, int] = {}
        self._changed = asyncio.Event()

    def set(self, service: str, status: int) -> None:
        self._status[service] = status
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()

    def handlers(self) -> dict[str, Handler]:
        return {f"/{SERVICE}/Check": self.check, f"/{SERVICE}/Watch": self.watch}

    async def _service(self, call: Call) -> str | None:
        message = await call.recv()
        if message is None:
            return None
        return str(health_pb2.HealthCheckRequest.FromString(message).service)

    async def check(self, call: Call) -> tuple[int, str]:
        service = await self._service(call)
        if service is None:
            return Status.INTERNAL, "no request message"
        status = self._status.get(service)
        if status is None:
            return Status.NOT_FOUND, "unknown service"
        call.send(health_pb2.HealthCheckResponse(status=status).SerializeToString())
        return Status.OK, ""

    async def watch(self, call: Call) -> tuple[int, str]:
        service = await self._service(call)
        if service is None:
            return Status.INTERNAL, "no request message"
        last = None
        while True:  # until the client cancels (RST_STREAM cancels this task)
            changed = self._changed
            status = self._status.get(service, SERVICE_UNKNOWN)
            if status != last:
                call.send(health_pb2.HealthCheckResponse(status=status).SerializeToString())
                last = status
            await changed.wait()
