"""Per-stage CPU of our server on a P/D request, measured in-process: ``python -m bench.stages``.

Our real servicer, processor, adapter and prefill client, built from Settings as ``pd-extproc serve``
builds them, driven without gRPC: each request is the two ext_proc messages Envoy sends (request headers,
then the buffered body), parsed from bytes and fed to the servicer's ``Process``; every reply is
serialised as grpc would. The prefill leg is real too: HTTP/1.1 over loopback to a cheap vLLM-shaped
prefill worker (bench/cheap_worker.py) in another process, so its CPU is not ours.

Requests run one at a time, so the thread's CPU clock (CLOCK_THREAD_CPUTIME_ID) around a stage is that
stage's CPU, awaits included (while the prefill leg waits, the event loop serving its socket runs on this
thread and nothing else does). Stages are timed by wrapping the functions that make them (patched for
the run, restored after); a stage's time excludes the stages nested in it, and "stream loop and glue"
is the request's total minus every stage: the servicer loop, the awaits, the records. Tracing is off
(the default): it costs one ``is None`` test per step, which lands in the glue.

What is not here: grpc.aio's own cost (HTTP/2, the C core, waking the loop per message), which the
floor-aio row of ``make bench`` measures, and everything outside the process.

``bench.stages.measure(url, ...)`` is what ``make bench`` calls with the fleet's cheap prefill worker.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import functools
import inspect
import logging
import os
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import uvloop
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from bench.workload import CHAT_PATH, chat_body
from extproc.app import ExtProcServer
from extproc.config import load_settings
from extproc.envoy import messages as envoy_messages
from extproc.envoy.stream import ExtProcServicer
from extproc.observability import logs
from extproc.observability.metrics import Metrics
from extproc.pipeline import inspector as body_inspector
from extproc.pipeline import processor
from extproc.pipeline.admission import Admission
from extproc.protocol.prefill_target import HEADER as PREFILL_TARGET_HEADER
from extproc.protocol.units import parse_address
from extproc.upstream.client import WorkerClient

# Stage names, in a request's order. "protobuf parse" and "protobuf serialise" are grpc's work on our
# messages (FromString / SerializeToString), done here explicitly.
STAGES = ("protobuf parse", "header step", "body parse", "admission", "plan", "prefill leg", "handoff check",
          "rewrite", "protobuf reply", "protobuf serialise", "log line", "metrics", "stream loop and glue")
GLUE = "stream loop and glue"
WARMUP = 300


@dataclasses.dataclass
class StageClock:
    """Exclusive CPU and wall time per stage: a nested stage's time is taken out of its parent's."""

    cpu_ns: dict[str, int] = dataclasses.field(default_factory=lambda: dict.fromkeys(STAGES, 0))
    wall_ns: dict[str, int] = dataclasses.field(default_factory=lambda: dict.fromkeys(STAGES, 0))
    calls: dict[str, int] = dataclasses.field(default_factory=lambda: dict.fromkeys(STAGES, 0))
    _stack: list[list[Any]] = dataclasses.field(default_factory=list)  # [stage, child cpu, child wall]

    def enter(self, stage: str) -> tuple[int, int]:
        self._stack.append([stage, 0, 0])
        return time.thread_time_ns(), time.perf_counter_ns()

    def leave(self, started: tuple[int, int]) -> None:
        cpu, wall = time.thread_time_ns() - started[0], time.perf_counter_ns() - started[1]
        stage, child_cpu, child_wall = self._stack.pop()
        self.cpu_ns[stage] += cpu - child_cpu
        self.wall_ns[stage] += wall - child_wall
        self.calls[stage] += 1
        if self._stack:
            self._stack[-1][1] += cpu
            self._stack[-1][2] += wall

    @contextlib.contextmanager
    def stage(self, name: str) -> Iterator[None]:
        started = self.enter(name)
        try:
            yield
        finally:
            self.leave(started)

    def reset(self) -> None:
        for table in (self.cpu_ns, self.wall_ns, self.calls):
            for key in table:
                table[key] = 0


def _timed(clock: StageClock, stage: str, function: Callable[..., Any]) -> Callable[..., Any]:
    if inspect.iscoroutinefunction(function):
        @functools.wraps(function)
        async def timed_async(*args: Any, **kwargs: Any) -> Any:
            started = clock.enter(stage)
            try:
                return await function(*args, **kwargs)
            finally:
                clock.leave(started)
        return timed_async

    @functools.wraps(function)
    def timed(*args: Any, **kwargs: Any) -> Any:
        started = clock.enter(stage)
        try:
            return function(*args, **kwargs)
        finally:
            clock.leave(started)
    return timed


@contextlib.contextmanager
def _patched(clock: StageClock, targets: list[tuple[object, str, str]]) -> Iterator[None]:
    """Wrap ``owner.attribute`` in its stage's clock for the duration; restore the originals after."""
    saved = []
    try:
        for owner, attribute, stage in targets:
            if not hasattr(owner, attribute):  # an older or newer layout of the code: not that stage's
                continue
            # An instance's method (a logger's info) lives on its class: restored by removing the wrapper,
            # never by setting the class's plain function on the instance.
            inherited = not isinstance(owner, type) and not inspect.ismodule(owner) and attribute not in vars(owner)
            saved.append((owner, attribute, None if inherited else inspect.getattr_static(owner, attribute)))
            setattr(owner, attribute, _timed(clock, stage, getattr(owner, attribute)))
        yield
    finally:
        for owner, attribute, original in reversed(saved):
            if original is None:
                delattr(owner, attribute)
            else:
                setattr(owner, attribute, original)


