"""Paired A/B of our per-request work on the servicer path, between two checkouts of this repository:
``python -m bench.servicer_ab OLD_TREE NEW_TREE [--runs 12]``.

One request is the two ext_proc messages Envoy sends (request headers, then the buffered body), parsed
from bytes, fed to the servicer's ``Process`` and each reply serialised; the prefill leg is a
``FakeTransport`` answering a canned vLLM handoff, so only our own code runs. Two kinds: ``ok`` (a P/D
request to decode's body) and ``refuse`` (an invalid prefill target, refused at the head). Each run is a
fresh process importing one tree's ``extproc`` (PYTHONPATH); its figure is the least thread-CPU µs per
request over 8 batches of 1,000. Runs go A, B, A' in turn, so A' - A is the harness's own noise (A/A)
beside B - A. This file imports only ``extproc`` names both trees have (after the clock's arrival).
"""

from __future__ import annotations

import argparse
import asyncio
import ipaddress
import json
import logging
import statistics
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

from bench.paired_ab import paired, run_in_tree

HANDOFF = {"do_remote_prefill": True, "do_remote_decode": False, "remote_block_ids": [[1]], "remote_engine_id": "e",
           "remote_request_id": "r", "remote_host": "10.0.0.7", "remote_port": 5600, "tp_size": 1}
BODY = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi " * 50}], "max_tokens": 4}).encode()
KINDS = ("ok", "refuse")


def one_run(kind: str, batches: int = 8, per_batch: int = 1000, log: bool = False, process: bool = False) -> float:
    """The least thread-CPU µs per request over ``batches`` (in this process's ``extproc``); ``log``:
    the one info line per request on, as ``serve`` writes it (by the writer thread, into a pipe a
    ``cat`` drains, as into a log collector), else logging off; ``process``: the CPU of every thread
    of the process (the log writer's too), not only the loop's."""
    from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

    from extproc.adapters.vllm_nixl import VllmNixlAdapter
    from extproc.clock import MonotonicClock
    from extproc.envoy.stream import ExtProcServicer
    from extproc.observability.metrics import Metrics
    from extproc.pipeline.admission import Admission
    from extproc.pipeline.background import BackgroundPrefills
    from extproc.pipeline.processor import PdProcessor
    from extproc.plugin import FakeTransport
    from extproc.protocol.transport import ResolvedTarget, WorkerAddress, WorkerReply

    cpu_time = time.process_time if process else time.thread_time
    if log:
        from extproc.observability import logs
        drain = subprocess.Popen(["cat"], stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
        assert drain.stdin is not None
        logs.configure("info", drain.stdin)  # the pipe lives as long as the process
    else:
        logging.disable(logging.CRITICAL)
    loopback = ipaddress.ip_address("127.0.0.1")
    decode = ResolvedTarget(WorkerAddress("127.0.0.1", 8200, loopback), loopback, tls=False)
    reply = WorkerReply(200, "application/json",
                        json.dumps({"id": "x", "choices": [], "kv_transfer_params": HANDOFF}).encode())
    head = pb.ProcessingRequest()
    for key, value in ((":method", "POST"), (":path", "/v1/chat/completions"), ("content-type", "application/json"),
                       ("x-prefiller-host-port", "10.0.0.7:8000" if kind == "ok" else "bad host"),
                       ("x-request-id", "abc-1")):
        head.request_headers.headers.headers.add(key=key, raw_value=value.encode())
    body = pb.ProcessingRequest()
    body.request_body.body, body.request_body.end_of_stream = BODY, True
    head_bytes, body_bytes = head.SerializeToString(), body.SerializeToString()

    async def measure() -> float:
        transport = FakeTransport()
        clock = MonotonicClock()
        processor = PdProcessor(VllmNixlAdapter(), transport, decode_control=FakeTransport(), clock=clock,
                                max_request_bytes=1 << 20, admission=Admission(64), metrics=Metrics(),
                                background=BackgroundPrefills(clock), decode=decode, nonce=lambda: 1)
        servicer = ExtProcServicer(processor)

        async def messages() -> AsyncIterator[pb.ProcessingRequest]:
            yield pb.ProcessingRequest.FromString(head_bytes)
            yield pb.ProcessingRequest.FromString(body_bytes)

        async def request() -> None:
            async for response in servicer.Process(messages(), None):
                response.SerializeToString()

        for _ in range(200):  # warm-up
            transport.answers.append(reply)
            await request()
        best = float("inf")
        for _ in range(batches):
            transport.answers.extend([reply] * per_batch)
            started = cpu_time()
            for _ in range(per_batch):
                await request()
            best = min(best, (cpu_time() - started) / per_batch * 1e6)
        transport.answers.clear()
        return best

    return asyncio.run(measure())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.servicer_ab", description=__doc__.split("\n", 1)[0])
    parser.add_argument("old", type=Path, nargs="?")
    parser.add_argument("new", type=Path, nargs="?")
    parser.add_argument("--runs", type=int, default=12)
    parser.add_argument("--kinds", nargs="+", choices=KINDS, default=list(KINDS))
    parser.add_argument("--log", action="store_true", help="the per-request log line on (to /dev/null)")
    parser.add_argument("--process", action="store_true", help="count every thread's CPU (the log writer's too)")
    parser.add_argument("--one", choices=KINDS, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.one:
        print(f"{one_run(args.one, log=args.log, process=args.process):.3f}")
        return 0
    if args.old is None or args.new is None:
        parser.error("give the two trees")
    for kind in args.kinds:
        flags = (["--log"] if args.log else []) + (["--process"] if args.process else [])
        argv = ["servicer_ab", "--one", kind, *flags]
        result = paired(lambda tree, argv=argv: run_in_tree(__file__, tree, argv), args.old, args.new, args.runs)
        print(f"{kind}: old {statistics.median(result.old):.1f} µs, new {statistics.median(result.new):.1f} µs "
              f"per request; {result.summary()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
