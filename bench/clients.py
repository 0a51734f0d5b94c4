"""Prefill HTTP client candidates, priced alone (a side experiment; docs/decisions.md records it).

One cheap prefill worker (bench/cheap_worker.py), one client process on uvloop sending sequential
POSTs of the benchmark's prefill-sized body on one keep-alive connection; per candidate and round,
REQUESTS requests, timed one by one, and the client process's CPU over them. Rounds are interleaved.

    aiohttp      extproc.upstream.client.WorkerClient as the server uses it (every bound and cap on)
    pyreqwest    pyreqwest's async Client (Rust reqwest/hyper), body read whole, no cap
    httptools    an asyncio Protocol with httptools' response parser (llhttp), one pooled connection
    protocol     an asyncio Protocol with a parser written here (status line, headers, Content-Length)

pyreqwest and httptools are not project dependencies: run it with a Python that has them, e.g.
``python3 -m venv /tmp/clv && /tmp/clv/bin/pip install -c constraints.txt -e . httptools==0.9.0
pyreqwest==0.15.1`` then ``/tmp/clv/bin/python -m bench.clients``. A candidate whose package is
missing is skipped. The numbers are bounds on what the client costs, not on what the others lack:
only aiohttp's row carries our deadline, gap timeouts and size cap.
"""

from __future__ import annotations

import argparse
import asyncio
import ipaddress
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import uvloop

from bench.workers import CheapWorker
from bench.workload import CHAT_PATH, chat_body
from extproc.clock import MonotonicClock
from extproc.protocol.prefill_policy import PrefillPolicy
from extproc.protocol.transport import ResolvedTarget, WorkerAddress
from extproc.upstream.client import WorkerClient, WorkerLimits

Post = Callable[[], Awaitable[bytes]]
HEADERS = [("content-type", "application/json"), ("accept", "application/json")]


async def _aiohttp(host: str, port: int, body: bytes) -> tuple[Post, Callable[[], Awaitable[None]]]:
    client = WorkerClient(WorkerLimits(5, 30, 60, 1 << 20, 1024), PrefillPolicy((), allow_loopback=True),
                          clock=MonotonicClock())
    ip = ipaddress.ip_address(host)
    target = ResolvedTarget(WorkerAddress(host, port, ip), ip, tls=False)

    async def post() -> bytes:
        return (await client.post(target, CHAT_PATH, HEADERS, body)).body

    return post, client.aclose


async def _pyreqwest(host: str, port: int, body: bytes) -> tuple[Post, Callable[[], Awaitable[None]]]:
    from pyreqwest.client import ClientBuilder

    client = ClientBuilder().follow_redirects(False).no_proxy().gzip(False).build()
    url = f"http://{host}:{port}{CHAT_PATH}"

    async def post() -> bytes:
        response = await client.post(url).headers(dict(HEADERS)).body_bytes(body).build().send()
        return bytes(await response.bytes())

    return post, client.close


