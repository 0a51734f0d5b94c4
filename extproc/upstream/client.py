"""The workers' HTTP client: target resolution under the policy, pooled connections, bounded reads,
one deadline, and failures classified once.

This is the only module that talks to workers. app.py builds one ``WorkerClient`` per job, each named
for it: the prefill client (prefill requests, target resolution, server-info discovery), the decode
control client (a concurrent engine's decode aborts) and the decode scraper (the decode-queue watch's
metrics page). The codes below say "prefill" because the prefill client is where a client can see
them. Every failure becomes a PdError here:
  * the target is outside the prefill policy                             -> prefill_target_forbidden
  * nothing answered in time (connect, a read gap, or the total deadline) -> prefill_upstream_timeout
  * no address, or the connection failed or broke before a response head -> prefill_upstream_unavailable
  * the connection broke after the head, mid-body                        -> prefill_response_truncated
  * the body exceeds the cap (Content-Length, or while reading)          -> prefill_response_too_large
  * the path or a header cannot be written as HTTP/1.1 (never sent)       -> invalid_request_field
A non-200 status is returned without reading its body: it is never relayed (the connection is then
closed, not reused). The exception -> code table is ``classify`` (pure; unit-tested row by row).

A host name is resolved here, once per request, and we connect to the address that was checked, so
a second resolution cannot swap in a forbidden address. The HTTP/1.1 exchange is extproc/upstream/http1.py on
an asyncio Protocol, with a keep-alive pool per (address, port, TLS name): no proxies, no redirects,
no decompression, no cookies. It replaced aiohttp, which replaced httpx; each was measured on the same
worker (docs/decisions.md).
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
import ssl
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import Enum

from extproc.clock import Clock
from extproc.protocol.errors import Code, PdError
from extproc.protocol.lru import Lru
from extproc.protocol.prefill_policy import PrefillPolicy, first_allowed
from extproc.protocol.relayed_error import MAX_BODY_BYTES as RELAYED_MAX_BODY_BYTES
from extproc.protocol.relayed_error import RELAYED_STATUSES
from extproc.protocol.transport import Bounds, ExchangeTimings, ResolvedTarget, WorkerAddress, WorkerReply
from extproc.upstream import http1

# The default idle limit (PD_EXTPROC_PREFILL_KEEPALIVE): an idle pooled connection older than this is
# closed, not reused. Below the engines' own keep-alive (5 s: vLLM's VLLM_HTTP_TIMEOUT_KEEP_ALIVE in
# vllm/envs.py, SGLang's SGLANG_TIMEOUT_KEEP_ALIVE in srt/environ.py, uvicorn's own default,
# uvicorn/config.py Config.__init__ timeout_keep_alive=5 at 0.55), so we rarely send a request into a
# connection the worker is closing. When we still do (a proxy in front with a shorter idle timeout, or
# the race at the limit), the request is sent once more on a new connection, but only if the reused
# connection ended before any byte of a response: see _request_head.
KEEPALIVE_SECONDS = 4.0
CHECKED_TARGETS_MAX = 1024  # IP targets the (fixed) policy allowed, kept to skip its check (LRU)


class Phase(Enum):
    HEAD = "head"  # connecting, sending, waiting for the response head
    BODY = "body"  # reading the response body


def classify(exc: BaseException, phase: Phase) -> Code:
    """The error code of a transport failure: a timeout (connect, read gap, or any TimeoutError) is a
    timeout in either phase; any other failure is "unavailable" before the response head and
    "truncated" after it."""
    if isinstance(exc, TimeoutError):
        return Code.PREFILL_UPSTREAM_TIMEOUT
    return Code.PREFILL_UPSTREAM_UNAVAILABLE if phase is Phase.HEAD else Code.PREFILL_RESPONSE_TRUNCATED


@dataclass(frozen=True, slots=True)
class WorkerLimits:
    connect_timeout: float
    read_timeout: float
    deadline: float
    max_response_bytes: int
    max_connections: int
    keepalive: float = KEEPALIVE_SECONDS  # idle seconds after which a pooled connection is not reused


@dataclass(frozen=True, slots=True)
class WorkerTls:
    context: ssl.SSLContext
    server_name: str  # "" = the target's own host


def tls_context(ca_file: str, cert_file: str, key_file: str) -> ssl.SSLContext:
    """A verifying client context: the CA bundle (or the system's), and a client certificate for mTLS."""
    context = ssl.create_default_context(cafile=ca_file or None)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    if cert_file:
        context.load_cert_chain(cert_file, key_file or None)
    return context


_PoolKey = tuple[str, int, str | None]  # (address, port, TLS server name or None)


class _Stale(Exception):
    """A reused connection ended before any byte of the response: the worker closed it while idle."""


class WorkerClient:
    """One pooled client to workers (the pool is per address). Create inside the running loop; ``aclose``
    on shutdown."""

    def __init__(self, limits: WorkerLimits, policy: PrefillPolicy, tls: WorkerTls | None = None,
                 on_retry: Callable[[], None] | None = None, *, clock: Clock) -> None:
        """``on_retry`` is called for each request sent again on a new connection (a metric); ``clock``
        times each exchange and ages idle connections."""
        self._limits = limits
        self._now = clock.now
        self._on_retry = on_retry
        self._policy = policy
        self._tls = tls
        self._idle: dict[_PoolKey, list[http1.Connection]] = {}
        self._checked: Lru[WorkerAddress, ResolvedTarget] = Lru(CHECKED_TARGETS_MAX)
        self._slots: asyncio.Semaphore | None = None  # connections in use, at most max_connections
        self._swept = clock.now()
        self._open = True

    async def aclose(self) -> None:
        self._open = False
        for connections in self._idle.values():
            for connection in connections:
                connection.close()
        self._idle.clear()

    def idle_connections(self) -> int:
        return sum(len(connections) for connections in self._idle.values())

    async def resolve(self, target: WorkerAddress) -> ResolvedTarget:
        """The address to connect to, checked against the policy. No connection is made here."""
        if target.ip is not None:
            checked = self._checked.get(target)
            if checked is None:
                if not self._policy.allows_address(target.ip, target.port):
                    raise PdError(Code.PREFILL_TARGET_FORBIDDEN)
                checked = ResolvedTarget(target, target.ip, tls=self._tls is not None)
                self._checked.put(target, checked)
            return checked
        name_allowed = self._policy.allows_name(target.host, target.port)
        try:
            async with asyncio.timeout(self._limits.connect_timeout):
                infos = await asyncio.get_running_loop().getaddrinfo(
                    target.host, target.port, type=socket.SOCK_STREAM, proto=socket.IPPROTO_TCP)
        except TimeoutError:
            raise PdError(Code.PREFILL_UPSTREAM_TIMEOUT) from None
        except OSError:
            raise PdError(Code.PREFILL_UPSTREAM_UNAVAILABLE) from None
        addresses = [ipaddress.ip_address(str(info[4][0]).split("%", 1)[0]) for info in infos]
        chosen = first_allowed(self._policy, addresses, target.port, name_allowed)
        if chosen is None:
            raise PdError(Code.PREFILL_TARGET_FORBIDDEN)
        return ResolvedTarget(target, chosen, tls=self._tls is not None)

    async def post(self, target: ResolvedTarget, path: str, headers: Sequence[tuple[str, str]], body: bytes,
                   timings: ExchangeTimings | None = None, bounds: Bounds | None = None) -> WorkerReply:
        """POST ``body`` to the resolved target under the total deadline; see the module docstring."""
        return await self._bounded("POST", target, path, headers, body, timings, bounds)

    async def get(self, target: ResolvedTarget, path: str, headers: Sequence[tuple[str, str]]) -> WorkerReply:
        return await self._bounded("GET", target, path, headers, None, None, None)

    async def _bounded(self, method: str, target: ResolvedTarget, path: str, headers: Sequence[tuple[str, str]],
                       body: bytes | None, timings: ExchangeTimings | None, bounds: Bounds | None) -> WorkerReply:
        started = self._now()
        deadline = bounds.deadline if bounds is not None else self._limits.deadline
        gap = bounds.read_timeout if bounds is not None else self._limits.read_timeout
        if self._slots is None:
            self._slots = asyncio.Semaphore(self._limits.max_connections)
        deadline_at = asyncio.get_running_loop().time() + deadline
        try:
            if self._slots.locked():  # the wait for a slot counts against the deadline too
                async with asyncio.timeout_at(deadline_at):
                    await self._slots.acquire()
            else:
                await self._slots.acquire()  # a free slot: taken without waiting
            # From here every wait (the connect, each read) is bounded by the deadline itself
            # (http1.Connection.deadline), without a timeout context per request.
            try:
                return await self._exchange(method, target, path, headers, body, timings, started, gap, deadline_at)
            finally:
                self._slots.release()
        except TimeoutError:
            raise PdError(Code.PREFILL_UPSTREAM_TIMEOUT) from None
        finally:
            if timings is not None:
                timings.total_seconds = self._now() - started

    async def _exchange(self, method: str, target: ResolvedTarget, path: str, headers: Sequence[tuple[str, str]],
                        body: bytes | None, timings: ExchangeTimings | None, started: float,
                        gap: float, deadline_at: float) -> WorkerReply:
        tls = self._tls if target.tls else None
        server_name = (tls.server_name or target.target.host) if tls else None
        key = (str(target.ip), target.target.port, server_name)
        # The client's path and query go out exactly as received (no re-quoting of %2F).
        try:
            request = http1.encode_request(method, path, target.target.authority, headers, body)
        except http1.InvalidRequest as exc:  # never through Envoy, which refuses such a path or header first
            raise PdError(Code.INVALID_REQUEST_FIELD, field=exc.part) from None
        connection = self._pooled(key)
        try:
            if connection is None:
                connection = await self._connect(key, tls, timings, deadline_at)
                head = await self._request_head(connection, request, gap, deadline_at, reused=False)
            else:
                try:
                    head = await self._request_head(connection, request, gap, deadline_at, reused=True)
                except _Stale:
                    connection.close()
                    if self._on_retry is not None:
                        self._on_retry()
                    connection = await self._connect(key, tls, timings, deadline_at)
                    head = await self._request_head(connection, request, gap, deadline_at, reused=False)
            if timings is not None:
                timings.response_seconds = self._now() - started
                timings.status = head.status
            content_type = head.get("content-type")
            if head.status != 200:
                return WorkerReply(head.status, content_type, await self._error_body(connection, head, gap))
            try:
                body_read = await connection.read_body(head, self._limits.max_response_bytes, gap)
            except http1.BodyTooLarge:
                raise PdError(Code.PREFILL_RESPONSE_TOO_LARGE) from None
            except OSError as exc:
                raise PdError(classify(exc, Phase.BODY)) from None
            if timings is not None:
                timings.response_bytes = len(body_read)
            if connection.reusable and self._open:
                connection.idle_since = now = self._now()
                self._idle.setdefault(key, []).append(connection)
                connection = None
                if now - self._swept >= self._limits.keepalive:
                    self._sweep(now)
            return WorkerReply(200, content_type, body_read)
        finally:
            if connection is not None:  # anything but a complete, reusable exchange: never reused
                connection.close()

    async def _request_head(self, connection: http1.Connection, request: bytes, gap: float, deadline_at: float,
                            reused: bool) -> http1.Head:
        """Send the request and read the response head. On a reused connection that ends (closed or
        reset) before any byte of a response, _Stale: the worker closed it while it was idle in our
        pool, as its keep-alive ran out. Only then is a request sent again, once, on a new connection
        (the caller): a worker that read the request and closed without a byte may have started it, so
        a prefill can run twice; it then holds KV no decode claims until the engine's own expiry."""
        assert connection.transport is not None
        connection.deadline = deadline_at
        connection.received_any = False
        try:
            connection.transport.write(request)
            return await connection.read_head(gap)
        except (OSError, RuntimeError) as exc:  # uvloop raises RuntimeError on a transport already closed
            closed = isinstance(exc, ConnectionError | RuntimeError)  # not a timeout, not a bad response
            if reused and closed and not connection.received_any:
                raise _Stale() from None
            raise PdError(classify(exc, Phase.HEAD) if isinstance(exc, OSError)
                          else Code.PREFILL_UPSTREAM_UNAVAILABLE) from None

    def _reusable(self, connection: http1.Connection, now: float) -> bool:
        return connection.usable and now - connection.idle_since < self._limits.keepalive

    async def _error_body(self, connection: http1.Connection, head: http1.Head, gap: float) -> bytes:
        """An error answer's body, only where it may be the engine's own error about the request
        (protocol/relayed_error.py); empty when it is not, too large or not complete. Never reused after."""
        if head.status not in RELAYED_STATUSES:
            return b""
        try:
            return await connection.read_body(head, min(RELAYED_MAX_BODY_BYTES, self._limits.max_response_bytes), gap)
        except http1.DeadlineExceeded:  # the whole exchange timed out: a timeout, as anywhere else
            raise
        except (http1.BodyTooLarge, OSError):
            return b""

    def _pooled(self, key: _PoolKey) -> http1.Connection | None:
        """The most recently used idle connection to ``key`` that is still open and fresh."""
        idle = self._idle.get(key)
        now = self._now()
        while idle:
            connection = idle.pop()
            if self._reusable(connection, now):
                return connection
            connection.close()
        return None

    def _sweep(self, now: float) -> None:
        """Close every idle connection that can no longer be reused, and forget workers with none left:
        a prefill pod that went away without closing its connections must not keep them open for ever."""
        self._swept = now
        for key in list(self._idle):
            kept = []
            for connection in self._idle[key]:
                if self._reusable(connection, now):
                    kept.append(connection)
                else:
                    connection.close()
            if kept:
                self._idle[key] = kept
            else:
                del self._idle[key]

    async def _connect(self, key: _PoolKey, tls: WorkerTls | None, timings: ExchangeTimings | None,
                       deadline_at: float) -> http1.Connection:
        host, port, server_name = key
        started = self._now()
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout_at(min(loop.time() + self._limits.connect_timeout, deadline_at)):
                _, connection = await loop.create_connection(
                    http1.Connection, host, port, ssl=tls.context if tls else None, server_hostname=server_name)
        except TimeoutError:
            raise PdError(classify(http1.ConnectTimeout(), Phase.HEAD)) from None
        except OSError as exc:  # refused, unreachable, TLS handshake or certificate failures
            raise PdError(classify(exc, Phase.HEAD)) from None
        if timings is not None:
            timings.connect_seconds = self._now() - started
        return connection
