"""The prefill HTTP client: pooled, bounded, under one deadline, with failures classified once.

This is the only module that talks HTTP to engines. Every transport failure becomes a PdError here:
  * nothing answered in time (connect, a read gap, or the total deadline) -> prefill_upstream_timeout
  * the connection could not be made or broke before the response head  -> prefill_upstream_unavailable
  * the connection broke after the head, mid-body                        -> prefill_response_truncated
  * the body exceeds the cap (Content-Length, or while reading)          -> prefill_response_too_large
A non-200 status is returned without reading its body: it is never relayed.

aiohttp rather than httpx: on the same emulated worker one prefill call cost 0.86 ms p50 with
aiohttp and 2.2 ms with httpx (README, "Design notes").
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass

import aiohttp

from extproc.adapters.base import PrefillReply
from extproc.errors import Code, PdError
from extproc.prefill_target import PrefillTarget

_READ_CHUNK = 64 << 10


@dataclass(frozen=True, slots=True)
class PrefillLimits:
    connect_timeout: float
    read_timeout: float
    deadline: float
    max_response_bytes: int
    max_connections: int


class PrefillClient:
    """One pooled client for every prefill worker. Create inside the running loop; ``aclose`` on shutdown."""

    def __init__(self, limits: PrefillLimits) -> None:
        self._limits = limits
        self._session: aiohttp.ClientSession | None = None
        self._timeout = aiohttp.ClientTimeout(
            total=None, connect=None, sock_connect=limits.connect_timeout, sock_read=limits.read_timeout,
        )

    def _open(self) -> aiohttp.ClientSession:
        if self._session is None:
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(
                    limit=self._limits.max_connections, limit_per_host=0, keepalive_timeout=30,
                    ttl_dns_cache=None, use_dns_cache=False,
                ),
                timeout=self._timeout,
                cookie_jar=aiohttp.DummyCookieJar(),  # never carry one client's cookies to another
                auto_decompress=False,  # we ask for identity; the size cap is on the bytes we read
                trust_env=False,  # never route prefill traffic through an environment proxy
                skip_auto_headers=("User-Agent", "Accept-Encoding", "Accept"),
            )
        return self._session

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()

    async def post(
        self, target: PrefillTarget, path: str, headers: Sequence[tuple[str, str]], body: bytes
    ) -> PrefillReply:
        """POST ``body`` to the target under the total deadline; see the module docstring for errors."""
        try:
            async with asyncio.timeout(self._limits.deadline):
                return await self._exchange(target, path, headers, body)
        except TimeoutError:
            raise PdError(Code.PREFILL_UPSTREAM_TIMEOUT) from None

    async def _exchange(
        self, target: PrefillTarget, path: str, headers: Sequence[tuple[str, str]], body: bytes
    ) -> PrefillReply:
        url = f"http://{target.authority}{path}"
        try:
            response = await self._open().post(
                url, data=body, headers=[*headers, ("host", target.authority)], allow_redirects=False,
            )
        except (aiohttp.ServerTimeoutError, aiohttp.ConnectionTimeoutError):
            raise PdError(Code.PREFILL_UPSTREAM_TIMEOUT) from None
        except (aiohttp.ClientError, OSError):
            raise PdError(Code.PREFILL_UPSTREAM_UNAVAILABLE) from None
        try:
            content_type = response.headers.get("content-type")
            if response.status != 200:
                return PrefillReply(response.status, content_type, b"")
            return PrefillReply(200, content_type, await self._read_capped(response))
        finally:
            response.close()

    async def _read_capped(self, response: aiohttp.ClientResponse) -> bytes:
        cap = self._limits.max_response_bytes
        if response.content_length is not None and response.content_length > cap:
            raise PdError(Code.PREFILL_RESPONSE_TOO_LARGE)
        chunks: list[bytes] = []
        size = 0
        try:
            while True:
                chunk = await response.content.read(_READ_CHUNK)
                if not chunk:
                    break
                size += len(chunk)
                if size > cap:
                    raise PdError(Code.PREFILL_RESPONSE_TOO_LARGE)
                chunks.append(chunk)
        except aiohttp.ServerTimeoutError:
            raise PdError(Code.PREFILL_UPSTREAM_TIMEOUT) from None
        except (aiohttp.ClientError, OSError):
            raise PdError(Code.PREFILL_RESPONSE_TRUNCATED) from None
        return b"".join(chunks)
