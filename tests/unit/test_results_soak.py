"""RESULTS.md quotes the kept hour-long soak report (issue 27) and says so when there is none."""

from __future__ import annotations

import json
from pathlib import Path

from bench import markdown

REPORTS = Path(__file__).resolve().parents[2] / "bench" / "soak-reports"


def test_results_quote_the_kept_soak_report() -> None:
    lines = markdown.soak(REPORTS / "vllm-short.json")
    text = "\n".join(lines)
    data = json.loads((REPORTS / "vllm-short.json").read_text())
    assert text.startswith("## An hour under load and faults")
    assert f"{data['requests']:,} requests" in text and f"**{len(data['failures'])} failures**" in text
    assert "vllm-short.json" in text


def test_results_say_when_no_soak_report_is_kept(tmp_path: Path) -> None:
    lines = markdown.soak(tmp_path / "absent.json")
    assert "No soak report" in "\n".join(lines) and "make soak" in "\n".join(lines)


def test_the_report_results_quote_is_kept_in_git() -> None:
    assert markdown.SOAK_REPORT.exists(), "the hour-long soak's report must be kept in bench/soak-reports"
