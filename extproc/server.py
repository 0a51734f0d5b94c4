"""The grpc.aio shell: the ext_proc stream loop, gRPC health, and drain on SIGTERM.

Only this module reads from and writes to the gRPC stream. A client that goes away makes Envoy reset
the stream; grpc.aio then cancels the handler task, and the prefill call awaited inside it is
cancelled with it, so decode is never dispatched.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import AsyncIterator, Callable

import grpc
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer

from extproc import envoy_messages as msg
from extproc.adapters import build_adapter
from extproc.config import Settings
from extproc.errors import Code
from extproc.processor import Admission, PdProcessor
from extproc.upstream import PrefillClient, PrefillLimits

log = logging.getLogger("extproc.server")
EXT_PROC_SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"


class ExtProcServicer(pb_grpc.ExternalProcessorServicer):  # type: ignore[misc]
    def __init__(self, processor: PdProcessor) -> None:
        self._processor = processor

    async def Process(
        self, request_iterator: AsyncIterator[pb.ProcessingRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.ProcessingResponse]:
        head: msg.RequestHead | None = None
        async for request in request_iterator:
            kind = request.WhichOneof("request")
            if kind == "request_headers":
                head = msg.head_from_headers(request.request_headers)
                refusal = self._processor.refuse_head(head)
                if refusal is None and request.request_headers.end_of_stream:
                    refusal = msg.error_reply(Code.INVALID_REQUEST_BODY, 400)  # a P/D POST without a body
                if refusal is not None:
                    yield refusal
                    return
                yield msg.continue_headers()
            elif kind == "request_body":
                if head is None and msg.ATTR_NAMESPACE in request.attributes:
                    head = msg.head_from_attributes(request.attributes[msg.ATTR_NAMESPACE])
                if head is None:
                    log.error("request body arrived without headers or attributes: check the Envoy config")
                    yield msg.error_reply(Code.INTERNAL_ERROR, 500)
                    return
                yield await self._processor.on_body(head, request.request_body.body)
            elif kind is not None:
                # Not configured to arrive; answer so Envoy does not treat the stream as broken.
                response = pb.ProcessingResponse()
                getattr(response, kind).SetInParent()
                yield response


class ExtProcServer:
    """The server and everything it owns, built from Settings."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.admission = Admission(limit=settings.max_inflight)
        self.prefill = PrefillClient(PrefillLimits(
            connect_timeout=settings.prefill_connect_timeout,
            read_timeout=settings.prefill_read_timeout,
            deadline=settings.prefill_deadline,
            max_response_bytes=settings.max_prefill_response_bytes,
            max_connections=settings.max_inflight,
        ))
        self.processor = PdProcessor(
            build_adapter(settings.adapter, settings.protocol),
            self.prefill,
            settings.max_request_bytes,
            self.admission,
        )
        self.health = HealthServicer()
        limit = settings.grpc_max_message_bytes
        self.grpc = grpc.aio.server(options=[
            ("grpc.max_receive_message_length", limit),
            ("grpc.max_send_message_length", limit),
            ("grpc.max_concurrent_streams", 0x7FFFFFFF),
        ])
        pb_grpc.add_ExternalProcessorServicer_to_server(ExtProcServicer(self.processor), self.grpc)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.grpc)
        self.bound_port = self.grpc.add_insecure_port(settings.grpc_listen.grpc_target())
        if self.bound_port == 0 and not settings.grpc_listen.is_unix:
            raise OSError(f"cannot listen on {settings.grpc_listen}")

    @property
    def address(self) -> str:
        listen = self.settings.grpc_listen
        if listen.is_unix:
            return listen.grpc_target()
        host = f"[{listen.host}]" if ":" in listen.host else listen.host
        return f"{host}:{self.bound_port}"

    async def start(self) -> None:
        await self.grpc.start()
        for service in ("", EXT_PROC_SERVICE):
            await self.health.set(service, health_pb2.HealthCheckResponse.SERVING)

    async def drain(self) -> None:
        """Stop taking new P/D requests, let in-flight ones finish within the grace period, stop."""
        self.admission.draining = True
        for service in ("", EXT_PROC_SERVICE):
            await self.health.set(service, health_pb2.HealthCheckResponse.NOT_SERVING)
        await self.grpc.stop(self.settings.drain_timeout)
        await self.prefill.aclose()


async def serve(settings: Settings, on_ready: Callable[[str], None] | None = None) -> None:
    """Run until SIGTERM or SIGINT, then drain."""
    server = ExtProcServer(settings)
    await server.start()
    log.info("ext_proc server listening", extra={"address": server.address, "settings": settings.describe()})
    if on_ready is not None:
        on_ready(server.address)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    log.info("draining", extra={"grace_seconds": settings.drain_timeout})
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.remove_signal_handler(sig)  # a second signal now stops at once (default action)
    await server.drain()
    log.info("stopped")
