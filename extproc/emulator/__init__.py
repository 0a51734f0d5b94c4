"""Emulated inference engines for tests, the demo and the benchmark (never used in production)."""

from __future__ import annotations

import asyncio
import os
import signal
import sys

from extproc.units import Address

ENGINES = ("vllm",)
ROLES = ("prefill", "decode", "both")


async def run(engine: str, role: str, listen: Address, side_listen: Address, model: str,
              worker_id: str, block_size: int, lease_seconds: float) -> None:
    """Serve until SIGTERM/SIGINT; print ``ready http://HOST:PORT`` once listening."""
    from extproc.emulator.vllm import VllmEmulator

    emulator = VllmEmulator(role, model, worker_id or f"{role}-{os.getpid()}", side_listen.host,
                            block_size, lease_seconds)
    port = await emulator.start(listen.host, listen.port, side_listen.port)
    host = f"[{listen.host}]" if ":" in listen.host else listen.host
    sys.stdout.write(f"ready http://{host}:{port} side_channel={emulator.side_port}\n")
    sys.stdout.flush()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await emulator.close()
