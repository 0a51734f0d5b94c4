"""What our Envoy's access log says about every request it served: counts by route, status and details.

Our bootstrap logs one JSON object per request to stdout (see extproc/envoy/bootstrap.py); the bench
keeps that stream in a file. Failures that the load generator only counts are explained here, e.g.
``ext_proc_error_gRPC_error_14{no_healthy_upstream...}`` when Envoy took our server out of rotation.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import orjson


def outcomes(log_path: Path) -> list[dict[str, Any]]:
    counts: Counter[tuple[str, int, str]] = Counter()
    with log_path.open("rb") as log:
        for line in log:
            try:
                entry = orjson.loads(line)
            except orjson.JSONDecodeError:
                continue
            if isinstance(entry, dict) and "route" in entry:
                counts[(str(entry["route"]), int(entry.get("code") or 0), str(entry.get("details")))] += 1
    return [{"route": route, "code": code, "details": details, "count": count}
            for (route, code, details), count in counts.most_common()]
