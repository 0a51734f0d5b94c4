"""Server-info discovery: a prefill worker's JSON self-description (SGLang's /server_info), fetched
through the transport and cached per endpoint with a bound and a TTL.

The fetch carries only the adapter's own headers (e.g. the configured SGLang API key), never a
client's, so a cached answer belongs to no tenant and may serve every request. Only the keys the
adapter reads are kept (SGLang's /server_info also returns its API keys, unredacted).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import orjson

from extproc.clock import Clock
from extproc.protocol import jsonspan
from extproc.protocol.errors import Code, PdError
from extproc.protocol.prefill_json import upstream_status_error
from extproc.protocol.transport import ResolvedTarget, Transport

SERVER_INFO_TTL = 60.0  # seconds a discovered document is reused for one endpoint
SERVER_INFO_ENTRIES = 1024  # endpoints remembered at most (least recently fetched dropped first)


class ServerInfoCache:
    def __init__(self, transport: Transport, headers: Sequence[tuple[str, str]] = (), *, clock: Clock,
                 keep: Sequence[str] = (), ttl: float = SERVER_INFO_TTL, entries: int = SERVER_INFO_ENTRIES) -> None:
        self._transport = transport
        self._headers = list(headers)
        self._keep = frozenset(keep)
        self._ttl = ttl
        self._entries = entries
        self._clock = clock
        self._cache: OrderedDict[tuple[str, int, str], tuple[float, dict[str, Any]]] = OrderedDict()

    async def get(self, target: ResolvedTarget, path: str) -> dict[str, Any]:
        """The JSON object at ``path``; failures are the prefill leg's errors (and are not cached)."""
        key = (str(target.ip), target.target.port, path)
        cached = self._cache.get(key)
        if cached is not None and cached[0] > self._clock.now():
            return cached[1]
        info = await self._fetch(target, path)
        self._cache[key] = (self._clock.now() + self._ttl, info)
        self._cache.move_to_end(key)
        while len(self._cache) > self._entries:
            self._cache.popitem(last=False)
        return info

    async def _fetch(self, target: ResolvedTarget, path: str) -> dict[str, Any]:
        reply = await self._transport.get(target, path, self._headers)
        if reply.status != 200:
            raise upstream_status_error(reply.status)
        try:
            info = orjson.loads(reply.body)
        except orjson.JSONDecodeError:
            raise PdError(Code.PREFILL_RESPONSE_NOT_JSON) from None
        if not isinstance(info, dict):
            raise PdError(Code.PREFILL_RESPONSE_NOT_JSON)
        try:
            jsonspan.unique_members(reply.body)  # a key twice: which copy the engine meant is unknown
        except jsonspan.RepeatedKey:
            raise PdError(Code.PREFILL_RESPONSE_NOT_JSON) from None
        return {key: value for key, value in info.items() if key in self._keep}

    def __len__(self) -> int:
        return len(self._cache)
