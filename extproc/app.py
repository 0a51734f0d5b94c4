"""The application: the one place the object graph is built from Settings (the clock, adapter, prefill
client, decode control client, admission, metrics, tracing, decode-queue watch and its scraper,
processor, gRPC and HTTP servers), gRPC health, the
metrics/health HTTP endpoint, drain and signals. The stream loop itself is extproc/envoy/stream.py.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import ssl
from collections.abc import Callable
from functools import partial
from math import nan
from typing import TYPE_CHECKING

from extproc.adapters import build_adapter, engines
from extproc.clock import Clock, MonotonicClock
from extproc.config import ConfigError, Settings
from extproc.envoy.h2server import GrpcServer
from extproc.envoy.health import NOT_SERVING, SERVING, Health
from extproc.envoy.stream import EXT_PROC_SERVICE, ExtProcServicer
from extproc.malloc import keep_large_blocks
from extproc.observability.httpserver import HttpServer, Request, Response
from extproc.observability.metrics import Metrics
from extproc.pipeline.admission import Admission
from extproc.pipeline.background import BackgroundPrefills
from extproc.pipeline.inspector import Inspector, pool_size
from extproc.pipeline.processor import PdProcessor
from extproc.protocol.headers import PICKER_HEADERS
from extproc.protocol.prefill_policy import PrefillPolicy
from extproc.protocol.settings_spec import SecretFileError
from extproc.protocol.units import Address
from extproc.upstream.client import WorkerClient, WorkerLimits, WorkerTls, tls_context
from extproc.upstream.decode_queue import DecodeQueueWatch, QueueLimit
from extproc.upstream.decode_target import DecodeTarget, Unresolvable
from extproc.workers import SharedAdmission, SharedBlock, SharedQueueReading, WorkerRole

if TYPE_CHECKING:
    from extproc.observability.tracing import Tracing

log = logging.getLogger("extproc.server")
# Seconds NOT_SERVING is visible before the listener closes (Envoy ejects after 2 checks, 1 s apart).
HEALTH_NOTICE = 2.5


def _prefill_tls(settings: Settings) -> WorkerTls | None:
    if not settings.prefill_tls:
        return None
    try:
        context = tls_context(settings.prefill_ca_file, settings.prefill_cert_file, settings.prefill_key_file)
    except (OSError, ssl.SSLError) as exc:
        raise ConfigError(f"prefill TLS files cannot be loaded: {exc}") from None
    return WorkerTls(context, settings.prefill_server_name)


# A decode worker's metrics page: vLLM's with several ranks and many histograms runs to a few MiB.
DECODE_METRICS_MAX_BYTES = 16 << 20


def _decode_queue(settings: Settings, policy: PrefillPolicy, decode: DecodeTarget, metrics: Metrics, clock: Clock,
                  block: SharedBlock | None = None, index: int = 0) -> DecodeQueueWatch | QueueLimit | None:
    """The decode-queue watch; with several workers only worker 0 runs it (one scrape of the decode
    worker, not N) and publishes each reading in the shared block, where the others read it."""
    engine = engines().get(settings.adapter)
    if not settings.decode_queue_limit or engine is None or engine.decode_queue is None:
        return None
    if block is not None and index != 0:
        return SharedQueueReading(block, settings.decode_queue_limit, settings.decode_queue_interval, clock)
    interval = settings.decode_queue_interval
    # The decode scraper: its own client, so it takes no prefill connection slot, and neither the
    # prefill limits nor their size cap apply to it.
    scraper = WorkerClient(WorkerLimits(
        connect_timeout=interval, read_timeout=interval, deadline=interval,
        max_response_bytes=DECODE_METRICS_MAX_BYTES, max_connections=1), policy, clock=clock)
    watch = DecodeQueueWatch(scraper, decode, engine.decode_queue, settings.decode_queue_limit,
                             settings.decode_queue_interval, clock,
                             on_failure=lambda reason: metrics.decode_queue_failures.labels(reason).inc(),
                             on_reading=None if block is None else partial(SharedQueueReading.publish, block))
    # Read at scrape time from the watch, the reading's one owner: NaN exactly when the limit has
    # nothing fresh to act on.
    metrics.decode_queue.set_function(lambda: nan if watch.waiting is None else watch.waiting)
    return watch


def _tracing(settings: Settings) -> Tracing | None:
    if settings.tracing == "off":
        return None
    try:
        from extproc.observability.tracing import Tracing
    except ImportError:
        raise ConfigError("PD_EXTPROC_TRACING=otlp needs the otel extra: pip install 'pd-extproc[otel]'") from None
    return Tracing(settings.otlp_endpoint)


class ListenError(OSError):
    """A listener cannot bind; the message says which and where, for the operator."""


def metrics_listen_error(listen: Address, exc: OSError) -> ListenError:
    """metrics_listen cannot be bound (by the server, or by the supervisor of several)."""
    return ListenError(f"cannot listen on {listen} (metrics_listen): {exc.strerror}; choose another "
                       "with --metrics-listen")


class ExtProcServer:
    """The server and everything it owns, built from Settings. Construct inside the running loop.

    With a ``role`` it is one worker of several (``serve --workers N``): its admission counts in the
    shared block, its HTTP endpoint is a private Unix socket the supervisor scrapes, and only worker 0
    watches the decode queue."""

    def __init__(self, settings: Settings, role: WorkerRole | None = None) -> None:
        self.settings = settings
        self.role = role
        self.clock = MonotonicClock()  # everything below that reads the time or waits on it asks this one
        self.metrics = Metrics()
        self.block: SharedBlock | None = None
        if role is None:
            self.admission = Admission(limit=settings.max_inflight)
        else:
            self.block = SharedBlock(role.block_path, role.workers)
            self.admission = SharedAdmission(limit=settings.max_inflight, block=self.block, index=role.index)
        self.policy = PrefillPolicy(settings.prefill_allow, allow_loopback=settings.demo)
        limits = WorkerLimits(
            connect_timeout=settings.prefill_connect_timeout,
            read_timeout=settings.prefill_read_timeout,
            deadline=settings.prefill_deadline,
            max_response_bytes=settings.max_prefill_response_bytes,
            max_connections=settings.max_inflight,
            keepalive=settings.prefill_keepalive,
        )
        self.prefill_client = WorkerClient(limits, self.policy, _prefill_tls(settings),
                                           on_retry=self.metrics.prefill_retries.inc, clock=self.clock)
        # The concurrent engines' decode aborts: the local decode worker (configured, never from a request),
        # in a pool of its own so an abort never waits for a prefill connection slot. Same bounds; no TLS
        # (the decode target never uses it).
        self.decode_control = WorkerClient(limits, self.policy, clock=self.clock)
        self.tracing = _tracing(settings)
        self.background = BackgroundPrefills(self.clock)
        try:
            adapter = build_adapter(settings.adapter, settings.protocol, settings.engine_options)
        except SecretFileError as exc:
            raise ConfigError(f"adapter {settings.adapter}: {exc}") from None
        decode = self.decode = DecodeTarget(settings.decode, self.clock)
        self.decode_queue = _decode_queue(settings, self.policy, decode, self.metrics, self.clock, self.block,
                                          0 if role is None else role.index)
        self.processor = PdProcessor(
            adapter, self.prefill_client, decode_control=self.decode_control, clock=self.clock,
            max_request_bytes=settings.max_request_bytes, admission=self.admission,
            metrics=self.metrics, background=self.background, decode=decode, decode_queue=self.decode_queue,
            fallback=settings.prefill_fallback == "aggregated",
            serve_unsupported=settings.unsupported_variants == "aggregated", tracing=self.tracing,
            strip_before_decode=PICKER_HEADERS if settings.mode == "gateway" else (),
            inspector=Inspector(PdProcessor.inspection_rules(adapter, settings.max_request_bytes),
                                workers=pool_size(settings.max_inflight, 1 if role is None else role.workers),
                                max_waiting=settings.max_inflight),
        )
        self.metrics.admitted.set_function(lambda: self.admission.inflight)
        self.metrics.background_prefills.set_function(lambda: len(self.background))
        self.metrics.loop_tasks.set_function(lambda: len(asyncio.all_tasks()))  # scraped on the loop
        self.metrics.inspections_waiting.set_function(lambda: self.processor.inspector.waiting)
        self.metrics.prefill_idle_connections.set_function(self.prefill_client.idle_connections)
        self.health = Health()
        self.http = HttpServer(self._http)
        self.metrics_port = 0
        passthrough = self.metrics.passthroughs.inc if settings.mode == "gateway" else None
        self.grpc = GrpcServer({**ExtProcServicer(self.processor, passthrough).handlers(), **self.health.handlers()},
                               max_message=settings.grpc_max_message_bytes)
        self.bound_port = 0

    @property
    def address(self) -> str:
        listen = self.settings.grpc_listen
        if listen.is_unix:
            return listen.grpc_target()
        host = f"[{listen.host}]" if ":" in listen.host else listen.host
        return f"{host}:{self.bound_port}"

    async def _http(self, request: Request) -> Response:
        if request.path == "/metrics":
            return Response(200, self.metrics.exposition(), content_type="text/plain; version=0.0.4; charset=utf-8")
        if request.path == "/healthz":
            return Response(200, b'{"status":"ok"}')
        if request.path == "/readyz":
            if self.admission.draining:
                return Response(503, b'{"status":"draining"}')
            return Response(200, b'{"status":"ready"}')
        return Response(404, b'{"status":"not found"}')

    async def start(self) -> None:
        try:
            await self.decode.start()  # a name: resolved off the loop, then again every RESOLVE_TTL seconds
        except Unresolvable as exc:
            raise ConfigError(str(exc)) from None
        self.processor.inspector.start()
        listen = self.settings.metrics_listen
        try:
            if self.role is not None:
                await self.http.start_unix(str(self.role.metrics_socket))
            else:
                self.metrics_port = await self.http.start(listen.host, listen.port)
        except OSError as exc:
            raise metrics_listen_error(listen, exc) from None
        await self._listen()
        if isinstance(self.decode_queue, DecodeQueueWatch):
            self.decode_queue.start()
        for service in ("", EXT_PROC_SERVICE):
            self.health.set(service, SERVING)
        if not self.policy.explicit:
            log.warning("no prefill allow-list (PD_EXTPROC_PREFILL_ALLOW): a peer allowed to set "
                        "x-prefiller-host-port may name any address the default policy allows; an explicit list "
                        "is recommended")

    async def _listen(self) -> None:
        listen = self.settings.grpc_listen
        try:
            if listen.unix_path is not None:
                await self.grpc.listen_unix(listen.unix_path)
            else:
                self.bound_port = await self.grpc.listen_tcp(listen.host, listen.port)
        except OSError as exc:
            raise ListenError(f"cannot listen on {listen} (grpc_listen): {exc.strerror or exc}") from None

    async def drain(self) -> None:
        """Stop taking new P/D requests; give in-flight ones the grace period, then cancel them.

        Health goes NOT_SERVING first and the gRPC listener stays up for HEALTH_NOTICE seconds, so
        Envoy's health checker (two checks, 1 s apart) sees it and stops sending; a P/D stream that still
        arrives gets a JSON 503 pd_shutting_down rather than a transport error."""
        self.admission.draining = True
        for service in ("", EXT_PROC_SERVICE):
            self.health.set(service, NOT_SERVING)
        notice = min(HEALTH_NOTICE, self.settings.drain_timeout / 2)
        await self.clock.sleep(notice)  # in-flight requests carry on meanwhile
        grace_ends = self.clock.now() + self.settings.drain_timeout - notice
        await self.grpc.stop(self.settings.drain_timeout - notice)
        # Concurrent-flow prefill requests still running: the rest of the grace period, then cancelled.
        await self.background.drain(grace_ends - self.clock.now())
        if isinstance(self.decode_queue, DecodeQueueWatch):
            await self.decode_queue.stop()
        await self.prefill_client.aclose()
        await self.decode_control.aclose()
        await self.decode.stop()
        self.processor.inspector.close()
        await self.http.close()
        if self.tracing is not None:
            await asyncio.to_thread(self.tracing.shutdown)  # flushes the spans still queued


async def serve(settings: Settings, on_ready: Callable[[str, int], None] | None = None,
                role: WorkerRole | None = None) -> None:
    """Run until SIGTERM or SIGINT, then drain. A second signal stops at once."""
    large_blocks_kept = keep_large_blocks(settings.max_request_bytes)
    server = ExtProcServer(settings, role)
    await server.start()
    log.info("ext_proc server listening", extra={
        "address": server.address, "metrics_port": server.metrics_port, "settings": settings.describe(),
        "large_blocks_kept": large_blocks_kept})
    if on_ready is not None:
        on_ready(server.address, server.metrics_port)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    log.info("draining", extra={"grace_seconds": settings.drain_timeout, "inflight": server.admission.inflight})
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.remove_signal_handler(sig)
    await server.drain()
    log.info("stopped")
