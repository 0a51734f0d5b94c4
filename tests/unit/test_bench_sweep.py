"""The benchmark's size sweep: its bodies, its per-byte arithmetic and its super-linear check, over made-up points."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from typing import Any

import orjson
import pytest

from bench import procs, sweep_markdown, sweep_report
from bench.workload import SWEEP_KINDS, SWEEP_SIZES, sized_body, sweep_body_name

MIB = 1 << 20
Cost = Callable[[int], float]  # body bytes -> microseconds


@pytest.mark.parametrize("kind", SWEEP_KINDS)
@pytest.mark.parametrize("size", SWEEP_SIZES)
def test_sweep_bodies_are_exactly_their_size_and_valid_requests(kind: str, size: int) -> None:
    body = sized_body(kind, size)
    assert len(body) == size
    parsed = orjson.loads(body)
    prompt = parsed["prompt"] if kind == "completions" else parsed["messages"][0]["content"]
    assert len(prompt) > size - 100 and parsed.get("stream") is None


def _point(system: str, kind: str, size: int, round_index: int, latency_us: float, cpu_us: float) -> dict[str, Any]:
    requests = 10
    return {
        "phase": "size-sweep", "workers": "cheap", "system": system, "body": sweep_body_name(kind, size),
        "kind": kind, "body_bytes": size, "concurrency": 1, "round": round_index,
        "p50_us": latency_us, "p99_us": latency_us, "max_us": latency_us, "requests": requests,
        "seconds": requests * latency_us / 1e6, "errors": 0, "problems": [], "foreign_cpu_share": 0.0,
        "loadgen_cpu_seconds": 0.0, "requests_handled": requests,
        "proxy_cpu_seconds": {} if system == "direct" else {system: cpu_us * requests / 1e6},
    }


def _points(ours: Cost, peer: Cost, rounds: int = 2) -> list[dict[str, Any]]:
    """Direct decode at 50 µs + 1 µs per 8 KiB; each proxy adds its cost as latency and as CPU."""
    points = []
    for round_index in range(rounds):
        for kind in SWEEP_KINDS:
            for size in SWEEP_SIZES:
                direct = 50 + size / 8192
                points.append(_point("direct", kind, size, round_index, direct, 0.0))
                for system, cost in (("pd-extproc", ours), ("vllm-router", peer)):
                    points.append(_point(system, kind, size, round_index, direct + cost(size), cost(size)))
    return points


def _linear(fixed: float, per_mib: float) -> Cost:
    return lambda size: fixed + per_mib * size / MIB


def _quadratic(fixed: float, per_mib_squared: float) -> Cost:
    return lambda size: fixed + per_mib_squared * (size / MIB) ** 2


def test_marginal_cost_takes_the_fixed_cost_out() -> None:
    rows = sweep_report.rows(_points(_linear(1000, 8000), _linear(300, 4000)))
    ours = {r.body_bytes: r for r in rows if r.system == "pd-extproc" and r.kind == "chat"}
    assert ours[1 << 10].cpu_us_per_mib is None  # the smallest size is the base
    for size in SWEEP_SIZES[1:]:
        assert ours[size].cpu_us_per_mib == pytest.approx(8000)
        assert ours[size].added_ms_per_mib == pytest.approx(8.0)


def test_ratio_against_the_peer_from_one_mib_and_its_verdict() -> None:
    summary = sweep_report.summary(_points(_linear(1000, 7000), _linear(300, 4000)))
    assert {(r["kind"], r["body_bytes"]) for r in summary["ratios"]} == {
        (kind, size) for kind in SWEEP_KINDS for size in (1 << 20, 8 << 20)}
    assert all(r["cpu"] == pytest.approx(1.75) and r["latency"] == pytest.approx(1.75) for r in summary["ratios"])
    assert all(v["met"] for v in summary["verdicts"])

    over = sweep_report.summary(_points(_linear(1000, 12000), _linear(300, 4000)))
    per_byte = [v for v in over["verdicts"] if "per byte" in v["target"]]
    assert per_byte and not any(v["met"] for v in per_byte)
    assert "3.00" in per_byte[0]["measured"]


def test_linear_growth_is_not_flagged_and_quadratic_is() -> None:
    linear = sweep_report.summary(_points(_linear(1000, 8000), _linear(300, 4000)))
    ours = [g for g in linear["growth"] if g["system"] == "pd-extproc"]
    assert all(g["cpu_exponent"] == pytest.approx(1.0, abs=0.01) and not g["superlinear"] for g in ours)

    quadratic = sweep_report.summary(_points(_quadratic(1000, 2000), _linear(300, 4000)))
    ours = [g for g in quadratic["growth"] if g["system"] == "pd-extproc"]
    assert all(g["cpu_exponent"] == pytest.approx(2.0, abs=0.05) and g["superlinear"] for g in ours)
    check = next(v for v in quadratic["verdicts"] if "super-linear" in v["target"])
    assert not check["met"] and "chat" in check["by"] and "completions" in check["by"]
    assert not any(g["superlinear"] for g in quadratic["growth"] if g["system"] == "vllm-router")


def test_noise_below_the_smallest_size_leaves_the_fit_to_the_positive_points() -> None:
    assert sweep_report.fit_exponent([1, 4, 16], [-3.0, 4.0, 16.0]) == pytest.approx(1.0)
    assert sweep_report.fit_exponent([1, 4], [-3.0, 4.0]) is None


def test_validity_is_each_workers_busy_fraction_during_every_pd_point() -> None:
    points = _points(_linear(1000, 8000), _linear(300, 4000))
    for point in points:
        point["worker_busy"] = {"prefill": 0.05, "decode": 0.1}
    valid = sweep_report.summary(points)
    assert valid["validity"] == [{"workers": "cheap", "busy": 0.1, "where": valid["validity"][0]["where"],
                                  "valid": True}]
    # One round of one point with a decode worker busy over the bound makes the set invalid, and says where.
    late = next(p for p in points if (p["system"], p["body_bytes"], p["round"]) == ("vllm-router", 8 << 20, 1))
    late["worker_busy"] = {"prefill": 0.05, "decode": sweep_report.WORKER_BUSY_BOUND + 0.01}
    invalid = sweep_report.summary(points)["validity"][0]
    assert not invalid["valid"] and invalid["where"] == f"{late['body']} vllm-router round 1: decode worker"


def test_a_busy_worker_outside_the_pd_points_does_not_count_and_unmeasured_is_invalid() -> None:
    points = _points(_linear(1000, 8000), _linear(300, 4000))
    for point in points:
        point["worker_busy"] = {"prefill": 0.0, "decode": 0.9 if point["system"] == "direct" else 0.1}
    assert sweep_report.summary(points)["validity"][0]["valid"]
    del next(p for p in points if p["system"] == "pd-extproc")["worker_busy"]
    unmeasured = sweep_report.summary(points)["validity"][0]
    assert not unmeasured["valid"] and unmeasured["busy"] is None


def test_the_headlines_throughput_ratio_is_still_reported() -> None:
    # At 8 MiB direct takes 1.1 ms and the proxies 1.1 ms more: direct is under 5x the fastest.
    slow = sweep_report.summary(_points(_linear(300, 100), _linear(300, 100)))
    assert slow["throughput_ratio"][0]["ratio"] < 5 and "8MiB" in slow["throughput_ratio"][0]["where"]


def test_no_sweep_renders_nothing_and_a_sweep_renders_every_size() -> None:
    options = {"sweep_concurrency": 1, "sweep_rounds": 2, "sweep_seconds": 1}
    assert sweep_report.summary([]) == {}
    assert sweep_markdown.render({}, options) == []
    points = _points(_linear(1000, 8000), _linear(300, 4000))
    for point in points:
        point["worker_busy"] = {"prefill": 0.03, "decode": 0.07}
    text = "\n".join(sweep_markdown.render(sweep_report.summary(points), options, placeholder="noisy, machine shared"))
    assert "noisy, machine shared" in text
    assert "| cheap | 7% |" in text and "| valid |" in text
    for label in ("1 KiB", "16 KiB", "256 KiB", "1 MiB", "8 MiB"):
        assert f"| chat | {label} |" in text and f"| completions | {label} |" in text


def test_tree_cpu_counts_reaped_children() -> None:
    # The parent spends little CPU of its own; its child burns some and is reaped before the parent says so.
    script = ("import subprocess, sys; subprocess.run([sys.executable, '-c', 'sum(range(30_000_000))']); "
              "print('reaped', flush=True); sys.stdin.read()")
    with subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                          text=True) as parent:
        try:
            assert parent.stdout is not None and parent.stdout.readline() == "reaped\n"
            assert procs.tree_cpu_seconds(parent.pid) >= procs.cpu_seconds(parent.pid) + 0.2
        finally:
            parent.kill()
