"""Our server's own view of each request, from its one JSON log line per request (``pd_request``):
how long it held the request (``total_ms``, headers to body reply) and how long the prefill call
took (``prefill_ms``). Matched to a measured point by the point's wall-clock window."""

from __future__ import annotations

import statistics
from datetime import datetime
from pathlib import Path
from typing import Any

import orjson


def _epoch(timestamp: str) -> float:
    return datetime.fromisoformat(timestamp.replace("Z", "+00:00")).timestamp()


def read_requests(log_path: Path) -> list[tuple[float, dict[str, Any]]]:
    """(epoch seconds, entry) of every successful pd_request line, in log order."""
    found = []
    with log_path.open("rb") as log:
        for line in log:
            try:
                entry = orjson.loads(line)
            except orjson.JSONDecodeError:
                continue
            if isinstance(entry, dict) and entry.get("msg") == "pd_request" and entry.get("outcome") == "ok":
                found.append((_epoch(str(entry["ts"])), entry))
    return found


def timings(requests: list[tuple[float, dict[str, Any]]], start: float, end: float) -> dict[str, float] | None:
    """Medians of total_ms and prefill_ms over the requests logged between ``start`` and ``end``."""
    window = [entry for at, entry in requests if start <= at <= end]
    totals = [float(e["total_ms"]) for e in window if isinstance(e.get("total_ms"), int | float)]
    prefills = [float(e["prefill_ms"]) for e in window if isinstance(e.get("prefill_ms"), int | float)]
    if not totals or not prefills:
        return None
    return {"requests": len(window), "total_ms": statistics.median(totals), "prefill_ms": statistics.median(prefills)}
