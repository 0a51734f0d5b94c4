"""The body's inspection: the same answer inline and in the worker pool, a bounded answer, a pool that
recovers from a dead worker, and the decode worker's name resolved off the event loop."""

from __future__ import annotations

import asyncio
import ipaddress
import os
import subprocess
import sys

import orjson
import pytest

from extproc.clock import FakeClock, MonotonicClock
from extproc.pipeline.inspector import POOL_MAX, Inspector, pool_size
from extproc.protocol.errors import Code, PdError
from extproc.protocol.fields import ReservedField
from extproc.protocol.inspection import KEPT_VALUE_BYTES, Inspected, Refusal, Rules, inspect_answer
from extproc.protocol.openai_request import MAX_MEMBERS, ClientRequest
from extproc.protocol.units import Address
from extproc.upstream.decode_target import DecodeTarget, Unresolvable
from tests.helpers import eventually

CHAT = "/v1/chat/completions"
RULES = Rules(1 << 20, (ReservedField("kv_transfer_params", (None, {})),), frozenset({"kv_transfer_params"}))
PAD = "x" * (20 << 10)  # past the inline limit
BODIES = {
    "ok": {"model": "m", "stream": True, "stream_options": {"include_usage": False},
           "messages": [{"role": "user", "content": PAD}]},
    "reserved": {"kv_transfer_params": {"remote_host": "10.0.0.1"}, "messages": [{"role": "user", "content": PAD}]},
    "steering": {"bootstrap_host": "10.0.0.1", "messages": [{"role": "user", "content": PAD}]},
    "unsupported": {"n": 2, "messages": [{"role": "user", "content": PAD}]},
    "bad field": {"max_tokens": 0, "messages": [{"role": "user", "content": PAD}]},
}


async def both(raw: bytes) -> tuple[ClientRequest | str, ClientRequest | str]:
    """The answer inline and in a worker process (an error as its code and param)."""
    answers: list[ClientRequest | str] = []
    for inline_max in (1 << 30, 0):
        inspector = Inspector(RULES, inline_max_bytes=inline_max)
        try:
            answers.append(await inspector.inspect(CHAT, "application/json", raw))
        except PdError as error:
            answers.append(f"{error.code.value} {error.param}")
        finally:
            inspector.close()
    return answers[0], answers[1]


def test_the_pool_answers_as_the_loop_does() -> None:
    async def run() -> None:
        for name, body in BODIES.items():
            inline, pooled = await both(orjson.dumps(body))
            assert inline == pooled, name
        inline, _ = await both(orjson.dumps(BODIES["ok"]))
        assert isinstance(inline, ClientRequest)
        assert inline.body == {"model": "m", "stream": True, "stream_options": {"include_usage": False}}
        assert [m.name for m in inline.members] == ["model", "stream", "stream_options", "messages"]
        assert inline.unsupported is None and inline.stream

    asyncio.run(run())


def test_large_values_are_checked_but_not_kept() -> None:
    raw = orjson.dumps({"model": "m", "user": "u" * KEPT_VALUE_BYTES, "messages": [{"role": "user", "content": "x"}]})
    answer = inspect_answer(CHAT, "application/json", raw, RULES)
    assert isinstance(answer, Inspected) and set(answer.kept) == {"model", "messages"}  # short messages are kept


def test_a_body_with_too_many_members_is_refused() -> None:
    """The bound that keeps a worker's answer small: at most MAX_MEMBERS top-level members."""
    members = {f"x{index}": 0 for index in range(MAX_MEMBERS - 1)}
    ok = orjson.dumps({**members, "messages": [{"role": "user", "content": "x"}]})
    assert isinstance(inspect_answer(CHAT, "application/json", ok, RULES), Inspected)
    too_many = orjson.dumps({**members, "one_more": 0, "messages": [{"role": "user", "content": "x"}]})
    assert inspect_answer(CHAT, "application/json", too_many, RULES) == Refusal(Code.INVALID_REQUEST_BODY, None,
                                                                                None)


def dying_worker(path: str, content_type: str | None, raw: bytes, rules: Rules) -> Inspected | Refusal:
    os._exit(3)


def test_a_dead_worker_is_an_internal_error_and_the_next_body_gets_a_new_pool() -> None:
    async def run() -> None:
        raw = orjson.dumps(BODIES["ok"])
        inspector = Inspector(RULES, work=dying_worker)
        try:
            with pytest.raises(PdError) as caught:
                await inspector.inspect(CHAT, "application/json", raw)
            assert caught.value.code is Code.INTERNAL_ERROR
            inspector._work = inspect_answer
            assert (await inspector.inspect(CHAT, "application/json", raw)).body["model"] == "m"
        finally:
            inspector.close()

    asyncio.run(run())


