"""README and the dashboard are checked against the code."""

from __future__ import annotations

import json
import re

from extproc.config import specs
from extproc.envoy.bootstrap import DECODE_STAT, TIMING_STAT_PREFIX, TTFT_STAT
from extproc.observability.metrics import NOT_ERROR_OUTCOMES, Metrics
from tests.harness import REPO

README = (REPO / "README.md").read_text()


def test_every_setting_is_in_the_readme_table() -> None:
    table = README.split("<!-- settings-table -->", 1)[1].split("<!-- /settings-table -->", 1)[0]
    listed = set(re.findall(r"`(PD_EXTPROC_[A-Z_]+)`", table))
    assert listed == {spec.env for spec in specs()}


def test_every_metric_is_documented_and_every_dashboard_query_uses_real_metrics() -> None:
    names = {metric.name for metric in Metrics().registry.collect()}
    for name in names:
        assert name in README, name
    envoy_names = {f"envoy_{TIMING_STAT_PREFIX}_{name}" for name in (TTFT_STAT, DECODE_STAT)}
    for name in envoy_names:
        assert name in README, name
    dashboard = json.loads((REPO / "deploy" / "grafana" / "pd-extproc.json").read_text())
    for panel in dashboard["panels"]:
        assert panel["description"] and panel["title"] in README
        for target in panel["targets"]:
            used = set(re.findall(r"\b(?:envoy_pd|pd_extproc)_[a-z_]+", target["expr"]))
            bare = {re.sub(r"_(bucket|total|count|sum)$", "", m) for m in used}
            assert used and bare <= names | envoy_names, target


def test_error_ratio_queries_exclude_exactly_the_outcomes_that_are_not_errors() -> None:
    """A served request (`answered_by_prefill` included) or a cancelled one must not count as an error."""
    dashboard = (REPO / "deploy" / "grafana" / "pd-extproc.json").read_text()
    excluded = re.findall(r'outcome!~\\?"([a-z_|]+)\\?"', README + dashboard)
    assert len(excluded) >= 2, "the README's error-ratio query and the dashboard's error panel"
    for pattern in excluded:
        assert set(pattern.split("|")) == NOT_ERROR_OUTCOMES, pattern
