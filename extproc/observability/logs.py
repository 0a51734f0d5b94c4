"""Structured logging: one JSON object per line on stderr."""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Mapping
from typing import Any

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


def info(logger: logging.Logger, msg: str, fields: Mapping[str, Any]) -> None:
    """``logger.info(msg, extra=fields)``, for the one line per request: the same JSON line, written
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
    line = orjson.dumps(entry, default=str).decode() + handler.terminator
    with handler.lock:  # type: ignore[union-attr]  # created by Handler.__init__
        try:
            handler.stream.write(line)
            handler.flush()
        except Exception:  # what StreamHandler.emit does with a failed write
            handler.handleError(logging.makeLogRecord({"msg": msg, "name": logger.name}))


def _direct_handler(logger: logging.Logger) -> logging.StreamHandler[Any] | None:
    """The root's JSON stream handler when it is the only place ``logger``'s records go, unfiltered."""
    root = logging.getLogger()
    current: logging.Logger | None = logger
    while current is not None and current is not root:
        if current.handlers or current.filters or not current.propagate or current.disabled:
            return None
        current = current.parent
    if current is None or root.filters or len(root.handlers) != 1:
        return None
    handler = root.handlers[0]
    if (type(handler) is not logging.StreamHandler or type(handler.formatter) is not JsonFormatter
            or handler.filters or handler.level > logging.INFO):
        return None
    return handler


def configure(level: str) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
