"""Every deployment file in the repository passes its validator (see deploy/validate.py for which)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from deploy import dockerfile_lint, tools, validate
from deploy import render_manifests as rm
from deploy.schemas.extract_compose_schema import embedded_schema

pytestmark = pytest.mark.deploy

ENVOY_CONFIGS = validate.envoy_configs()
K8S_DOCS = validate.k8s_documents()


@pytest.fixture(scope="module")
def k8s_report() -> dict[str, list[str]]:
    return validate.k8s_problems(K8S_DOCS)


def test_envoy_configs_are_found_in_compose_and_k8s() -> None:
    assert {f"envoy/envoy.{engine}.yaml" for engine in rm.COMPOSE_ENGINES} <= set(ENVOY_CONFIGS)
    assert any(label.startswith("k8s/") for label in ENVOY_CONFIGS)


@pytest.mark.parametrize("label", sorted(ENVOY_CONFIGS))
def test_envoy_config_passes_envoy_validate(label: str) -> None:
    assert validate.envoy_problems(ENVOY_CONFIGS[label]) == []


@pytest.mark.parametrize("path", [validate.COMPOSE_FILE, validate.COMPOSE_GPU_FILE], ids=lambda p: p.name)
def test_compose_file_matches_the_compose_spec_schema(path: Path) -> None:
    assert validate.compose_schema_problems(yaml.safe_load(path.read_text())) == []


@pytest.mark.parametrize("engine", rm.COMPOSE_ENGINES)
def test_compose_file_passes_docker_compose_config(engine: str) -> None:
    assert validate.compose_tool_problems(validate.COMPOSE_FILE, env={"PD_ENGINE": engine}) == []


def test_compose_file_with_the_gpu_override_passes_docker_compose_config() -> None:
    assert validate.compose_tool_problems(validate.COMPOSE_FILE, validate.COMPOSE_GPU_FILE) == []


def test_committed_compose_schema_is_the_one_docker_compose_embeds() -> None:
    assert validate.COMPOSE_SCHEMA.read_bytes() == embedded_schema(tools.compose_bin())
    assert json.loads(validate.COMPOSE_SCHEMA.read_text())["$id"] == "compose_spec.json"


@pytest.mark.parametrize("label", [d.label for d in K8S_DOCS])
def test_kubernetes_object_is_valid(label: str, k8s_report: dict[str, list[str]]) -> None:
    assert k8s_report[label] == []


def test_every_kind_of_kubernetes_object_is_present() -> None:
    kinds = {(validate.api_group(d.body), d.body["kind"]) for d in K8S_DOCS}
    assert {("apps", "Deployment"), ("", "Service"), ("", "ConfigMap"), ("policy", "PodDisruptionBudget"),
            ("networking.k8s.io", "NetworkPolicy"), ("gateway.networking.k8s.io", "Gateway"),
            ("gateway.networking.k8s.io", "HTTPRoute"), ("inference.networking.k8s.io", "InferencePool"),
            ("gateway.envoyproxy.io", "ClientTrafficPolicy"), ("monitoring.coreos.com", "ServiceMonitor"),
            ("monitoring.coreos.com", "PodMonitor"), ("networking.gke.io", "HealthCheckPolicy"),
            ("networking.gke.io", "GCPBackendPolicy")} <= kinds


def test_dockerfile_passes_the_lint() -> None:
    assert dockerfile_lint.problems((validate.REPO / "Dockerfile").read_text()) == []
