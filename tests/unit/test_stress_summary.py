"""`make stress` counts failures per test from each round's JUnit report (tests/stress.py)."""

from __future__ import annotations

from pathlib import Path

from tests.stress import Round, read_report, summary_markdown

REPORT = """<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest" tests="4">
<testcase classname="tests.e2e.test_workers" name="test_one_inflight_limit_across_both_workers" time="1.0"/>
<testcase classname="tests.e2e.test_workers" name="test_a_killed_worker_is_replaced_and_serves_again" time="1.0">
<failure message="assert False">...</failure></testcase>
<testcase classname="tests.gateway.test_gateway_contract" name="test_x[chat]" time="1.0"><error message="e"/></testcase>
<testcase classname="tests.soak.test_soak_short" name="test_skipped" time="0"><skipped message="s"/></testcase>
</testsuite></testsuites>"""


def test_a_report_gives_the_tests_run_and_each_failure_or_error_by_node_id(tmp_path: Path) -> None:
    path = tmp_path / "round-1.xml"
    path.write_text(REPORT)
    assert read_report(path) == (4, ["tests/e2e/test_workers.py::test_a_killed_worker_is_replaced_and_serves_again",
                                     "tests/gateway/test_gateway_contract.py::test_x[chat]"])


def test_the_summary_counts_each_tests_failures_over_the_rounds() -> None:
    rounds = [Round(1, 60.0, 1, 10, ["a::t", "b::u"]), Round(2, 120.0, 0, 10, []), Round(3, 90.0, 1, 10, ["a::t"])]
    text = summary_markdown(rounds, 1, ["tests/e2e"])
    assert "3 rounds under 1 busy-loop" in text and "minutes per round: 1.0, 2.0, 1.5" in text
    assert "| `a::t` | 2 of 3 | 1, 3 |" in text and "| `b::u` | 1 of 3 | 1 |" in text
    assert text.index("a::t") < text.index("b::u"), "the most frequent first"
    assert "No failure" in summary_markdown(rounds[1:2], 1, ["tests/e2e"])
