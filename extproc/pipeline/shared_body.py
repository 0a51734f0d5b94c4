"""A large body's way to an inspection worker: through a memory file, not through the pool's pipe.

The pool's call queue pickles the body and its feeder thread writes it into a 64 KiB pipe, which the
worker drains a piece at a time: for 1 MiB, two copies and a few dozen wake-ups of both processes, each
taking the GIL from the event loop's thread (docs/decisions.md has the measurements). Here the body is
written once into a memory file (``memfd_create``) and the worker reads it with one ``pread``.

A slot is one such file. The server makes ``slots`` of them (one per pool worker) before it starts the
pool; each worker inherits all of them when it is spawned (``InheritedFd``: multiprocessing passes them as
it passes the pool's own pipes), under the same descriptor numbers. A slot is lent to one body at a time
and keeps its pages for the next body up to ``keep_bytes``; a larger body's pages are given back when it
is done. Where the files cannot be made or a body cannot be written into one, the body goes through the
pipe as before; after a worker could not read one, every body does.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from multiprocessing import reduction
from typing import Any, TypeVar

log = logging.getLogger("extproc.inspector")

T = TypeVar("T")

# A slot keeps the pages of bodies up to this size between bodies (at most this much memory per pool
# worker, counted as shared memory by the container's cgroup); a larger body's are freed after it.
KEEP_BYTES = 8 << 20


class Unreadable(Exception):
    """A worker could not read a lent body (its descriptor was not inherited)."""


@dataclass(frozen=True, slots=True)
class LentBody:
    """Where a worker finds a body: a memory file's descriptor (the same number in the server and in each
    worker) and the body's length, from offset 0."""

    fd: int
    length: int

    def read(self) -> bytes:
        pieces, offset = [], 0
        try:
            while offset < self.length:
                piece = os.pread(self.fd, self.length - offset, offset)
                if not piece:
                    raise Unreadable(f"read {offset} of {self.length} bytes")
                pieces.append(piece)
                offset += len(piece)
        except OSError as exc:
            raise Unreadable(str(exc)) from None
        return pieces[0] if len(pieces) == 1 else b"".join(pieces)


def with_body(body: LentBody | bytes, function: Callable[[bytes], T]) -> T:
    """What a pool worker runs: ``function`` on the body, read from its slot when it was lent."""
    return function(body if isinstance(body, bytes) else body.read())


class InheritedFd:
    """A descriptor a spawned pool worker inherits: pickled for the worker's start (its initializer's
    arguments), it is passed to the new process as multiprocessing passes the pool's pipes, and arrives as
    the same number."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def __reduce__(self) -> tuple[Callable[[Any], int], tuple[Any]]:
        return _inherited, (reduction.DupFd(self.fd),)


def _inherited(handle: Any) -> int:
    fd: int = handle.detach()
    return fd


def _write(fd: int, raw: bytes) -> bool:
    view, offset = memoryview(raw), 0
    while offset < len(raw):
        written = os.pwrite(fd, view[offset:], offset)
        if written <= 0:
            return False
        offset += written
    return True


class BodySlots:
    """The server's memory files, one body each at a time. Owned by the Inspector, used on its loop."""

    def __init__(self, slots: int, keep_bytes: int = KEEP_BYTES) -> None:
        self._count = slots
        self._keep_bytes = keep_bytes
        self._fds: list[int] = []
        self._free: asyncio.Queue[int] | None = None
        self.usable = hasattr(os, "memfd_create")
        self.lent = 0  # bodies that went to a worker through a slot

    def open(self) -> list[InheritedFd]:
        """Make the files (once), before the pool's workers are started: what each worker inherits."""
        if self.usable and self._free is None:
            free: asyncio.Queue[int] = asyncio.Queue()
            try:
                for index in range(self._count):
                    fd = os.memfd_create(f"pd-extproc-body-{index}", os.MFD_CLOEXEC)
                    self._fds.append(fd)
                    free.put_nowait(fd)
            except OSError as exc:
                self.close()
                self.disable(str(exc))
            else:
                self._free = free
        return [InheritedFd(fd) for fd in self._fds]

    def disable(self, reason: str) -> None:
        if self.usable:
            log.warning("large bodies go to the inspection pool through its pipe from now on",
                        extra={"reason": reason})
        self.usable = False

    @contextlib.asynccontextmanager
    async def lend(self, raw: bytes) -> AsyncIterator[LentBody | bytes]:
        """A slot holding ``raw`` for as long as the block runs, or ``raw`` itself when no slot can take
        it. Waits while every slot is lent."""
        free = self._free
        if free is None or not self.usable:
            yield raw
            return
        fd = await free.get()
        try:
            try:
                written = _write(fd, raw)
            except OSError as exc:
                log.warning("a large body could not be put in shared memory", extra={"error": str(exc)})
                written = False
            if written:
                self.lent += 1
                yield LentBody(fd, len(raw))
            else:  # out of memory for the file's pages: this body goes through the pipe
                yield raw
        finally:
            if self._free is not free:  # closed meanwhile: the file goes now
                self._fds.remove(fd)
                os.close(fd)
            else:
                if len(raw) > self._keep_bytes:
                    with contextlib.suppress(OSError):
                        os.ftruncate(fd, 0)  # give a large body's pages back
                free.put_nowait(fd)

    def close(self) -> None:
        """Close the files not lent now; each lent one is closed when its body is done."""
        free, self._free = self._free, None
        idle = set(self._fds)
        if free is not None:  # the lent ones are not in the queue
            idle = set()
            while not free.empty():
                idle.add(free.get_nowait())
        for fd in idle:
            self._fds.remove(fd)
            os.close(fd)
