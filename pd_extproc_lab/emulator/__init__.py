"""Emulated inference engines for tests, the demo and the benchmark (never used in production).

Each engine names its emulator in its ``Engine.emulator`` (``module:Class``). The class provides
``add_arguments(parser)`` for its own ``pd-extproc emulate`` options, ``from_args(args)`` to build
itself, and the ``Emulator`` methods below.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import signal
import ssl
import sys
from typing import Any, Protocol

from extproc import ready
from extproc.protocol.units import Address

ROLES = ("prefill", "decode", "both")


class Emulator(Protocol):
    side_port: int  # vLLM's NIXL side channel, SGLang's bootstrap server, TensorRT-LLM's KV registry; 0 if none

    async def start(self, host: str, port: int, side_port: int, tls: ssl.SSLContext | None = None) -> int: ...

    async def close(self) -> None: ...


def emulator_class(engine: str) -> Any:
    """The emulator class an engine declares (imported only when asked for)."""
    from extproc.adapters import by_engine

    module_name, _, class_name = by_engine()[engine].emulator.partition(":")
    return getattr(importlib.import_module(module_name), class_name)


def add_arguments(parser: argparse.ArgumentParser, engines: tuple[str, ...], engine: str) -> None:
    """``pd-extproc emulate``'s options: the common ones, then the chosen engine's own."""
    parser.add_argument("--engine", choices=engines, default="vllm",
                        help="the inference engine whose worker to emulate")
    parser.add_argument("--role", choices=ROLES, required=True)
    parser.add_argument("--listen", default="127.0.0.1:0", help="HTTP host:port (port 0 = any free port)")
    parser.add_argument("--side-channel", default="127.0.0.1:0",
                        help="KV side channel host:port: vLLM's NIXL side channel, SGLang's bootstrap server, "
                             "TensorRT-LLM's KV registry (prefill roles)")
    parser.add_argument("--model", default="emulated")
    parser.add_argument("--worker-id", default="")
    parser.add_argument("--tls-cert", default="", help="serve HTTPS with this certificate (PEM)")
    parser.add_argument("--tls-key", default="", help="the certificate's key (PEM)")
    parser.add_argument("--tls-client-ca", default="", help="require client certificates from this CA (mTLS)")
    group = parser.add_argument_group(f"{engine} emulator")
    emulator_class(engine).add_arguments(group)


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


async def run(engine: str, args: argparse.Namespace, listen: Address, side_listen: Address,
              tls: ssl.SSLContext | None = None) -> None:
    """Serve until SIGTERM/SIGINT; print ``ready url=http(s)://HOST:PORT side_channel=N`` once listening."""
    emulator: Emulator = emulator_class(engine).from_args(args)
    port = await emulator.start(listen.host, listen.port, side_listen.port, tls)
    host = f"[{listen.host}]" if ":" in listen.host else listen.host
    scheme = "https" if tls is not None else "http"
    sys.stdout.write(ready.format_line(url=f"{scheme}://{host}:{port}", side_channel=emulator.side_port) + "\n")
    sys.stdout.flush()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await emulator.close()