class _Exchange(asyncio.Protocol):
    """One keep-alive connection; one request at a time; ``parse`` feeds bytes to a parser."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.done: asyncio.Future[bytes] | None = None
        self.buffer = bytearray()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    async def request(self, data: bytes) -> bytes:
        assert self.transport is not None
        self.done = asyncio.get_running_loop().create_future()
        self.transport.write(data)
        return await self.done


class _HttptoolsExchange(_Exchange):
    def __init__(self) -> None:
        super().__init__()
        import httptools

        self.parser = httptools.HttpResponseParser(self)
        self.chunks: list[bytes] = []

    def on_body(self, chunk: bytes) -> None:
        self.chunks.append(chunk)

    def on_message_complete(self) -> None:
        if self.done is not None:
            self.done.set_result(b"".join(self.chunks))
            self.chunks = []

    def data_received(self, data: bytes) -> None:
        self.parser.feed_data(data)


class _OwnExchange(_Exchange):
    def data_received(self, data: bytes) -> None:
        buffer = self.buffer
        buffer += data
        end = buffer.find(b"\r\n\r\n")
        if end < 0:
            return
        head = bytes(buffer[:end]).lower()
        at = head.find(b"\r\ncontent-length:")
        line_end = head.find(b"\r\n", at + 2)
        length = int(head[at + 17:line_end if line_end >= 0 else None])
        if len(buffer) < end + 4 + length:
            return
        payload = bytes(buffer[end + 4:end + 4 + length])
        del buffer[:end + 4 + length]
        if self.done is not None:
            self.done.set_result(payload)


async def _protocol(kind: type[_Exchange], host: str, port: int,
                    body: bytes) -> tuple[Post, Callable[[], Awaitable[None]]]:
    loop = asyncio.get_running_loop()
    _, exchange = await loop.create_connection(kind, host, port)
    head = (f"POST {CHAT_PATH} HTTP/1.1\r\nhost: {host}:{port}\r\n"
            + "".join(f"{k}: {v}\r\n" for k, v in HEADERS) + f"content-length: {len(body)}\r\n\r\n").encode()

    async def post() -> bytes:
        return await exchange.request(head + body)

    async def close() -> None:
        if exchange.transport is not None:
            exchange.transport.close()

    return post, close


async def _httptools(host: str, port: int, body: bytes) -> tuple[Post, Callable[[], Awaitable[None]]]:
    return await _protocol(_HttptoolsExchange, host, port, body)


async def _own(host: str, port: int, body: bytes) -> tuple[Post, Callable[[], Awaitable[None]]]:
    return await _protocol(_OwnExchange, host, port, body)


CANDIDATES = {"aiohttp": _aiohttp, "pyreqwest": _pyreqwest, "httptools": _httptools, "protocol": _own}


async def _round(name: str, host: str, port: int, body: bytes, requests: int) -> tuple[float, float]:
    post, close = await CANDIDATES[name](host, port, body)
    try:
        for _ in range(50):  # warm the connection and the code
            await post()
        latencies = []
        cpu = time.process_time()
        for _ in range(requests):
            started = time.perf_counter()
            answer = await post()
            latencies.append(time.perf_counter() - started)
            assert b"kv_transfer_params" in answer
        cpu = time.process_time() - cpu
    finally:
        await close()
    return statistics.median(latencies) * 1e6, cpu / requests * 1e6


def _available(name: str) -> bool:
    module = {"pyreqwest": "pyreqwest", "httptools": "httptools"}.get(name)
    if module is None:
        return True
    try:
        __import__(module)
    except ImportError:
        return False
    return True


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.clients", description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--requests", type=int, default=2000)
    args = parser.parse_args(argv)
    names = [name for name in CANDIDATES if _available(name)]
    worker = CheapWorker("vllm", "prefill", Path(tempfile.mkdtemp(prefix="pd-bench-clients-")), "cheap-prefill")
    worker.start()
    try:
        worker.wait_ready(30)
        host, port = worker.address.rsplit(":", 1)
        # the prefill leg's body: the client's body plus the producer kv_transfer_params
        body = chat_body(stream=False)[:-1] + (b',"kv_transfer_params":{"do_remote_decode":true,'
                                               b'"do_remote_prefill":false},"stream":false}')
        results: dict[str, list[tuple[float, float]]] = {name: [] for name in names}
        for round_number in range(args.rounds):
            for name in names[round_number % len(names):] + names[:round_number % len(names)]:
                results[name].append(uvloop.run(_round(name, host, int(port), body, args.requests)))
    finally:
        worker.stop()
    print("| client | p50 µs per POST | client CPU µs per POST |")
    print("|---|---|---|")
    for name in names:
        print(f"| {name} | {statistics.median(r[0] for r in results[name]):.0f} | "
              f"{statistics.median(r[1] for r in results[name]):.0f} |")
    print(f"\n(medians over {args.rounds} interleaved rounds of {args.requests} sequential POSTs, uvloop)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
