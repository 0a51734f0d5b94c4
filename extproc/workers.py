"""What worker processes share (``serve --workers N``, docs/workers.md): where each listens, and one
small shared-memory block that gives them one in-flight limit and one decode-queue reading.

The block is a file in a private (0700) temporary folder that the supervisor creates and every worker
maps: N 64-bit slots, one per worker, then the decode queue's last reading and when it was
taken. Each slot has one writer (its worker); readers sum the slots. No lock: a check reads N
integers, which costs far less than a futex, and the bound it gives is documented in
``SharedAdmission``.
"""

from __future__ import annotations

import dataclasses
import mmap
import os
from dataclasses import dataclass
from pathlib import Path

from extproc.clock import Clock
from extproc.pipeline.admission import Admission
from extproc.protocol.errors import Code, PdError
from extproc.protocol.units import Address
from extproc.upstream.decode_queue import fresh, over

_SLOT = 8  # bytes: one signed 64-bit count per worker
_READING = 16  # bytes: the decode queue's last reading and its CLOCK_MONOTONIC time (two doubles)


def worker_listen(listen: Address, index: int) -> Address:
    """Worker ``index``'s gRPC address: ``<path>-<index>`` for a Unix socket, port + index for TCP."""
    if listen.unix_path is not None:
        return dataclasses.replace(listen, unix_path=f"{listen.unix_path}-{index}")
    return dataclasses.replace(listen, port=listen.port + index)


def worker_listens(listen: Address, workers: int) -> tuple[Address, ...]:
    return tuple(worker_listen(listen, index) for index in range(workers))


def block_size(workers: int) -> int:
    return workers * _SLOT + _READING


class SharedBlock:
    """The mapped block. ``create`` (the supervisor) sizes a new file; ``attach`` (a worker) maps it."""

    def __init__(self, path: Path, workers: int) -> None:
        self.path = path
        self.workers = workers
        fd = os.open(path, os.O_RDWR)
        try:
            self._map = mmap.mmap(fd, block_size(workers))
        finally:
            os.close(fd)
        raw = memoryview(self._map)
        self.slots = raw[:workers * _SLOT].cast("q")
        self.reading = raw[workers * _SLOT:].cast("d")

    @classmethod
    def create(cls, path: Path, workers: int) -> SharedBlock:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, block_size(workers))  # zero-filled: no request in flight, no reading
        finally:
            os.close(fd)
        block = cls(path, workers)
        block.reading[0] = float("nan")
        return block

    def total(self) -> int:
        return sum(self.slots)

    def zero(self, index: int) -> None:
        """A worker that died held nothing any more (the supervisor calls this before a restart)."""
        self.slots[index] = 0

    def close(self) -> None:
        self.slots.release()
        self.reading.release()
        self._map.close()


@dataclass
class SharedAdmission(Admission):
    """Admission whose limit counts every worker's requests. ``inflight`` stays this worker's own.

    ``enter`` publishes first and checks after (the count, including this request, must be within the
    limit; otherwise it is taken back and the request refused). Under sequential consistency that is
    exact: of two workers racing for the last slot, at least one sees the other. x86 lets a load pass
    an earlier store still in the store buffer, so the bound promised is the weaker one: the limit
    may be passed by at most N - 1 (each other worker by one request it has published but this one
    did not yet see). Two racing workers may also both refuse; the limit is then not reached by one.
    """

    block: SharedBlock | None = None
    index: int = 0

    @property
    def full(self) -> bool:
        assert self.block is not None
        return self.block.total() >= self.limit

    def enter(self) -> None:
        if self.draining:
            raise PdError(Code.PD_SHUTTING_DOWN)
        assert self.block is not None
        self.inflight += 1
        self.block.slots[self.index] = self.inflight
        if self.block.total() > self.limit:
            self.inflight -= 1
            self.block.slots[self.index] = self.inflight
            raise PdError(Code.PD_OVERLOADED)

    def leave(self) -> None:
        super().leave()
        assert self.block is not None
        self.block.slots[self.index] = self.inflight


class SharedQueueReading:
    """The decode queue's reading as the workers that do not watch it see it: worker 0 runs the watch
    and publishes each reading here (``publish``); the others answer ``over_limit`` from the block,
    with the watch's own rule (a reading older than three intervals refuses nothing)."""

    def __init__(self, block: SharedBlock, limit: int, interval: float, clock: Clock) -> None:
        self._block = block
        self._limit = limit
        self._interval = interval
        self._clock = clock

    @staticmethod
    def publish(block: SharedBlock, waiting: float, read_at: float) -> None:
        block.reading[1] = read_at
        block.reading[0] = waiting

    @property
    def waiting(self) -> float | None:
        waiting, read_at = self._block.reading[0], self._block.reading[1]
        return None if waiting != waiting else fresh(waiting, read_at, self._clock.now(), self._interval)  # NaN: none

    def over_limit(self) -> bool:
        return over(self.waiting, self._limit)


@dataclass(frozen=True, slots=True)
class WorkerRole:
    """What the supervisor tells worker ``index`` of ``workers``: the block's file and the Unix socket
    its /metrics, /healthz and /readyz go on (the supervisor scrapes it; only it has metrics_listen)."""

    index: int
    workers: int
    block_path: Path
    metrics_socket: Path
