"""Structured logging: one JSON object per line on stderr.

Lines are made on the caller's thread and written by a QueueListener's thread: a slow or blocked stderr
(a full pipe to a log collector) never holds the event loop. The queue is bounded; a line that finds it
full is dropped and counted, and the count is written once the writer catches up.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import logging.handlers
import queue
import sys
import time
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


class LineQueueHandler(logging.handlers.QueueHandler):
    """Formats each record into its JSON line here (the record holds live objects) and queues the text."""

    def __init__(self, lines: queue.Queue[str]) -> None:
        super().__init__(lines)
        self.dropped = 0

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.put(self.format(record))
        except Exception:
            self.handleError(record)

    def put(self, line: str) -> None:
        """Queue one line (without its newline); when the queue is full, drop and count it."""
        try:
            if self.dropped:
                self.queue.put_nowait(orjson.dumps({"ts": _second.ts(time.time()), "level": "warning",
                                                    "logger": "extproc.logs", "msg": "log lines dropped",
                                                    "dropped": self.dropped}).decode())
                self.dropped = 0
            self.queue.put_nowait(line)
        except queue.Full:
            self.dropped += 1


class LineWriter(logging.handlers.QueueListener):
    """Writes the queued lines to the stream, each followed by a newline. Lines that arrive while it
    writes are written together, one write and flush for the lot (stderr is line-buffered: a write per
    line is a system call per line); a line is held only while another is already queued behind it."""

    def __init__(self, lines: queue.Queue[str], stream: IO[str]) -> None:
        super().__init__(lines, respect_handler_level=False)
        self.lines = lines
        self.stream = stream
        self._held: list[str] = []

    def handle(self, record: Any) -> None:
        self._held.append(record)
        # The last line queued always finds the queue empty here, so flush() (a join on the queue) and
        # stop() never return with a line held.
        if len(self._held) >= HELD_LINES or self.lines.empty():
            self._write_held()

    def _write_held(self) -> None:
        text, self._held = "\n".join(self._held) + "\n", []
        # A failed write has nowhere left to be reported: dropped, as StreamHandler does with raiseExceptions off.
        with contextlib.suppress(Exception):
            self.stream.write(text)
            self.stream.flush()

    def stop(self) -> None:
        super().stop()
        if self._held:  # the stop sentinel was queued behind the last line
            self._write_held()


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
    handler.put(orjson.dumps(entry, default=str).decode())


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
    lines: queue.Queue[str] = queue.Queue(QUEUE_LINES)
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
        _writer.lines.join()


def stop() -> None:
    """Write what is queued and end the writer's thread (at exit, or before ``configure`` again)."""
    global _writer
    if _writer is not None:
        _writer.stop()
        _writer = None


atexit.register(stop)
