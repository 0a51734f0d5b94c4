"""Helpers the emulators share: reading the OpenAI body, scripted misbehaviour (delay, hang, an
error status, a dropped connection), and the servers and client session every emulated engine runs."""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import Callable
from typing import Any

import aiohttp
import orjson

from extproc.observability.httpserver import Response
from pd_extproc_lab.emulator import text
from pd_extproc_lab.emulator.behaviour import Behaviour
from pd_extproc_lab.emulator.control import Control
from pd_extproc_lab.emulator.http import EmulatorHttpServer, Handler, RawResponse, Reply

GENERATION_PATHS = ("/v1/chat/completions", "/v1/completions")
WORKER_HEADER = "x-emulator-worker"


def prompt_text(body: dict[str, Any], chat: bool) -> str:
    return text.chat_prompt(body.get("messages")) if chat else text.completion_prompt(body.get("prompt"))


def max_tokens(body: dict[str, Any], chat: bool, default: int) -> int:
    for name in (("max_completion_tokens", "max_tokens") if chat else ("max_tokens",)):
        value = body.get(name)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return default


def include_usage(body: dict[str, Any]) -> bool:
    options = body.get("stream_options")
    return isinstance(options, dict) and options.get("include_usage") is True


async def misbehave(control: Control[Any], behaviour: Behaviour, error: Callable[[int, str], Response]
                    ) -> Reply | None:
    """Scripted failures before any normal processing: ``delay`` (seconds), ``hold`` (until released),
    ``hang``, ``status`` (answered with the engine's own error shape), ``close`` (the connection drops at
    once)."""
    if behaviour.delay is not None:
        await asyncio.sleep(behaviour.delay)
    if behaviour.hold:
        await control.held()
    if behaviour.hang:
        await asyncio.Event().wait()
    if behaviour.status is not None:
        return error(behaviour.status, "emulated failure")
    if behaviour.close:
        return RawResponse(_close_at_once)
    return None


def json_object(raw: bytes) -> dict[str, Any] | str:
    """The request body as a JSON object, or what is wrong with it ("not JSON", "not an object")."""
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return "not JSON"
    return body if isinstance(body, dict) else "not an object"


async def _close_at_once(writer: asyncio.StreamWriter) -> None:
    writer.close()


def client_session(timeout: float) -> aiohttp.ClientSession:
    return aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout), trust_env=False)


class EngineServers:
    """What every emulated engine runs: its OpenAI API, its own side server for the KV rendezvous
    (vLLM's side channel, SGLang's bootstrap server, TensorRT-LLM's context registry), served only by
    the roles that hold KV, and the client session it reaches its peers with."""

    def __init__(self, control: Control[Any], api: Handler, side: Handler, client_timeout: float) -> None:
        self.api = EmulatorHttpServer(api, on_disconnect=control.disconnected)
        self.side = EmulatorHttpServer(side)
        self._client_timeout = client_timeout
        self._client: aiohttp.ClientSession | None = None

    @property
    def client(self) -> aiohttp.ClientSession:
        assert self._client is not None, "the engine's servers are not started"
        return self._client

    async def start(self, host: str, port: int, tls: ssl.SSLContext | None,
                    side: tuple[str, int] | None) -> tuple[int, int | None]:
        """The API's bound port, and the side server's (None when ``side`` is None: not served)."""
        self._client = client_session(self._client_timeout)
        bound = await self.api.start(host, port, tls)
        side_bound = await self.side.start(*side) if side is not None else None
        return bound, side_bound

    async def close(self) -> None:
        await self.api.close()
        await self.side.close()
        if self._client is not None:
            await self._client.close()


def authority(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
