"""One /metrics page out of several (``serve --workers N``): each worker's page, merged at scrape time.

Pages are Prometheus text (format 0.0.4) as prometheus_client writes them: a family's ``# HELP`` and
``# TYPE`` lines, then its samples. A sample is identified by its name and label text exactly as
written (every worker runs the same code, so the same series is spelled the same). Values of one
series are combined by ``combine``: summed (counters, histogram buckets, _sum and _count, and the
gauges, which count things per process), except a ``*_created`` timestamp (the earliest) and
``pd_extproc_build_info`` (the same 1 everywhere: the largest). NaN means "no value" (a gauge such as
the decode queue's, which only one worker reads) and is left out of a sum; a series that is NaN
everywhere stays NaN. Families and series keep the order in which they are first seen.

A worker that dies takes its counts with it; summed naively, the merged counters would fall, which
Prometheus reads as a reset of the whole series (and ``rate()`` as a burst). Two things keep them
rising: the supervisor folds a dead worker's last scraped page into a page of retired counts
(``counters_only``), merged with every later scrape; and ``merge_pages(..., high=...)`` never lets a
counter or histogram series fall below what it last exposed (what a dead worker counted after its last
scrape is lost; the clamp absorbs that much of the next increments instead of exposing a fall).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

from extproc.protocol.prom_text import series_and_value

SAME_EVERYWHERE = frozenset({"pd_extproc_build_info"})
RISING_TYPES = frozenset({"counter", "histogram"})  # families whose every sample only ever rises


def combine(name: str, values: Sequence[float]) -> float:
    """One value for a series from its value in each page that has it."""
    known = [value for value in values if not math.isnan(value)]
    if not known:
        return math.nan
    if name.endswith("_created"):
        return min(known)
    if name in SAME_EVERYWHERE:
        return max(known)
    return math.fsum(known)


def format_value(value: float) -> str:
    """As prometheus_client writes values: NaN, +Inf, -Inf, or Python's repr of the float."""
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return repr(float(value))


def _families(pages: Iterable[str]) -> tuple[dict[str, list[str]], dict[str, dict[str, tuple[str, list[float]]]],
                                             dict[str, str]]:
    """Each family's # lines (from the first page that has it), its series' values, and its type."""
    headers: dict[str, list[str]] = {}
    samples: dict[str, dict[str, tuple[str, list[float]]]] = {}  # family -> series -> (name, values)
    types: dict[str, str] = {}
    for page in pages:
        family = ""
        for line in page.splitlines():
            if not line:
                continue
            if line.startswith("#"):
                words = line.split(None, 3)
                if len(words) >= 3 and words[1] in ("HELP", "TYPE"):
                    family = words[2]
                    seen = headers.setdefault(family, [])
                    samples.setdefault(family, {})
                    if len(words) == 4 and words[1] == "TYPE":
                        types[family] = words[3].strip()
                    if len(seen) < 2 and line not in seen:
                        seen.append(line)
                continue
            parsed = series_and_value(line)
            if parsed is None:
                continue
            key, name, value = parsed
            series = samples.setdefault(family, {})
            headers.setdefault(family, [])
            entry = series.get(key)
            if entry is None:
                series[key] = (name, [value])
            else:
                entry[1].append(value)
    return headers, samples, types


def merge_pages(pages: Iterable[str], high: dict[str, float] | None = None) -> str:
    """The pages as one page (see the module docstring for how values combine). With ``high``, the
    highest value each counter or histogram series was exposed at: no such series is exposed lower,
    and ``high`` is updated."""
    return _render(pages, high, rising_only=False)


def counters_only(page: str) -> str:
    """The counter and histogram families of a page (a dead worker's counts, kept in the sum)."""
    return _render([page], None, rising_only=True)


def _render(pages: Iterable[str], high: dict[str, float] | None, rising_only: bool) -> str:
    headers, samples, types = _families(pages)
    out: list[str] = []
    for family, lines in headers.items():
        rising = types.get(family) in RISING_TYPES
        if rising_only and not rising:
            continue
        out.extend(lines)
        for key, (name, values) in samples[family].items():
            value = combine(name, values)
            if rising and high is not None:
                value = max(value, high.get(key, value))
                high[key] = value
            out.append(f"{key} {format_value(value)}")
    return "\n".join(out) + "\n" if out else ""
