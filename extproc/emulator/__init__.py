"""Emulated inference engines for tests, the demo and the benchmark (never used in production)."""

from __future__ import annotations

import asyncio
import os
import signal
import ssl
import sys

from extproc.units import Address

ENGINES = ("vllm",)
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
              worker_id: str, block_size: int, lease_seconds: float, tls: ssl.SSLContext | None = None) -> None:
    """Serve until SIGTERM/SIGINT; print ``ready http(s)://HOST:PORT side_channel=N`` once listening."""
    from extproc.emulator.vllm import VllmEmulator

    emulator = VllmEmulator(role, model, worker_id or f"{role}-{os.getpid()}", side_listen.host,
                            block_size, lease_seconds)
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
