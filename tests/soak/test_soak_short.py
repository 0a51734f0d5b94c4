"""The one-minute soak (bench/soak.py --short) in `make test`: the real stack under a mixed load with a
few faults, so a change that leaks (an fd, an admission slot, an event-loop task, a KV lease) or answers
with an undocumented outcome fails CI. The full run is `make soak` (results: bench/SOAK.md)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.harness import REPO, envoy_bin

pytestmark = [pytest.mark.soak, pytest.mark.timeout(420)]


def test_short_soak_leaks_nothing_and_answers_only_documented_outcomes(tmp_path: Path) -> None:
    binary = envoy_bin()
    assert os.path.exists(binary) or binary == "envoy", f"no Envoy binary at {binary}: run make install"
    report_path = tmp_path / "soak.json"
    run = subprocess.run(
        [sys.executable, "-m", "bench.soak", "--short", "--seed", "27", "--json", str(report_path)],
        cwd=REPO, env={**os.environ, "PD_EXTPROC_ENVOY_BIN": binary, "PYTHONPATH": str(REPO)},
        capture_output=True, text=True, timeout=400)
    report = json.loads(report_path.read_text()) if report_path.exists() else {}
    assert run.returncode == 0 and not report.get("failures"), (
        f"soak failed (exit {run.returncode}):\n" + "\n".join(report.get("failures", [])[:40])
        + f"\n--- stdout\n{run.stdout[-4000:]}\n--- stderr\n{run.stderr[-4000:]}")
    # It ran what it says: traffic of every kind, each fault, the ledger and the counters compared.
    assert report["requests"] > 300
    assert {f["fault"] for f in report["faults"]} == {"extproc_kill", "decode_5xx", "prefill_hang", "prefill_5xx",
                                                       "decode_queue", "prefill_kill"}
    assert all(f["recovery_seconds"] is not None for f in report["faults"])
    assert report["ledger"]["granted"] > 100 and report["ledger"]["pulled"] > 100
    assert report["counter_checks"].get("server_compared", 0) >= 5
    assert report["counter_checks"].get("envoy_compared", 0) >= 5
    for label in ("ok", "pd_extproc_unavailable", "engine_500", "prefill_upstream_timeout", "pd_overloaded",
                  "prefill_upstream_unavailable", "prefill_upstream_error", "disconnected"):
        assert report["labels"].get(label, 0) > 0, f"no {label} answer: the run did not exercise it"
