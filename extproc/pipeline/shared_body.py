"""A large body's way to an inspection worker: through a memory file, not through the pool's pipe.

The pool's call queue pickles the body and its feeder thread writes it into a 64 KiB pipe, which the
worker drains a piece at a time: for 1 MiB that is two copies and a few dozen wake-ups of both processes,
each taking the GIL from the event loop's thread. Measured through the whole stack (docs/decisions.md):
about 3.5 ms of server CPU per 1 MiB body, against 0.45 ms for the inspection itself. Here the body is
written once into a memory file (``memfd_create``) and the worker reads it from the server's descriptor
(``/proc/<server pid>/fd/<n>``): one write and one read, each a single copy in the kernel.

A slot is one such file; the server owns ``slots`` of them (one per pool worker) and lends each to one
body at a time. A file keeps its pages for the next body up to ``keep_bytes``; a larger body's pages are
given back when it is done. Where a memory file cannot be made, written or read (no memfd, /proc hidden,
out of memory), the body goes through the pipe as before, and after a worker could not read one, every
body does: the caller asks ``usable``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import TypeVar

log = logging.getLogger("extproc.inspector")

T = TypeVar("T")

# A slot keeps the pages of bodies up to this size between bodies (at most this much memory per pool
# worker, counted as shared memory by the container's cgroup); a larger body's are freed after it.
KEEP_BYTES = 8 << 20


class Unreadable(Exception):
    """A worker could not read a lent body (the server's descriptors are not open to it)."""


@dataclass(frozen=True, slots=True)
class LentBody:
    """Where a worker finds a body: the server's descriptor of a memory file, and the body's length."""

    pid: int
    fd: int
    length: int

    def read(self) -> bytes:
        try:
            with open(f"/proc/{self.pid}/fd/{self.fd}", "rb", buffering=0) as file:
                raw = file.read(self.length)
        except OSError as exc:
            raise Unreadable(str(exc)) from None
        if len(raw) != self.length:
            raise Unreadable(f"read {len(raw)} of {self.length} bytes")
        return raw


def with_body(body: LentBody | bytes, function: Callable[[bytes], T]) -> T:
    """What a pool worker runs: ``function`` on the body, read from its slot when it was lent."""
    return function(body if isinstance(body, bytes) else body.read())


class BodySlots:
    """The server's memory files, one body each at a time. Owned by the Inspector, used on its loop."""

    def __init__(self, slots: int, keep_bytes: int = KEEP_BYTES) -> None:
        self._count = slots
        self._keep_bytes = keep_bytes
        self._free: asyncio.Queue[int] | None = None  # made on the loop, at the first body
        self._fds: list[int] = []
        self.usable = hasattr(os, "memfd_create")

    def disable(self, reason: str) -> None:
        if self.usable:
            log.warning("large bodies go to the inspection pool through its pipe from now on",
                        extra={"reason": reason})
        self.usable = False

    @contextlib.asynccontextmanager
    async def lend(self, raw: bytes) -> AsyncIterator[LentBody | bytes]:
        """A slot holding ``raw`` for as long as the block runs, or ``raw`` itself when no slot can take
        it. Waits while every slot is lent."""
        free = self._slots()
        if free is None:
            yield raw
            return
        fd = await free.get()
        try:
            try:
                os.pwrite(fd, raw, 0)
            except OSError as exc:  # out of memory for the file's pages: this body goes through the pipe
                log.warning("a large body could not be put in shared memory", extra={"error": str(exc)})
                yield raw
            else:
                yield LentBody(os.getpid(), fd, len(raw))
        finally:
            if len(raw) > self._keep_bytes:
                with contextlib.suppress(OSError):
                    os.ftruncate(fd, 0)  # give a large body's pages back
            free.put_nowait(fd)

    def _slots(self) -> asyncio.Queue[int] | None:
        if not self.usable:
            return None
        if self._free is None:
            free: asyncio.Queue[int] = asyncio.Queue()
            try:
                for index in range(self._count):
                    fd = os.memfd_create(f"pd-extproc-body-{index}", os.MFD_CLOEXEC)
                    self._fds.append(fd)
                    free.put_nowait(fd)
            except OSError as exc:
                self.close()
                self.disable(str(exc))
                return None
            self._free = free
        return self._free

    def close(self) -> None:
        for fd in self._fds:
            with contextlib.suppress(OSError):
                os.close(fd)
        self._fds.clear()
        self._free = None