def _stage_targets(server: Any) -> list[tuple[object, str, str]]:
    adapter = server.processor._adapter
    adapter_type, adapter_module = type(adapter), sys.modules[type(adapter).__module__]
    targets: list[tuple[object, str, str]] = [
        (envoy_messages, "head_from_headers", "header step"),
        (processor.PdProcessor, "on_headers", "header step"),
        (processor, "parse_client_request", "body parse"),  # before the inspector
        (processor, "refuse_reserved", "body parse"),
        (body_inspector, "inspect", "body parse"),  # a small body's inspection, on the loop
        (Admission, "check", "admission"),
        (Admission, "enter", "admission"),
        (Admission, "leave", "admission"),
        (processor.PdProcessor, "_plan_input", "plan"),
        (WorkerClient, "post", "prefill leg"),
        (adapter_type, "decide", "handoff check"),
        (envoy_messages, "continue_headers", "protobuf reply"),
        (envoy_messages, "reply", "protobuf reply"),  # the pipeline's decision into the reply below
        (envoy_messages, "encode_body_reply", "protobuf reply"),
        (envoy_messages, "immediate", "protobuf reply"),
        (Metrics, "finish", "metrics"),
        (type(server.metrics.inflight), "inc", "metrics"),
        (type(server.metrics.inflight), "dec", "metrics"),
        (processor.log, "info", "log line"),
        (logs, "info", "log line"),
    ]
    for name, stage in (("prefill_body", "plan"), ("plan", "plan"), ("decode_body", "rewrite")):
        owner = adapter_module if name == "decode_body" else adapter_type
        if hasattr(owner, name):
            targets.append((owner, name, stage))
    return targets


def _messages(prefill: str, stream: bool) -> tuple[bytes, bytes]:
    """The two ext_proc messages Envoy sends for one P/D request, as bytes on the wire."""
    body = chat_body(stream)
    headers = [(":authority", "127.0.0.1:8000"), (":path", CHAT_PATH), (":method", "POST"), (":scheme", "http"),
               ("content-type", "application/json"), ("content-length", str(len(body))),
               ("x-forwarded-proto", "http"), ("x-request-id", "6f1c7d0e-8a41-4b4e-9c1f-2b7d3e5a9c10"),
               (PREFILL_TARGET_HEADER, prefill)]
    head = pb.ProcessingRequest(request_headers=pb.HttpHeaders(headers=base_pb2.HeaderMap(headers=[
        base_pb2.HeaderValue(key=key, raw_value=value.encode()) for key, value in headers])))
    return head.SerializeToString(), pb.ProcessingRequest(
        request_body=pb.HttpBody(body=body, end_of_stream=True)).SerializeToString()


