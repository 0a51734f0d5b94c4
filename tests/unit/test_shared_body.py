"""A large body's way to an inspection worker (extproc/pipeline/shared_body.py): through a memory file the
worker inherits, not through the pool's pipe; and through the pipe again when that cannot be done."""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import pickle
from collections.abc import Callable
from concurrent.futures import Executor, Future
from typing import Any

import pytest

from extproc.pipeline import shared_body
from extproc.pipeline.inspector import Inspector
from extproc.protocol.inspection import Rules


def digest(raw: bytes) -> str:
    return hashlib.sha256(raw).hexdigest()


class PicklingExecutor(Executor):
    """What a process pool does to a call (pickled, sent, unpickled, run), in this process: ``sent`` is the
    size of each call as it would go through the pool's pipe."""

    def __init__(self) -> None:
        self.sent: list[int] = []

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future[Any]:
        wire = pickle.dumps((fn, args, kwargs))
        self.sent.append(len(wire))
        call, call_args, call_kwargs = pickle.loads(wire)  # noqa: S301 (our own bytes)
        future: Future[Any] = Future()
        try:
            future.set_result(call(*call_args, **call_kwargs))
        except BaseException as exc:  # what a pool hands back
            future.set_exception(exc)
        return future


def inspector_with(executor: Executor, keep_bytes: int = shared_body.KEEP_BYTES) -> Inspector:
    inspector = Inspector(Rules(64 << 20), inline_max_bytes=0)
    inspector._slots = shared_body.BodySlots(1, keep_bytes)
    inspector._slots.open()
    inspector._pool = executor  # type: ignore[assignment]
    return inspector


def test_a_large_body_reaches_the_worker_whole_without_going_through_the_pipe() -> None:
    async def run() -> None:
        executor = PicklingExecutor()
        inspector = inspector_with(executor)
        for size in (20 << 10, 1 << 20, (1 << 20) + 3, 300, 9 << 20):
            raw = os.urandom(size)
            assert await inspector.check(digest, raw) == digest(raw)  # type: ignore[arg-type,comparison-overlap]
        assert max(executor.sent) < 1024, executor.sent
        inspector.close()

    asyncio.run(run())


def test_a_slot_keeps_a_body_of_up_to_keep_bytes_and_gives_a_larger_ones_pages_back() -> None:
    async def run() -> None:
        slots = shared_body.BodySlots(1, keep_bytes=64 << 10)
        slots.open()
        sizes = []
        for size in (32 << 10, 128 << 10):
            async with slots.lend(os.urandom(size)) as body:
                assert isinstance(body, shared_body.LentBody) and body.length == size
                fd = body.fd
            sizes.append(os.fstat(fd).st_size)
        assert sizes == [32 << 10, 0]
        slots.close()

    asyncio.run(run())


def test_a_real_pool_worker_reads_the_body_from_the_file_it_inherited() -> None:
    """Spawned workers, as the server runs them: the file's descriptor reaches each one at its start."""
    async def run() -> None:
        inspector = Inspector(Rules(64 << 20), workers=2, inline_max_bytes=0)
        try:
            raws = [os.urandom(size) for size in (1 << 20, 3 << 20, 20 << 10, 9 << 20)]
            answers = await asyncio.gather(*(inspector.check(digest, raw) for raw in raws))  # type: ignore[arg-type]
            assert answers == [digest(raw) for raw in raws]
            assert inspector._slots.usable and inspector._slots.lent == len(raws)
        finally:
            inspector.close()

    asyncio.run(run())


def test_a_short_write_is_completed_and_a_failed_one_sends_the_body_through_the_pipe(
        monkeypatch: pytest.MonkeyPatch) -> None:
    real_pwrite = os.pwrite
    calls: list[int] = []

    def short_pwrite(fd: int, data: bytes | memoryview, offset: int) -> int:
        calls.append(offset)
        if len(calls) == 3:
            raise OSError(12, "Cannot allocate memory")
        return real_pwrite(fd, bytes(data)[:1000], offset)

    monkeypatch.setattr(os, "pwrite", short_pwrite)

    async def run() -> None:
        executor = PicklingExecutor()
        inspector = inspector_with(executor)
        raw = os.urandom(2000)
        assert await inspector.check(digest, raw) == digest(raw)  # type: ignore[arg-type,comparison-overlap]
        assert calls == [0, 1000] and executor.sent[0] < 1024  # two writes of 1000 bytes, then lent
        assert await inspector.check(digest, raw) == digest(raw)  # type: ignore[arg-type,comparison-overlap]
        assert executor.sent[1] > 2000 and inspector._slots.usable  # this body through the pipe, the next not
        inspector.close()

    asyncio.run(run())


def test_closing_the_slots_closes_a_lent_file_only_once_its_body_is_done() -> None:
    async def run() -> None:
        slots = shared_body.BodySlots(2)
        slots.open()
        async with slots.lend(b"x" * 100) as body:
            assert isinstance(body, shared_body.LentBody)
            idle = [fd for fd in slots._fds if fd != body.fd]
            assert len(idle) == 1 and _is_memfd(idle[0])
            slots.close()
            assert body.read() == b"x" * 100  # still open: a worker may be reading it
            assert not _is_memfd(idle[0])
        assert not _is_memfd(body.fd)
        async with slots.lend(b"y") as after:
            assert after == b"y"  # closed: nothing is lent any more

    asyncio.run(run())


def _is_memfd(fd: int) -> bool:
    try:
        return os.readlink(f"/proc/self/fd/{fd}").startswith("/memfd:pd-extproc-body-")
    except OSError:
        return False


def test_a_body_a_worker_cannot_read_goes_through_the_pipe_and_so_does_every_later_one(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    def unreadable(self: shared_body.LentBody) -> bytes:
        raise shared_body.Unreadable("permission denied")

    monkeypatch.setattr(shared_body.LentBody, "read", unreadable)

    async def run() -> None:
        executor = PicklingExecutor()
        inspector = inspector_with(executor)
        first, second = os.urandom(1 << 20), os.urandom(1 << 20)
        with caplog.at_level(logging.WARNING, "extproc.inspector"):
            assert await inspector.check(digest, first) == digest(first)  # type: ignore[arg-type,comparison-overlap]
            assert await inspector.check(digest, second) == digest(second)  # type: ignore[arg-type,comparison-overlap]
        small, piped, piped_again = executor.sent
        assert small < 1024 and piped > 1 << 20 and piped_again > 1 << 20
        assert [r.getMessage() for r in caplog.records].count(
            "large bodies go to the inspection pool through its pipe from now on") == 1
        inspector.close()

    asyncio.run(run())


def test_without_memory_files_bodies_go_through_the_pipe(monkeypatch: pytest.MonkeyPatch) -> None:
    def refused(name: str, flags: int = 0) -> int:
        raise OSError(38, "Function not implemented")

    monkeypatch.setattr(os, "memfd_create", refused)

    async def run() -> None:
        executor = PicklingExecutor()
        inspector = inspector_with(executor)
        raw = os.urandom(1 << 20)
        assert await inspector.check(digest, raw) == digest(raw)  # type: ignore[arg-type,comparison-overlap]
        assert executor.sent[0] > 1 << 20
        inspector.close()

    asyncio.run(run())
