"""``make bench``'s stage budget (bench/stages.py) runs against today's server: it builds the server as
``serve`` does, drives real P/D requests through the servicer to a cheap prefill worker and times every
stage. It broke twice without a test (the log writer's handler, the prefill client's name)."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench import stages
from bench.workers import CheapWorker
from extproc.pipeline import processor


@pytest.fixture
def prefill(tmp_path: Path):  # type: ignore[no-untyped-def]
    worker = CheapWorker("vllm", "prefill", tmp_path, "stages-prefill")
    worker.start()
    try:
        worker.wait_ready(30)
        yield worker
    finally:
        worker.stop()


def test_the_stage_budget_times_real_pd_requests(prefill: CheapWorker, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(stages, "WARMUP", 5)
    result = stages.measure(prefill.url, requests=20, repeats=1)
    # Every request asked the prefill worker for a KV handoff (warm-up included) and went on to decode.
    assert prefill.counters()["producer"] == 25
    for stage in ("header step", "body parse", "prefill leg", "handoff check", "protobuf reply", "log line",
                  "metrics"):
        assert result.calls[stage] > 0, stage
    assert result.total_cpu_us > 0
    # Every timed function is itself again afterwards: the processor's logger logs as before.
    assert "info" not in vars(processor.log)
    processor.log.info("after the stage budget")
