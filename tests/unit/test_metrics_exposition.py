"""The lock-free per-request series (extproc/observability/series.py) expose exactly what
prometheus_client's own Counter and Histogram exposed: the same /metrics bytes for the same requests,
one process or several merged, ``_created`` timestamps aside."""

from __future__ import annotations

import random
import re
import time
from collections.abc import Iterator

import pytest
from prometheus_client import metrics as prometheus_metrics

from extproc.observability.merge import merge_pages
from extproc.observability.metrics import Metrics, RequestRecord
from extproc.protocol.errors import Code
from extproc.protocol.openai_request import Endpoint
from extproc.protocol.transport import ExchangeTimings
from tests.unit.prometheus_metrics_oracle import PrometheusClientMetrics

OUTCOMES = ("ok", "answered_by_prefill", "prefill_fallback", "cancelled", *(code.value for code in Code))
APIS = (*(endpoint.api for endpoint in Endpoint), "other")
HANDOFF_PROBLEMS = (None, "remote_block_ids", "remote_engine_id", "kv_transfer_params", "bootstrap_room")
# On each bucket bound (le is inclusive), just either side of one, zero, above the last, and typical values.
SECONDS = (None, 0.0, 0.0001, 0.00010000000000000002, 0.001, 0.0025, 0.01, 0.25, 0.2500001, 1.0, 60.0, 61.5, 0.0173)
SIZES = (None, 0, 1, 1023, 1024, 1025, 4 << 10, 16 << 10, 300_000, 1 << 20, 32 << 20, (32 << 20) + 1, 40 << 20)
ADAPTERS = ("vllm_nixl", "sglang")  # first seen out of alphabetical order: series keep the order of first use
CREATED = re.compile(r"^(\S+_created(?:\{[^}]*\})?) \S+$", re.MULTILINE)


def records(seed: int, count: int) -> Iterator[tuple[RequestRecord, float]]:
    """Requests ended every way: each outcome and API, each timing present or absent, handoff problems,
    body sizes on and around the bounds, two adapters; with the total time each took."""
    rng = random.Random(seed)
    for index in range(count):
        prefill = ExchangeTimings(status=rng.choice((None, 200, 500)), connect_seconds=rng.choice(SECONDS),
                                  response_seconds=rng.choice(SECONDS), total_seconds=rng.choice(SECONDS),
                                  response_bytes=rng.choice(SIZES))
        record = RequestRecord(f"r{index}", ADAPTERS[index % 2], 0.0, api=rng.choice(APIS),
                               outcome=OUTCOMES[index % len(OUTCOMES)], prefill=prefill,
                               body_bytes=rng.choice(SIZES), handoff_problem=rng.choice(HANDOFF_PROBLEMS))
        yield record, rng.choice((0.0, 0.00005, 0.003, 0.4, 2.0, 75.0, *(s for s in SECONDS if s is not None)))


def fed(metrics: Metrics | PrometheusClientMetrics, seed: int, count: int = 600) -> str:
    for record, total in records(seed, count):
        metrics.finish(record, total)
    return metrics.exposition().decode()


def normalised(page: str) -> str:
    return CREATED.sub(r"\1 <created>", page)


def test_the_same_requests_give_the_same_exposition_as_prometheus_client() -> None:
    old, new = fed(PrometheusClientMetrics(), 1), fed(Metrics(), 1)
    assert "pd_extproc_prefill_seconds_bucket" in new and "pd_extproc_handoff_failures_total" in new
    assert normalised(new) == normalised(old)


def test_a_fresh_server_exposes_the_same_families_without_series() -> None:
    assert normalised(Metrics().exposition().decode()) == normalised(PrometheusClientMetrics().exposition().decode())


def test_without_created_series_the_exposition_is_the_same(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(prometheus_metrics, "_use_created", False)
    old, new = fed(PrometheusClientMetrics(), 2, 200), fed(Metrics(), 2, 200)
    assert "_created" not in new
    assert new == old


def test_merged_worker_pages_are_the_same() -> None:
    high_old: dict[str, float] = {}
    high_new: dict[str, float] = {}
    old = merge_pages([fed(PrometheusClientMetrics(), 3), fed(PrometheusClientMetrics(), 4)], high_old)
    new = merge_pages([fed(Metrics(), 3), fed(Metrics(), 4)], high_new)
    assert normalised(new) == normalised(old)
    assert {key for key in high_new if "_created" not in key} == {key for key in high_old if "_created" not in key}


def test_a_series_is_created_when_it_is_first_counted() -> None:
    metrics = Metrics()
    before = time.time()
    metrics.finish(RequestRecord("r", "vllm_nixl", 0.0, api="chat", body_bytes=10), 0.001)
    after = time.time()
    created = dict(re.findall(r"^(\S+_created\S*) (\S+)$", metrics.exposition().decode(), re.MULTILINE))
    assert set(created) == {
        'pd_extproc_requests_created{adapter="vllm_nixl",outcome="ok"}',
        'pd_extproc_api_requests_created{adapter="vllm_nixl",api="chat",outcome="ok"}',
        'pd_extproc_processing_seconds_created{adapter="vllm_nixl"}',
        'pd_extproc_request_body_bytes_created{adapter="vllm_nixl"}',
        "pd_extproc_prefill_retries_created", "pd_extproc_gateway_passthroughs_created"}
    for name in ("requests", "processing_seconds", "request_body_bytes"):
        value = next(float(v) for k, v in created.items() if k.startswith(f"pd_extproc_{name}_created"))
        assert before <= value <= after
