"""The owner of concurrent-flow prefill requests that run on after decode has started.

It starts each one, lets the stream that owns it cancel it, and drains them on shutdown. Whatever
ends a task (success, an error, or a cancellation before its first step), its ``on_done`` runs:
that is where the request's admission slot is released, so no ending can leak a slot.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any

from extproc.clock import Clock
from extproc.protocol.errors import PdError

Task = asyncio.Task[None]


@dataclass(eq=False)
class BackgroundPrefill:
    """One running prefill: its task, and what its stream and the task tell each other."""

    # Set by the stream when decode's response headers arrive: decode has stopped waiting.
    decode_answered: asyncio.Event = field(default_factory=asyncio.Event)
    # Set by the task when the prefill leg failed: the client gets this error instead of decode's answer.
    failure: PdError | None = None
    # Set by the stream when decode's answer went on to the client: its status. A prefill failing after
    # that is no longer the client's answer (the background failure counter still counts it).
    decode_answer_relayed: int | None = None
    task: Task = field(init=False)  # set by BackgroundPrefills.start


class BackgroundPrefills:
    def __init__(self, clock: Clock) -> None:
        self._clock = clock
        self._tasks: set[Task] = set()

    def start(self, work: Callable[[BackgroundPrefill], Coroutine[Any, Any, None]],
              on_done: Callable[[Task], None]) -> BackgroundPrefill:
        """Run ``work(handle)`` as a task; ``on_done`` runs when it ends, however it ends."""
        handle = BackgroundPrefill()
        task = asyncio.get_running_loop().create_task(work(handle))
        handle.task = task
        self._tasks.add(task)

        def done(finished: Task) -> None:
            self._tasks.discard(finished)
            on_done(finished)

        task.add_done_callback(done)
        return handle

    def __len__(self) -> int:
        return len(self._tasks)

    async def drain(self, grace: float) -> None:
        """Wait up to ``grace`` seconds for the running prefills, then cancel the rest."""
        if not self._tasks:
            return
        running = set(self._tasks)
        with contextlib.suppress(TimeoutError):
            async with self._clock.timeout(max(0.0, grace)):
                await asyncio.wait(running)
        late = [task for task in running if not task.done()]
        for task in late:
            task.cancel()
        await asyncio.gather(*late, return_exceptions=True)