def test_refusals_that_need_no_parse_never_reach_a_worker() -> None:
    async def run() -> None:
        inspector = Inspector(Rules(64 << 10), work=dying_worker)
        for path, content_type, raw, code in (
                ("/v1/embeddings", "application/json", b"{" + b" " * (32 << 10) + b"}", Code.UNSUPPORTED_ENDPOINT),
                (CHAT, "application/json", b" " * (65 << 10), Code.REQUEST_TOO_LARGE),
                (CHAT, "text/plain", b" " * (32 << 10), Code.UNSUPPORTED_MEDIA_TYPE)):
            with pytest.raises(PdError) as caught:
                await inspector.inspect(path, content_type, raw)
            assert caught.value.code is code
        assert inspector.offloaded == 0

    asyncio.run(run())


def test_the_decode_name_is_resolved_by_the_loops_resolver_and_again_after_its_ttl() -> None:
    """On the decode target's clock: resolved at start, not again before its TTL, again once it is up."""
    async def run() -> None:
        loop = asyncio.get_running_loop()
        answers = iter(["127.0.0.2", "127.0.0.3"])
        asked: list[str] = []
        refreshed = asyncio.Event()

        async def getaddrinfo(host: str, port: int, **_: object) -> list[tuple[object, ...]]:
            asked.append(host)
            if len(asked) == 2:
                refreshed.set()
            return [(0, 0, 0, "", (next(answers), port))]

        loop.getaddrinfo = getaddrinfo  # type: ignore[method-assign,assignment]
        clock = FakeClock()
        target = DecodeTarget(Address("decode.local", 8200), clock, ttl=30.0)
        with pytest.raises(Unresolvable):
            target.current  # noqa: B018  (a name has no address before start)
        await target.start()
        assert target.current.ip == ipaddress.ip_address("127.0.0.2")
        async with asyncio.timeout(10):  # a hang guard only: the refresh must wait on this clock
            await clock.waiting()
        clock.advance(29.999)
        assert clock.pending == 1 and asked == ["decode.local"], "not again within its TTL"
        clock.advance(0.001)
        await refreshed.wait()
        assert target.current.ip == ipaddress.ip_address("127.0.0.3") and asked == ["decode.local"] * 2
        await target.stop()
        assert clock.pending == 0

    asyncio.run(run())


def test_a_decode_ip_needs_no_resolution() -> None:
    target = DecodeTarget(Address("10.0.0.5", 8200), MonotonicClock())
    assert not target.is_name and target.current.ip == ipaddress.ip_address("10.0.0.5")


def test_the_pool_is_bounded_by_the_cap_the_cpus_and_pool_max(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "sched_getaffinity", lambda _pid: set(range(64)))
    assert pool_size(1024) == POOL_MAX  # a container that sees all of a big node's CPUs
    assert pool_size(1) == 1
    monkeypatch.setattr(os, "sched_getaffinity", lambda _pid: {0, 1})
    assert pool_size(1024, processes=2) == 1


_KILLED_SERVER = """
import asyncio, multiprocessing, os, signal
from extproc.protocol.inspection import Rules
from extproc.pipeline.inspector import Inspector

async def main() -> None:
    inspector = Inspector(Rules(1 << 20), inline_max_bytes=0)
    await inspector.inspect("/v1/chat/completions", "application/json", b'{"messages": [{"role": "user"}]}')
    print(" ".join(str(child.pid) for child in multiprocessing.active_children()), flush=True)
    os.kill(os.getpid(), signal.SIGKILL)

asyncio.run(main())
"""


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split(") ", 1)[1][0] != "Z"
    except FileNotFoundError:
        return False


def test_a_pool_worker_exits_when_its_server_is_killed() -> None:
    """SIGKILL gives the server no chance to stop its pool: the workers notice their parent is gone and
    exit, instead of living on as orphans that hold memory and the server's stdout (a test harness
    reading that stdout never saw its end)."""
    server = subprocess.run([sys.executable, "-c", _KILLED_SERVER], capture_output=True, text=True, timeout=120,
                            check=False)
    assert server.returncode == -9, server.stderr
    workers = [int(pid) for pid in server.stdout.split() if pid.isdigit()]
    assert workers, server.stdout
    assert eventually(lambda: not any(_running(pid) for pid in workers), within=30), workers


def test_the_stream_flags_are_kept_when_the_client_pads_stream_options() -> None:
    """Large values are not sent back from a worker, but an adapter reads stream_options.include_usage
    (trtllm's usage chunk): a padded stream_options keeps its flags, inline and in the pool alike."""
    body = {"messages": [{"role": "user", "content": PAD}], "stream": True,
            "stream_options": {"include_usage": True, "padding": "x" * (2 * KEPT_VALUE_BYTES)}}
    inline, pooled = asyncio.run(both(orjson.dumps(body)))
    assert isinstance(inline, ClientRequest) and isinstance(pooled, ClientRequest)
    assert inline.body["stream_options"] == pooled.body["stream_options"] == {"include_usage": True}
