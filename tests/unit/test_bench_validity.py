"""The headline's validity (bench/report.py ``validity``): direct decode 5x the fastest P/D proxy at every
point, or, where not, no worker process over the busy bound during the P/D proxies' runs there."""

from __future__ import annotations

from typing import Any

from bench import markdown, report


def _point(system: str, concurrency: int, rps: float, busy: dict[str, float] | None = None,
           workers: str = "cheap", round_index: int = 0) -> dict[str, Any]:
    point: dict[str, Any] = {
        "system": system, "workers": workers, "body": "non-stream", "concurrency": concurrency, "phase": "latency",
        "round": round_index, "requests": int(rps), "seconds": 1.0, "errors": 0, "p50_us": 100.0, "p99_us": 200.0,
        "max_us": 300.0, "problems": [], "foreign_cpu_share": 0.0, "loadgen_cpu_seconds": 0.1,
        "requests_handled": int(rps), "proxy_cpu_seconds": {}}
    if busy is not None:
        point["worker_busy"] = busy
    return point


def _checks(points: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return report.validity(report.cells(points, "latency"), points)


def test_a_point_over_5x_is_valid_whatever_the_workers() -> None:
    points = [_point("direct", 64, 5000, {"decode": 0.9}), _point("vllm-router", 64, 1000, {"decode": 0.5})]
    [check] = _checks(points)
    assert (check["valid"], check["ratio"], check["judged_at_workers"]) == (True, 5.0, [])


def test_under_5x_the_point_is_judged_at_the_workers_during_every_pd_run() -> None:
    quiet = [_point("direct", 1, 4500, {"decode": 0.5}),
             _point("vllm-router", 1, 1000, {"prefill": 0.1, "decode": 0.15}),
             _point("pd-extproc", 1, 500, {"prefill": 0.05, "decode": 0.04})]
    [check] = _checks(quiet)
    assert check["valid"] and check["ratio"] == 4.5  # direct's own busy share is not the question
    assert check["judged_at_workers"] == ["non-stream c=1: 15% (vllm-router round 0: decode worker)"]
    busy = [*quiet, _point("pd-extproc", 1, 500, {"prefill": report.WORKER_BUSY_BOUND + 0.01}, round_index=1)]
    assert not _checks(busy)[0]["valid"]


def test_a_pd_run_without_the_workers_measurement_leaves_the_point_invalid() -> None:
    points = [_point("direct", 1, 4500), _point("vllm-router", 1, 1000, {"decode": 0.1}), _point("pd-extproc", 1, 500)]
    [check] = _checks(points)
    assert not check["valid"]
    assert check["judged_at_workers"] == ["non-stream c=1: workers' CPU not measured"]


def test_the_report_says_which_rule_held_and_where() -> None:
    points = [_point("direct", 1, 4500, {"decode": 0.5}), _point("vllm-router", 1, 1000, {"decode": 0.15}),
              _point("direct", 64, 9000), _point("vllm-router", 64, 1000, {"decode": 0.9})]
    text = "\n".join(markdown.validity({"validity": _checks(points)}))
    assert "**This run is valid**" in text and "no worker process was more than 20% busy" in text
    assert "| `cheap` | 4.5x | non-stream c=1: direct 4500 req/s, vllm-router 1000 | non-stream c=1: 15% " in text
