"""Emulated inference engines for tests, the demo and the benchmark (never used in production)."""

from __future__ import annotations

import asyncio
import os
import signal
import ssl
import sys
from typing import TYPE_CHECKING

from extproc.units import Address

if TYPE_CHECKING:
    from extproc.emulator.sglang import SglangEmulator
    from extproc.emulator.trtllm import TrtllmEmulator
    from extproc.emulator.vllm import VllmEmulator

ENGINES = ("vllm", "sglang", "trtllm")
ROLES = ("prefill", "decode", "both")


def server_tls(cert_file: str, key_file: str, client_ca_file: str) -> ssl.SSLContext | None:
    """TLS for the emulated OpenAI listener (not the side channel); a client CA makes it mTLS."""
    if not cert_file:
        return None
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(cert_file, key_file or None)
    if client_ca_file:
        context.verify_mode = ssl.CERT_REQUIRED
        context.load_verify_locations(client_ca_file)
    return context


async def run(engine: str, role: str, listen: Address, side_listen: Address, model: str,
              worker_id: str, block_size: int, lease_seconds: float, tls: ssl.SSLContext | None = None,
              kv_timeout: float = 300.0) -> None:
    """Serve until SIGTERM/SIGINT; print ``ready http(s)://HOST:PORT side_channel=N`` once listening.
    The side channel is vLLM's NIXL side channel, SGLang's bootstrap server, or TensorRT-LLM's KV
    registry (``ctx_info_endpoint``); 0 on a worker that has none."""
    emulator = _build(engine, role, side_listen.host, model, worker_id or f"{role}-{os.getpid()}", block_size,
                      lease_seconds, kv_timeout)
    port = await emulator.start(listen.host, listen.port, side_listen.port, tls)
    host = f"[{listen.host}]" if ":" in listen.host else listen.host
    scheme = "https" if tls is not None else "http"
    sys.stdout.write(f"ready {scheme}://{host}:{port} side_channel={emulator.side_port}\n")
    sys.stdout.flush()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await emulator.close()


def _build(engine: str, role: str, side_host: str, model: str, worker_id: str, block_size: int,
           lease_seconds: float, kv_timeout: float) -> VllmEmulator | SglangEmulator | TrtllmEmulator:
    from extproc.emulator.sglang import SglangEmulator
    from extproc.emulator.trtllm import TrtllmEmulator
    from extproc.emulator.vllm import VllmEmulator

    if engine == "sglang":
        return SglangEmulator(role, model, worker_id, side_host, kv_timeout)
    if engine == "trtllm":
        return TrtllmEmulator(role, model, worker_id, side_host, lease_seconds)
    return VllmEmulator(role, model, worker_id, side_host, block_size, lease_seconds)
