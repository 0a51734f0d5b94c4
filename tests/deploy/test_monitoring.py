"""The monitoring components: both modes' monitors reach real ports, the alerts query real metrics, and the
dashboard ConfigMap is the dashboard."""

from __future__ import annotations

import copy
import json
import re
import shutil
from pathlib import Path
from typing import Any

import pytest
import yaml

from deploy import render_manifests as rm
from deploy import validate
from extproc.adapters import engines
from extproc.config import Settings
from extproc.envoy.bootstrap import (
    DECODE_STAT,
    ENGINE_METRICS_PATH,
    TIMING_STAT_PREFIX,
    TTFT_STAT,
    UNTRUSTED_PICKER_STAT,
    engine_metrics_path,
)
from extproc.observability.metrics import Metrics
from tests.helpers import NOT_ERROR_OUTCOMES

pytestmark = pytest.mark.deploy

SIDECAR = validate.K8S_OVERLAYS / "example"
GATEWAY = validate.GATEWAY_EXAMPLES / "envoy-gateway"


def _objects(root: Any) -> dict[tuple[str, str], dict[str, Any]]:
    return {(d.body["kind"], d.body["metadata"]["name"]): d.body for d in validate.render_overlay(root)}


def _alert_exprs(objects: dict[tuple[str, str], dict[str, Any]]) -> list[str]:
    rule = objects[("PrometheusRule", "pd-extproc")]
    return [r["expr"] for group in rule["spec"]["groups"] for r in group["rules"]]


@pytest.mark.parametrize("root", [SIDECAR, GATEWAY], ids=["sidecar", "gateway"])
def test_the_alerts_query_metrics_that_exist(root: Any) -> None:
    ours = {metric.name for metric in Metrics().registry.collect()}
    envoy = {f"envoy_{TIMING_STAT_PREFIX}_{name}" for name in (TTFT_STAT, DECODE_STAT, UNTRUSTED_PICKER_STAT)}
    exprs = _alert_exprs(_objects(root))
    assert exprs
    for expr in exprs:
        used = set(re.findall(r"\b(?:envoy_pd|pd_extproc)_[a-z_]+", expr))
        bare = {re.sub(r"_(bucket|total|count|sum)$", "", name) for name in used}
        assert bare <= ours | envoy, expr
    error_ratios = [re.search(r'outcome!~"([a-z_|]+)"', expr) for expr in exprs]
    assert [set(m.group(1).split("|")) for m in error_ratios if m] == [set(NOT_ERROR_OUTCOMES)]


def test_a_broken_alert_rule_is_refused_by_the_schema() -> None:
    rule = copy.deepcopy(_objects(SIDECAR)[("PrometheusRule", "pd-extproc")])
    assert validate.gateway_api_problems([rule]) == [[]]
    del rule["spec"]["groups"][0]["rules"][0]["expr"]
    assert validate.gateway_api_problems([rule]) != [[]]


def _ports(pod: dict[str, Any]) -> dict[str, int]:
    return {port["name"]: port["containerPort"] for c in pod["containers"] for port in c.get("ports", [])}


def test_sidecar_mode_scrapes_the_decode_engine_through_envoys_stats_listener() -> None:
    objects = _objects(SIDECAR)
    endpoints = objects[("ServiceMonitor", "pd-decode")]["spec"]["endpoints"]
    assert {"port": "envoy-stats", "path": ENGINE_METRICS_PATH, "interval": "15s"} in endpoints
    service_ports = {p["name"] for p in objects[("Service", "pd-decode")]["spec"]["ports"]}
    assert {e["port"] for e in endpoints} <= service_ports


def test_gateway_mode_scrapes_pd_extproc_and_the_decode_engine() -> None:
    objects = _objects(GATEWAY)
    monitor = objects[("ServiceMonitor", "pd-extproc")]["spec"]
    service = objects[("Service", "pd-extproc")]
    assert monitor["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    assert {e["port"] for e in monitor["endpoints"]} <= {p["name"] for p in service["spec"]["ports"]}
    decode = objects[("PodMonitor", "pd-decode")]["spec"]
    pod = objects[("Deployment", "pd-decode")]["spec"]["template"]
    assert decode["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    assert {e["port"] for e in decode["podMetricsEndpoints"]} <= set(_ports(pod["spec"]))
    # Prometheus may reach that port: the component's NetworkPolicy admits its namespace there.
    policy = objects[("NetworkPolicy", "pd-monitoring-decode")]["spec"]
    assert policy["ingress"][0]["ports"] == [{"protocol": "TCP", "port": _ports(pod["spec"])["http"]}]


@pytest.mark.parametrize("root", [SIDECAR, GATEWAY], ids=["sidecar", "gateway"])
def test_the_dashboard_configmap_is_the_dashboard_labelled_for_grafana(root: Any) -> None:
    configmap = next(body for (kind, name), body in _objects(root).items()
                     if kind == "ConfigMap" and name.startswith("pd-extproc-dashboard"))
    assert configmap["metadata"]["labels"][rm.GRAFANA_DASHBOARD_LABEL] == "1"
    assert json.loads(configmap["data"][rm.DASHBOARD.name]) == json.loads(rm.DASHBOARD.read_text())


# Each engine's Prometheus page, as its adapter declares it (the decode queue reads the same page).
ENGINE_OVERLAYS = {"vllm_nixl": "overlays/envoy-gateway", "sglang": "engine-overlays/sglang",
                   "trtllm": "engine-overlays/trtllm"}


@pytest.mark.parametrize("adapter", sorted(ENGINE_OVERLAYS))
def test_the_prefill_monitor_scrapes_the_engines_own_prometheus_page(adapter: str, tmp_path: Path) -> None:
    """An operator's overlay on an engine's overlay with the monitoring component: the PodMonitor pd-prefill
    reads the page that engine serves (trtllm-serve's /metrics is JSON), the decode pods' Envoy maps
    /engine/metrics to the same page."""
    shutil.copytree(validate.K8S_DIR, tmp_path / "k8s")
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "kustomization.yaml").write_text(yaml.safe_dump({
        "apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
        "resources": [f"../k8s/{ENGINE_OVERLAYS[adapter]}"], "components": ["../k8s/components/monitoring"]}))
    objects = _objects(tmp_path / "mine")
    page = engines()[adapter].decode_queue
    assert page is not None
    [endpoint] = objects[("PodMonitor", "pd-prefill")]["spec"]["podMetricsEndpoints"]
    assert endpoint["path"] == page.path
    decode = objects[("ServiceMonitor", "pd-decode")]["spec"]["endpoints"]
    assert {"port": "envoy-stats", "path": ENGINE_METRICS_PATH, "interval": "15s"} in decode
    adapter_run = validate.decode_settings(list(objects.values()))["PD_EXTPROC_ADAPTER"]
    assert adapter_run == adapter and engine_metrics_path(Settings(adapter=adapter_run)) == page.path
