"""docs/configuration.md, docs/operations.md and the dashboard are checked against the code."""

from __future__ import annotations

import json
import re

from deploy import render_manifests as rm
from extproc.config import specs
from extproc.envoy.bootstrap import DECODE_STAT, TIMING_STAT_PREFIX, TTFT_STAT, UNTRUSTED_PICKER_STAT
from extproc.observability.metrics import Metrics
from tests.harness import REPO
from tests.helpers import NOT_ERROR_OUTCOMES

OPERATIONS = (REPO / "docs" / "operations.md").read_text()


def test_every_setting_is_in_the_configuration_table_as_generated() -> None:
    """docs/configuration.md's table is what `make manifests` renders from the declarations, and lists each once."""
    page = rm.CONFIGURATION_DOC.read_text()
    table = page.split(rm.SETTINGS_TABLE_BEGIN, 1)[1].split(rm.SETTINGS_TABLE_END, 1)[0]
    assert table.strip() == rm.settings_table()
    listed = re.findall(r"^\| `(PD_EXTPROC_[A-Z_]+)`", table, re.M)
    assert sorted(listed) == sorted(spec.env for spec in specs())


def test_every_metric_is_documented_and_every_dashboard_query_uses_real_metrics() -> None:
    names = {metric.name for metric in Metrics().registry.collect()}
    for name in names:
        assert name in OPERATIONS, name
    envoy_names = {f"envoy_{TIMING_STAT_PREFIX}_{name}" for name in (TTFT_STAT, DECODE_STAT, UNTRUSTED_PICKER_STAT)}
    for name in envoy_names:
        assert name in OPERATIONS, name
    dashboard = json.loads((REPO / "deploy" / "grafana" / "pd-extproc.json").read_text())
    for panel in dashboard["panels"]:
        assert panel["description"] and panel["title"] in OPERATIONS
        for target in panel["targets"]:
            used = set(re.findall(r"\b(?:envoy_pd|pd_extproc)_[a-z_]+", target["expr"]))
            bare = {re.sub(r"_(bucket|total|count|sum)$", "", m) for m in used}
            assert used and bare <= names | envoy_names, target


def test_error_ratio_queries_exclude_exactly_the_outcomes_that_are_not_errors() -> None:
    """A served request (`answered_by_prefill` included) or a cancelled one must not count as an error."""
    dashboard = (REPO / "deploy" / "grafana" / "pd-extproc.json").read_text()
    excluded = re.findall(r'outcome!~\\?"([a-z_|]+)\\?"', OPERATIONS + dashboard)
    assert len(excluded) >= 2, "operations.md's error-ratio query and the dashboard's error panel"
    for pattern in excluded:
        assert set(pattern.split("|")) == NOT_ERROR_OUTCOMES, pattern