async def _one(servicer: Any, clock: StageClock, wire: tuple[bytes, bytes]) -> list[envoy_messages.Response]:
    async def requests() -> AsyncIterator[pb.ProcessingRequest]:
        for raw in wire:
            with clock.stage("protobuf parse"):
                message = pb.ProcessingRequest.FromString(raw)
            yield message

    replies = []
    async for reply in servicer.Process(requests(), None):
        with clock.stage("protobuf serialise"):
            reply.SerializeToString()
        replies.append(reply)
    return replies


@dataclasses.dataclass
class StageResult:
    requests: int
    adapter: str
    stream: bool
    total_cpu_us: float  # per request
    total_wall_us: float
    cpu_us: dict[str, float]  # per request, by stage
    wall_us: dict[str, float]
    calls: dict[str, float]  # per request
    repeats: list[float]  # total CPU µs per request of each repeat (the median one is reported)
    instrumentation_us: float = 0.0  # per request: the timed calls' own cost, inside these figures


async def _measure(prefill_url: str, requests: int, adapter: str, stream: bool, repeats: int) -> StageResult:
    address = prefill_url.split("://", 1)[1]
    with tempfile.TemporaryDirectory(prefix="pd-stages-") as scratch:
        settings = load_settings({
            "PD_EXTPROC_ADAPTER": adapter, "PD_EXTPROC_PREFILL_ALLOW": f"127.0.0.1/32:{address.rsplit(':', 1)[1]}",
            "PD_EXTPROC_METRICS_LISTEN": "127.0.0.1:0"}, {})
        settings = dataclasses.replace(settings, grpc_listen=parse_address(f"unix:{Path(scratch) / 'x.sock'}",
                                                                           allow_unix=True))
        server = ExtProcServer(settings)  # built, never started: nothing listens
        servicer = ExtProcServicer(server.processor)
        clock = StageClock()
        wire = _messages(address, stream)
        try:
            with _patched(clock, _stage_targets(server)):
                for _ in range(WARMUP):  # the pooled connection, caches, the allocator
                    await _check(await _one(servicer, clock, wire))
                runs = []
                for _ in range(repeats):
                    clock.reset()
                    cpu0, wall0 = time.thread_time_ns(), time.perf_counter_ns()
                    for _ in range(requests):
                        await _one(servicer, clock, wire)
                    cpu, wall = time.thread_time_ns() - cpu0, time.perf_counter_ns() - wall0
                    runs.append((cpu, wall, dataclasses.replace(clock, cpu_ns=dict(clock.cpu_ns),
                                                                wall_ns=dict(clock.wall_ns), calls=dict(clock.calls))))
        finally:
            await server.prefill_client.aclose()
            await server.decode_control.aclose()
    runs.sort(key=lambda run: run[0])
    cpu, wall, chosen = runs[len(runs) // 2]
    per = 1e3 * requests
    cpu_us = {stage: chosen.cpu_ns[stage] / per for stage in STAGES}
    wall_us = {stage: chosen.wall_ns[stage] / per for stage in STAGES}
    cpu_us[GLUE] = cpu / per - sum(v for k, v in cpu_us.items() if k != GLUE)
    wall_us[GLUE] = wall / per - sum(v for k, v in wall_us.items() if k != GLUE)
    calls = {stage: chosen.calls[stage] / requests for stage in STAGES}
    return StageResult(requests, adapter, stream, cpu / per, wall / per, cpu_us, wall_us, calls,
                       [run[0] / per for run in runs], _instrumentation_cost() * sum(calls.values()))


def _instrumentation_cost(samples: int = 20000) -> float:
    """CPU µs one timed call adds (a wrapped call of nothing inside a stage, minus the bare call)."""
    clock = StageClock()

    def nothing() -> None:
        return None

    timed = _timed(clock, GLUE, nothing)
    best = float("inf")
    for _ in range(5):
        started = time.thread_time_ns()
        for _ in range(samples):
            timed()
        wrapped = time.thread_time_ns() - started
        started = time.thread_time_ns()
        for _ in range(samples):
            nothing()
        best = min(best, (wrapped - (time.thread_time_ns() - started)) / samples / 1e3)
    return best


async def _check(replies: list[envoy_messages.Response]) -> None:
    """The run is only meaningful if every request took the P/D path: continue, then the rewritten body."""
    if len(replies) != 2 or not isinstance(replies[1], envoy_messages.EncodedResponse):
        raise RuntimeError(f"not a P/D reply: {replies[-1] if replies else 'no reply'}")


@contextlib.contextmanager
def _server_logging() -> Iterator[None]:
    """Our JSON log line as the server writes it, to /dev/null instead of stderr."""
    root = logging.getLogger()
    saved = root.handlers[:], root.level
    with open(os.devnull, "w") as sink:
        logs.configure("info", sink)
        try:
            yield
        finally:
            logs.stop()
            root.handlers[:], level = saved
            root.setLevel(level)


def measure(prefill_url: str, requests: int = 2000, adapter: str = "vllm_nixl", stream: bool = False,
            repeats: int = 5) -> StageResult:
    """Per-stage CPU per request against the prefill worker at ``prefill_url`` (a cheap vLLM-shaped one);
    ``repeats`` runs of ``requests``, the run with the median total reported."""
    with _server_logging(), asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(_measure(prefill_url, requests, adapter, stream, repeats))


def table(result: StageResult) -> list[list[str]]:
    rows = [[stage, f"{result.cpu_us[stage]:.1f}", f"{result.cpu_us[stage] / result.total_cpu_us:.0%}",
             f"{result.wall_us[stage]:.1f}", f"{result.calls[stage]:g}" if stage != GLUE else "-"]
            for stage in STAGES]
    rows.append(["total", f"{result.total_cpu_us:.1f}", "100%", f"{result.total_wall_us:.1f}", "-"])
    return rows


def render(result: StageResult) -> str:
    head = ["stage", "CPU µs/request", "share", "wall µs/request", "calls/request"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(row) + " |" for row in table(result)]
    spread = ", ".join(f"{value:.0f}" for value in result.repeats)
    return "\n".join(lines) + (f"\n\n{result.requests} sequential {'streaming' if result.stream else 'non-streaming'} "
                               f"P/D requests per run, {result.adapter} adapter; total CPU µs/request of each run: "
                               f"{spread} (the median run is shown). The timing itself costs about "
                               f"{result.instrumentation_us:.0f} µs/request, spread over the stages and the glue.")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.stages", description=__doc__.split("\n", 1)[0])
    parser.add_argument("--requests", type=int, default=2000, help="requests per run")
    parser.add_argument("--repeats", type=int, default=5, help="runs; the median one is reported")
    parser.add_argument("--stream", action="store_true", help="streaming requests")
    parser.add_argument("--prefill-url", help="an existing cheap vLLM-shaped prefill worker (default: start one)")
    parser.add_argument("--json", type=Path, help="also write the result here")
    args = parser.parse_args(argv)
    with contextlib.ExitStack() as stack:
        url = args.prefill_url or stack.enter_context(_cheap_prefill())
        result = measure(url, args.requests, stream=args.stream, repeats=args.repeats)
    print(render(result))
    if args.json:
        args.json.write_text(json_dumps(dataclasses.asdict(result)))
    return 0


def json_dumps(value: object) -> str:
    import orjson
    return orjson.dumps(value, option=orjson.OPT_INDENT_2).decode()


@contextlib.contextmanager
def _cheap_prefill() -> Iterator[str]:
    from bench.workers import CheapWorker
    with tempfile.TemporaryDirectory(prefix="pd-stages-worker-") as logs_dir:
        worker = CheapWorker("vllm", "prefill", Path(logs_dir), "stages-prefill")
        worker.start()
        try:
            worker.wait_ready(30)
            yield worker.url
        finally:
            worker.stop()


if __name__ == "__main__":
    sys.exit(main())
