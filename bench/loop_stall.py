"""One worst-shaped body against everything else on the server's event loop.

    .venv/bin/python -m bench.loop_stall [--size-mib 32] [--small 4]

The worst shape for the body's inspection is a valid chat request of tiny content parts
(``{"type":"text","text":"x"}``, 1.2 million of them in 32 MiB): the parse and the member scan cost per
object, not per byte. Part 1 times the inspection of such bodies inline (what holds the loop when it runs
there). Part 2 runs the real server (grpc.aio, the emulated vLLM prefill worker and the small requests'
client in this process; the big body's client in another) and sends ``--small`` concurrent streams of
small P/D requests while one worst-shaped body is inspected, once
per place the inspection can run: on the loop (as before), in a thread, in the worker-process pool (now).
It reports the small requests' p50/p99 before and during the big one and the loop's largest lag.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import sys
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import orjson
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc

from extproc.app import ExtProcServer
from extproc.config import load_settings
from extproc.pipeline.inspector import Inspector
from extproc.protocol.inspection import Rules, inspect
from pd_extproc_lab.emulator.vllm import VllmEmulator

CHAT = "/v1/chat/completions"
_PART = b'{"type":"text","text":"x"}'


def worst_shape_chat(size: int, extra: bytes = b"") -> bytes:
    """A valid chat request of about ``size`` bytes made of tiny content parts; ``extra`` is inserted as
    top-level members (e.g. b'"kv_transfer_params":{"x":1},')."""
    head = b'{' + extra + b'"model":"m","max_tokens":1,"messages":[{"role":"user","content":['
    tail = b"]}]}"
    count = max(1, (size - len(head) - len(tail) + 1) // (len(_PART) + 1))
    return head + b",".join([_PART] * count) + tail


def realistic_chat(size: int) -> bytes:
    text = ("lorem ipsum dolor sit amet " * (size // 27 + 1))[:size - 80]
    return orjson.dumps({"model": "m", "max_tokens": 1, "messages": [{"role": "user", "content": text}]})


def inline_ms(raw: bytes) -> float:
    started = time.perf_counter()
    inspect(CHAT, "application/json", raw, Rules(64 << 20))
    return (time.perf_counter() - started) * 1e3


def _headers(target: str) -> pb.ProcessingRequest:
    request = pb.ProcessingRequest()
    for key, value in {":method": "POST", ":path": CHAT, "content-type": "application/json",
                       "x-prefiller-host-port": target}.items():
        request.request_headers.headers.headers.append(base_pb2.HeaderValue(key=key, raw_value=value.encode()))
    return request


def _body(raw: bytes) -> pb.ProcessingRequest:
    request = pb.ProcessingRequest()
    request.request_body.body = raw
    request.request_body.end_of_stream = True
    return request


async def _exchange(stub: Any, target: str, raw: bytes) -> list[pb.ProcessingResponse]:
    async def messages() -> AsyncIterator[pb.ProcessingRequest]:
        yield _headers(target)
        yield _body(raw)

    return [response async for response in stub.Process(messages())]


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


async def _lag_probe(stop: asyncio.Event, lags: list[float], tick: float = 0.005) -> None:
    loop = asyncio.get_running_loop()
    while not stop.is_set():
        expected = loop.time() + tick
        await asyncio.sleep(tick)
        lags.append(max(0.0, loop.time() - expected))


async def _small_load(stub: Any, target: str, stop: asyncio.Event, latencies: list[float]) -> None:
    raw = orjson.dumps({"model": "m", "max_tokens": 1, "messages": [{"role": "user", "content": "hello"}]})
    while not stop.is_set():
        started = time.perf_counter()
        responses = await _exchange(stub, target, raw)
        assert responses[-1].WhichOneof("response") == "request_body", responses[-1]
        latencies.append((time.perf_counter() - started) * 1e3)


Variant = Callable[[ExtProcServer], None]


def on_the_loop(server: ExtProcServer) -> None:
    old = server.processor.inspector
    server.processor.inspector = Inspector(old._rules, inline_max_bytes=1 << 62)


def in_a_thread(server: ExtProcServer) -> None:
    server.processor.inspector._pool = ThreadPoolExecutor(1)  # type: ignore[assignment]


def in_the_pool(server: ExtProcServer) -> None:
    pass


async def send_big(address: str, target: str, size_mib: int) -> None:
    """One worst-shape body, refused after the whole inspection (a reserved field): no prefill leg runs.
    Says "ready" once built and connected, sends on a line from stdin, then prints the answer and its ms."""
    import grpc

    big = worst_shape_chat(size_mib << 20, b'"kv_transfer_params":{"x":1},')
    async with grpc.aio.insecure_channel(address, options=[("grpc.max_receive_message_length", 128 << 20)]) as channel:
        await channel.channel_ready()
        print("ready", flush=True)
        await asyncio.to_thread(sys.stdin.readline)
        started = time.perf_counter()
        responses = await _exchange(pb_grpc.ExternalProcessorStub(channel), target, big)
    print(responses[-1].WhichOneof("response"), (time.perf_counter() - started) * 1e3, flush=True)


async def measure(variant: Variant, size_mib: int, small_streams: int, baseline_seconds: float) -> dict[str, float]:
    prefill = VllmEmulator("prefill", "m", "prefill", "127.0.0.1", 16, 30.0)
    port = await prefill.start("127.0.0.1", 0, 0)
    target = f"127.0.0.1:{port}"
    settings = load_settings({"PD_EXTPROC_GRPC_LISTEN": "127.0.0.1:0", "PD_EXTPROC_METRICS_LISTEN": "127.0.0.1:0",
                              "PD_EXTPROC_PREFILL_ALLOW": "127.0.0.0/8:*"}, {})
    server = ExtProcServer(settings)
    variant(server)
    await server.start()
    import grpc

    channel = grpc.aio.insecure_channel(server.address, options=[("grpc.max_send_message_length", 128 << 20),
                                                                 ("grpc.max_receive_message_length", 128 << 20)])
    stub = pb_grpc.ExternalProcessorStub(channel)
    try:
        # Warm the pool (its processes start on the first large body) with a refused medium body.
        await _exchange(stub, target, worst_shape_chat(64 << 10, b'"kv_transfer_params":{"x":1},'))
        result: dict[str, float] = {}
        # The big body's sender: another process (building and sending 32 MiB is not the server's work).
        sender = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "bench.loop_stall", "--send-big", server.address, target,
            "--size-mib", str(size_mib), stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE)
        assert sender.stdin is not None and sender.stdout is not None
        assert (await sender.stdout.readline()).strip() == b"ready"
        for phase in ("before", "during"):
            stop, lags, latencies = asyncio.Event(), [], []  # type: ignore[var-annotated]
            tasks = [asyncio.create_task(_small_load(stub, target, stop, latencies)) for _ in range(small_streams)]
            probe = asyncio.create_task(_lag_probe(stop, lags))
            if phase == "before":
                await asyncio.sleep(baseline_seconds)
            else:
                sender.stdin.write(b"go\n")
                answer, _ = await sender.communicate()
                kind, big_ms = answer.split()
                assert kind == b"immediate_response", answer
                result["big_ms"] = float(big_ms)
            stop.set()
            await asyncio.gather(*tasks, probe)
            result[f"{phase}_p50"] = _percentile(latencies, 0.5)
            result[f"{phase}_p99"] = _percentile(latencies, 0.99)
            result[f"{phase}_count"] = len(latencies)
            result[f"{phase}_max_lag"] = max(lags, default=0.0) * 1e3
        return result
    finally:
        await channel.close()
        await server.grpc.stop(0)
        await server.prefill_client.aclose()
        await server.decode_control.aclose()
        await server.http.close()
        server.processor.inspector.close()
        with contextlib.suppress(Exception):
            await prefill.close()


VARIANTS: tuple[tuple[str, Variant], ...] = (("on the loop (before)", on_the_loop), ("in a thread", in_a_thread),
                                             ("in the process pool (now)", in_the_pool))


def run_all(size_mib: int = 32, small_streams: int = 4, baseline_seconds: float = 3.0) -> dict[str, Any]:
    """Both parts, JSON-ready (bench/run.py keeps it in results.json; ``render`` makes the tables)."""
    inline = [{"body": "worst shape", "size_mib": mib, "ms": inline_ms(worst_shape_chat(mib << 20))}
              for mib in sorted({1, 8, size_mib})]
    inline.append({"body": "realistic (one long string)", "size_mib": size_mib,
                   "ms": inline_ms(realistic_chat(size_mib << 20))})
    variants = [{"name": name, **asyncio.run(measure(variant, size_mib, small_streams, baseline_seconds))}
                for name, variant in VARIANTS]
    return {"size_mib": size_mib, "small_streams": small_streams, "inline": inline, "variants": variants}


def render(result: dict[str, Any]) -> list[str]:
    size = result["size_mib"]
    lines = ["| body | size | inspection on the loop (ms) |", "|---|---|---|"]
    lines += [f"| {row['body']} | {row['size_mib']} MiB | {row['ms']:.0f} |" for row in result["inline"]]
    lines += ["", f"{result['small_streams']} streams of small P/D requests (in-process client) while one worst-shape "
              f"{size} MiB body, sent by another process, is inspected and refused (a reserved field: no leg runs):",
              "", "| inspection runs | big body answered (ms) | small p50 / p99 before (ms) "
              "| small p50 / p99 during (ms) | p99 added (ms) | small requests during | largest loop lag during (ms) |",
              "|---|---|---|---|---|---|---|"]
    for r in result["variants"]:
        lines.append(f"| {r['name']} | {r['big_ms']:.0f} | {r['before_p50']:.1f} / {r['before_p99']:.1f} | "
                     f"{r['during_p50']:.1f} / {r['during_p99']:.1f} | {r['during_p99'] - r['before_p99']:.0f} | "
                     f"{r['during_count']:.0f} | {r['during_max_lag']:.0f} |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.loop_stall", description=__doc__)
    parser.add_argument("--size-mib", type=int, default=32)
    parser.add_argument("--small", type=int, default=4, help="concurrent streams of small P/D requests")
    parser.add_argument("--baseline-seconds", type=float, default=3.0)
    parser.add_argument("--send-big", nargs=2, metavar=("SERVER", "PREFILL"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.send_big:
        asyncio.run(send_big(*args.send_big, args.size_mib))
        return
    print("\n".join(render(run_all(args.size_mib, args.small, args.baseline_seconds))))


if __name__ == "__main__":
    main()
