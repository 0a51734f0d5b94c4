"""Where the client's body is inspected: on the event loop when it is small, in a pool of worker
processes when it is large. What a large body then costs the loop (health checks, other streams) is
copying its bytes to a worker, the same for any shape; its parse costs a worker.

A thread would not do: orjson and the member scanner hold the GIL for the whole parse (a 32 MiB body of
1.2 million tiny content parts takes seconds). docs/decisions.md has the measurements. The pool's
processes start on the first large body and are spawned (not forked: the server runs gRPC threads).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import multiprocessing
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import TypeVar

from extproc.malloc import keep_large_blocks
from extproc.pipeline.shared_body import BodySlots, Unreadable, with_body
from extproc.protocol.errors import Code, PdError
from extproc.protocol.inspection import Inspected, Refusal, Rules, client_request, inspect, inspect_answer
from extproc.protocol.openai_request import ClientRequest, precheck

log = logging.getLogger("extproc.inspector")

# Bodies up to this size are inspected on the loop: the worst shape costs about 0.3 ms there (16 KiB of
# tiny content parts, matched by jsonspan's one-regex fast path); 32 KiB of it costs 5 ms.
INLINE_MAX_BYTES = 16 << 10

# Worker processes per server process at most. Parsing 32 MiB of tiny content parts takes a worker about
# 600 MiB (20x the body); the CPUs a container sees are often the node's, not its share.
POOL_MAX = 2

T = TypeVar("T")
Work = Callable[[str, "str | None", bytes, Rules], "Inspected | Refusal"]


def pool_size(max_inflight: int, processes: int = 1) -> int:
    """Worker processes for one server process: no more than its share of the CPUs it may run on, than the
    requests it admits at once, or than POOL_MAX."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, min(max_inflight, cpus // max(1, processes), POOL_MAX))


# How often a pool worker looks whether its server is still there.
PARENT_WATCH_SECONDS = 1.0


def start_worker(parent: int, max_request_bytes: int, _body_slots: object) -> None:
    """Pool worker initializer: the server's allocator thresholds (malloc.py: a worker reads and parses
    bodies of megabytes too), and an exit with the server. ``_body_slots``: the memory files this worker
    inherited (shared_body.py), under the numbers the server lends them by."""
    keep_large_blocks(max_request_bytes)
    exit_with_parent(parent)


def exit_with_parent(parent: int) -> None:
    """A worker whose server died (SIGKILL, the OOM killer) exits too. It would not notice otherwise (each
    worker holds its own end of the pool's call queue, so it never reads EOF) and would live on as an
    orphan holding memory and the server's stdout and stderr."""
    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(PARENT_WATCH_SECONDS)
        os._exit(0)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def _inspect_body(work: Work, path: str, content_type: str | None, rules: Rules, raw: bytes) -> Inspected | Refusal:
    return work(path, content_type, raw, rules)


class Inspector:
    """Owns the pool. ``max_waiting`` bounds the large bodies waiting for (or in) the pool: past it a
    large body is refused as pd_overloaded, as the admission cap would refuse it after its inspection."""

    def __init__(self, rules: Rules, *, workers: int = 1, max_waiting: int = 1024,
                 inline_max_bytes: int = INLINE_MAX_BYTES, work: Work = inspect_answer) -> None:
        self._rules = rules
        self._workers = workers
        self._max_waiting = max_waiting
        self._inline_max_bytes = inline_max_bytes
        self._work = work
        self._pool: ProcessPoolExecutor | None = None
        self._slots = BodySlots(workers)
        self.waiting = 0  # large bodies submitted and not answered yet
        self.offloaded = 0  # large bodies inspected in the pool, answered or not

    async def inspect(self, path: str, content_type: str | None, raw: bytes) -> ClientRequest:
        """The checked request, or PdError: the same answer on either side of the size limit."""
        if len(raw) <= self._inline_max_bytes:
            return client_request(path, raw, inspect(path, content_type, raw, self._rules))
        precheck(path, content_type, raw, self._rules.max_bytes, self._rules.served)  # a refusal that needs no worker
        answer = await self._in_pool(functools.partial(_inspect_body, self._work, path, content_type, self._rules), raw)
        if isinstance(answer, Refusal):
            raise answer.error()
        return client_request(path, raw, answer)

    async def check(self, work: Callable[[bytes], Refusal | None], raw: bytes) -> Refusal | None:
        """Another pure check of a body (a module-level function, so a worker can run it), where
        ``inspect`` would run it: on the loop when the body is small, else in the pool, bounded alike."""
        if len(raw) <= self._inline_max_bytes:
            return work(raw)
        return await self._in_pool(work, raw)

    async def _in_pool(self, function: Callable[[bytes], T], raw: bytes) -> T:
        """``function(raw)`` in a worker, the body lent through shared memory (shared_body.py) when it can be."""
        if self.waiting >= self._max_waiting:
            raise PdError(Code.PD_OVERLOADED)
        self.waiting += 1
        self.offloaded += 1
        try:
            self._running_pool()  # its memory files exist before the first body is lent
            async with self._slots.lend(raw) as body:
                try:
                    return await self._run(functools.partial(with_body, body, function))
                except Unreadable as exc:  # then this body, and every later one, through the pipe
                    self._slots.disable(str(exc))
            return await self._run(functools.partial(with_body, raw, function))
        finally:
            self.waiting -= 1

    async def _run(self, call: Callable[[], T]) -> T:
        pool = self._running_pool()
        try:
            return await asyncio.get_running_loop().run_in_executor(pool, call)
        except BrokenProcessPool:  # a worker died (killed, out of memory): a new pool for the next body
            log.error("the body inspection pool broke; starting a new one")
            if self._pool is pool:
                self._pool = None
            pool.shutdown(wait=False, cancel_futures=True)
            raise PdError(Code.INTERNAL_ERROR) from None

    def start(self) -> None:
        """Make the pool now (its queues and locks; no process yet), so a host that cannot give a process
        pool its semaphores (no /dev/shm) fails at startup, not on the first large body."""
        self._running_pool()

    def _running_pool(self) -> ProcessPoolExecutor:
        if self._pool is None:
            slots = self._slots.open()  # before the workers: each inherits them
            self._pool = ProcessPoolExecutor(self._workers, mp_context=multiprocessing.get_context("spawn"),
                                             initializer=start_worker,
                                             initargs=(os.getpid(), self._rules.max_bytes, slots))
        return self._pool

    def close(self) -> None:
        """Stop the pool's processes; a body still being inspected is abandoned (its stream is gone)."""
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None
        self._slots.close()
