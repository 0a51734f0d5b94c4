"""Structured logging: one JSON object per line on stderr.

Lines are made on the caller's thread and written by a writer thread of their own, in batches: a slow or
blocked stderr (a full pipe to a log collector) never holds the event loop. The queue is bounded; a line
that finds it full is dropped and counted, and the count is written once the writer catches up.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import sys
import threading
import time
from collections import deque
from collections.abc import Mapping
from typing import IO, Any

import orjson

_STANDARD = frozenset(vars(logging.makeLogRecord({})).keys()) | {"message", "asctime", "taskName"}


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        for key, value in vars(record).items():
            if key not in _STANDARD and not key.startswith("_"):
                entry[key] = value
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return orjson.dumps(entry, default=str).decode()


class _Second:
    """The timestamp's text up to the second, made once per second (time.strftime is the costly part)."""

    def __init__(self) -> None:
        self.second = -1
        self.text = ""

    def ts(self, now: float) -> str:
        second = int(now)
        if second != self.second:
            self.second, self.text = second, time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(second))
        return f"{self.text}.{int((now - second) * 1000):03d}Z"


_second = _Second()

QUEUE_LINES = 1 << 16  # lines waiting for the writer before new ones are dropped
HELD_LINES = 256  # at most this many lines go out in one write
# How long the writer lets lines gather after the first one arrives: one wake-up and one write for the
# lot. A wake-up per line cost the writer ~12 µs and the caller ~8 µs a line at 1,400 lines/s
# (docs/decisions.md); a line reaches stderr at most this late (flush and stop do not wait for it).
BATCH_SECONDS = 0.02


class LineQueue:
    """The lines waiting for the writer: put by any thread, taken only by the writer. Bounded: a line that
    finds it full is dropped and counted, and the count is queued before the next line that fits."""

    def __init__(self, limit: int = QUEUE_LINES) -> None:
        self._lines: deque[str] = deque()
        self._limit = limit
        self._lock = threading.Lock()  # held for an append or a swap: never across a write
        self._signalled = False  # ``arrived`` was set since the writer last took the lines
        self.arrived = threading.Event()
        self.dropped = 0
        self.queued = 0  # lines queued since the start (a drop note included): what flush() waits for

    def put(self, line: str) -> None:
        """Queue one line (without its newline); wake the writer if it is not already woken."""
        with self._lock:
            if len(self._lines) >= self._limit:
                self.dropped += 1
                return
            if self.dropped:
                self._lines.append(orjson.dumps({"ts": _second.ts(time.time()), "level": "warning",
                                                 "logger": "extproc.logs", "msg": "log lines dropped",
                                                 "dropped": self.dropped}).decode())
                self.queued += 1
                self.dropped = 0
            self._lines.append(line)
            self.queued += 1
            wake, self._signalled = not self._signalled, True
        if wake:
            self.arrived.set()

    def take(self) -> list[str]:
        """Every line queued so far, in order; the next put wakes the writer again."""
        with self._lock:
            lines = list(self._lines)
            self._lines.clear()
            self._signalled = False
        return lines


class LineQueueHandler(logging.Handler):
    """Formats each record into its JSON line here (the record holds live objects) and queues the text."""

    def __init__(self, lines: LineQueue) -> None:
        super().__init__()
        self.lines = lines

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.lines.put(self.format(record))
        except Exception:
            self.handleError(record)


class LineWriter(threading.Thread):
    """Writes the queued lines to the stream, each followed by a newline: woken by the first line after a
    write, it lets lines gather for ``batch_seconds``, then writes them all (at most HELD_LINES a write;
    stderr is line-buffered: a write per line is a system call per line)."""

    def __init__(self, lines: LineQueue, stream: IO[str], batch_seconds: float = BATCH_SECONDS) -> None:
        super().__init__(name="pd-extproc-log-writer", daemon=True)
        self.lines = lines
        self.stream = stream
        self._batch_seconds = batch_seconds
        self._hurry = threading.Event()  # flush() or stop(): write without waiting for the batch
        self._stopping = False
        self._written = 0
        self._progress = threading.Condition()

    def run(self) -> None:
        while True:
            if not self._stopping:
                self.lines.arrived.wait()
                self._hurry.wait(self._batch_seconds)
            self._hurry.clear()
            self.lines.arrived.clear()
            taken = self.lines.take()
            for start in range(0, len(taken), HELD_LINES):
                self._write("\n".join(taken[start:start + HELD_LINES]) + "\n")
            with self._progress:
                self._written += len(taken)
                self._progress.notify_all()
            if self._stopping and not taken:
                return

    def _write(self, text: str) -> None:
        # A failed write has nowhere left to be reported: dropped, as StreamHandler does with raiseExceptions off.
        with contextlib.suppress(Exception):
            self.stream.write(text)
            self.stream.flush()

    def flush(self) -> None:
        """Return once every line queued before the call is written."""
        target = self.lines.queued
        with self._progress:
            while self._written < target and self.is_alive():
                self._hurry.set()
                self.lines.arrived.set()
                self._progress.wait(1.0)

    def stop(self) -> None:
        """Write what is queued, then end the thread."""
        self._stopping = True
        self._hurry.set()
        self.lines.arrived.set()
        self.join()


_writer: LineWriter | None = None


def info(logger: logging.Logger, msg: str, fields: Mapping[str, Any]) -> None:
    """``logger.info(msg, extra=fields)``, for the one line per request: the same JSON line, queued
    without a LogRecord, a caller lookup or a formatter pass when logging is as ``configure`` left it
    (one JsonFormatter handler on the root logger, nothing else in the way). Any other set-up (a test's
    capture handler, a filter) gets the ordinary call."""
    if not logger.isEnabledFor(logging.INFO):
        return
    handler = _direct_handler(logger)
    if handler is None:
        logger.info(msg, extra=dict(fields))
        return
    entry: dict[str, Any] = {"ts": _second.ts(time.time()), "level": "info", "logger": logger.name, "msg": msg}
    entry.update(fields)
    handler.lines.put(orjson.dumps(entry, default=str).decode())


def _direct_handler(logger: logging.Logger) -> LineQueueHandler | None:
    """The root's JSON line queue when it is the only place ``logger``'s records go, unfiltered."""
    root = logging.getLogger()
    current: logging.Logger | None = logger
    while current is not None and current is not root:
        if current.handlers or current.filters or not current.propagate or current.disabled:
            return None
        current = current.parent
    if current is None or root.filters or len(root.handlers) != 1:
        return None
    handler = root.handlers[0]
    if (type(handler) is not LineQueueHandler or type(handler.formatter) is not JsonFormatter
            or handler.filters or handler.level > logging.INFO):
        return None
    return handler


def configure(level: str, stream: IO[str] | None = None) -> None:
    """JSON lines on ``stream`` (stderr), written by a thread of their own; a second call replaces the first."""
    global _writer
    stop()
    lines = LineQueue()
    handler = LineQueueHandler(lines)
    handler.setFormatter(JsonFormatter())
    _writer = LineWriter(lines, sys.stderr if stream is None else stream)
    _writer.start()
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())


def flush() -> None:
    """Return once every line queued so far is written."""
    if _writer is not None:
        _writer.flush()


def stop() -> None:
    """Write what is queued and end the writer's thread (at exit, or before ``configure`` again)."""
    global _writer
    if _writer is not None:
        _writer.stop()
        _writer = None


atexit.register(stop)
