"""Labelled counters and histograms updated by one thread only (the event loop's): plain numbers, no
lock, exposed at scrape time through prometheus_client as the same samples its own Counter and
Histogram write (names, label order, cumulative buckets, ``_count``, ``_sum``, ``_created``; series in
the order of their first update).

prometheus_client takes a mutex on every ``inc`` and ``observe`` (one per bucket, sum and value) and
``labels()`` builds a key under another; a request ended that way cost about 26 µs. Here an update is
one dict lookup, a bisect and two additions. Only for series no other thread writes: the scrape reads
them on the same loop (extproc/observability/httpserver.py serves /metrics there).
"""

from __future__ import annotations

import time
from bisect import bisect_left
from collections.abc import Iterable, Sequence

from prometheus_client import CollectorRegistry, Metric
from prometheus_client import metrics as prometheus_metrics
from prometheus_client.registry import Collector
from prometheus_client.utils import INF, floatToGoString


def _created_samples() -> bool:
    # prometheus_client's own switch (PROMETHEUS_DISABLE_CREATED_SERIES, disable_created_metrics()),
    # read at scrape time as its metrics read it.
    return bool(prometheus_metrics._use_created)


class LoopCounter(Collector):
    """A labelled counter, like prometheus_client's ``Counter(name, documentation, labelnames)``."""

    def __init__(self, name: str, documentation: str, labelnames: Sequence[str],
                 registry: CollectorRegistry) -> None:
        self._name, self._documentation, self._labelnames = name, documentation, tuple(labelnames)
        self._values: dict[tuple[str, ...], list[float]] = {}  # labels -> [value, created]
        registry.register(self)

    def describe(self) -> Iterable[Metric]:
        return [Metric(self._name, self._documentation, "counter")]

    def inc(self, labels: tuple[str, ...], amount: float = 1.0) -> None:
        series = self._values.get(labels)
        if series is None:
            series = self._values[labels] = [0.0, time.time()]
        series[0] += amount

    def collect(self) -> Iterable[Metric]:
        metric = Metric(self._name, self._documentation, "counter")
        created = _created_samples()
        for labels, (value, since) in list(self._values.items()):
            named = dict(zip(self._labelnames, labels, strict=True))
            metric.add_sample(self._name + "_total", named, value)
            if created:
                metric.add_sample(self._name + "_created", named, since)
        return [metric]


class _HistogramSeries:
    __slots__ = ("counts", "created", "sum")

    def __init__(self, buckets: int) -> None:
        self.counts = [0] * buckets  # per bucket, not cumulative (as prometheus_client keeps them)
        self.sum = 0.0
        self.created = time.time()


class LoopHistogram(Collector):
    """A labelled histogram, like prometheus_client's ``Histogram(name, documentation, labelnames, buckets)``."""

    def __init__(self, name: str, documentation: str, labelnames: Sequence[str], buckets: Sequence[float],
                 registry: CollectorRegistry) -> None:
        bounds = [float(bound) for bound in buckets]
        if bounds != sorted(bounds):
            raise ValueError("buckets not in sorted order")
        if not bounds or bounds[-1] != INF:
            bounds.append(INF)
        self._name, self._documentation, self._labelnames = name, documentation, tuple(labelnames)
        self._bounds = tuple(bounds)
        self._le = tuple(floatToGoString(bound) for bound in bounds)  # type: ignore[no-untyped-call]
        self._series: dict[tuple[str, ...], _HistogramSeries] = {}
        registry.register(self)

    def describe(self) -> Iterable[Metric]:
        return [Metric(self._name, self._documentation, "histogram")]

    def observe(self, labels: tuple[str, ...], amount: float) -> None:
        series = self._series.get(labels)
        if series is None:
            series = self._series[labels] = _HistogramSeries(len(self._bounds))
        series.sum += amount
        index = bisect_left(self._bounds, amount)
        if index < len(self._bounds) and amount <= self._bounds[index]:  # NaN lands in no bucket, as there
            series.counts[index] += 1

    def collect(self) -> Iterable[Metric]:
        metric = Metric(self._name, self._documentation, "histogram")
        created = _created_samples()
        name = self._name
        for labels, series in list(self._series.items()):
            named = dict(zip(self._labelnames, labels, strict=True))
            cumulative = 0.0
            for le, count in zip(self._le, series.counts, strict=True):
                cumulative += count
                metric.add_sample(name + "_bucket", {**named, "le": le}, cumulative)
            metric.add_sample(name + "_count", named, cumulative)
            if self._bounds[0] >= 0:
                metric.add_sample(name + "_sum", named, series.sum)
            if created:
                metric.add_sample(name + "_created", named, series.created)
        return [metric]
