"""Each validator rejects an error planted in a copy of a real deployment file (proof that it checks)."""

from __future__ import annotations

import copy
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from deploy import dockerfile_lint, validate

pytestmark = pytest.mark.deploy

Mutation = Callable[[dict[str, Any]], None]


def _doc(kind: str, name: str) -> dict[str, Any]:
    for doc in validate.k8s_documents():
        # kustomize's generated ConfigMaps carry a content hash after the name
        if doc.body["kind"] == kind and re.fullmatch(rf"{re.escape(name)}(-[a-z0-9]{{10}})?",
                                                     doc.body["metadata"]["name"]):
            return copy.deepcopy(doc.body)
    raise KeyError((kind, name))


# ---------------------------------------------------------------------------------------------- Envoy

ENVOY_PLANTS = {
    "misspelled field": ("stat_prefix: pd_ingress", "stat_prefx: pd_ingress"),
    "port is not a number": ("port_value: 8000", "port_value: eighty"),
    "unknown filter type": ("envoy.extensions.filters.http.router.v3.Router",
                            "envoy.extensions.filters.http.router.v3.Rooter"),
    "route to an undefined cluster": ("cluster: decode", "cluster: no_such_cluster"),
}


@pytest.mark.parametrize("plant", sorted(ENVOY_PLANTS))
@pytest.mark.parametrize("label", ["envoy/envoy.vllm.yaml", "k8s"])
def test_envoy_validate_rejects_a_planted_error(label: str, plant: str) -> None:
    configs = validate.envoy_configs()
    text = next(t for name, t in configs.items() if name.startswith(label))
    old, new = ENVOY_PLANTS[plant]
    assert old in text
    assert validate.envoy_problems(text.replace(old, new, 1)) != []


# -------------------------------------------------------------------------------------------- Compose

def _set(path: tuple[str, ...], value: Any) -> Mutation:
    def mutate(body: dict[str, Any]) -> None:
        node = body
        for key in path[:-1]:
            node = node[key]
        node[path[-1]] = value
    return mutate


COMPOSE_PLANTS: dict[str, tuple[Path, Mutation]] = {
    "unknown service key": (validate.COMPOSE_FILE, _set(("services", "envoy", "imagee"), "pd-extproc:0.1.0")),
    "duration as a number": (validate.COMPOSE_FILE, _set(("services", "prefill", "healthcheck", "interval"), 10)),
    "network_mode not a string": (validate.COMPOSE_FILE, _set(("services", "envoy", "network_mode"),
                                                              ["service:decode"])),
    "gpu capabilities not a list": (validate.COMPOSE_GPU_FILE, _set(
        ("services", "prefill", "deploy", "resources", "reservations", "devices"),
        [{"driver": "nvidia", "capabilities": "gpu"}])),
}


@pytest.mark.parametrize("plant", sorted(COMPOSE_PLANTS))
def test_compose_schema_rejects_a_planted_error(plant: str) -> None:
    path, mutate = COMPOSE_PLANTS[plant]
    body = yaml.safe_load(path.read_text())
    mutate(body)
    assert validate.compose_schema_problems(body) != []


def _compose_copy(tmp_path: Path) -> Path:
    """envoy/ with what docker-compose.yaml reads (the settings files, the bootstraps)."""
    for path in validate.COMPOSE_FILE.parent.iterdir():
        if path.suffix in (".yaml", ".env"):
            shutil.copy(path, tmp_path / path.name)
    return tmp_path / validate.COMPOSE_FILE.name


@pytest.mark.parametrize(("old", "new"), [
    ("network_mode: service:decode", "network_mode: service:decoder"),  # an undefined service
    ('    user: "10001:10001"', '    usr: "10001:10001"'),
    ("engine.${PD_ENGINE:-vllm}.env", "engine.${PD_ENGINE:-vlm}.env"),  # a settings file that does not exist
])
def test_docker_compose_config_rejects_a_planted_error(tmp_path: Path, old: str, new: str) -> None:
    planted = _compose_copy(tmp_path)
    text = planted.read_text()
    assert old in text
    planted.write_text(text.replace(old, new, 1))
    assert validate.compose_tool_problems(planted) != []


def test_docker_compose_config_rejects_an_unknown_engine() -> None:
    assert validate.compose_tool_problems(validate.COMPOSE_FILE, env={"PD_ENGINE": "tgi"}) != []


def test_docker_compose_config_rejects_a_planted_error_in_the_gpu_override(tmp_path: Path) -> None:
    compose = _compose_copy(tmp_path)
    gpu = tmp_path / validate.COMPOSE_GPU_FILE.name
    gpu.write_text(gpu.read_text().replace("  ipc: host", "  ipc: [host]", 1))
    assert validate.compose_tool_problems(compose, gpu) != []


# ----------------------------------------------------------------------------------- core Kubernetes

def _container(name: str) -> Callable[[dict[str, Any]], dict[str, Any]]:
    def find(body: dict[str, Any]) -> dict[str, Any]:
        containers: list[dict[str, Any]] = body["spec"]["template"]["spec"]["containers"]
        return next(c for c in containers if c["name"] == name)
    return find


CORE_PLANTS: dict[str, tuple[str, str, Mutation]] = {
    "replicas as a string": ("Deployment", "pd-decode", lambda d: d["spec"].__setitem__("replicas", "two")),
    "unknown pod field": ("Deployment", "pd-decode",
                          lambda d: d["spec"]["template"]["spec"].__setitem__("containerz", [])),
    "missing selector": ("Deployment", "pd-prefill", lambda d: d["spec"].pop("selector")),
    "probe port not a name or number": ("Deployment", "pd-decode", lambda d: _container("pd-extproc")(d)[
        "readinessProbe"]["httpGet"].__setitem__("port", [9190])),
    "misspelled preStop action": ("Deployment", "pd-decode", lambda d: _container("envoy")(d)["lifecycle"][
        "preStop"].__setitem__("slep", {"seconds": 1})),
    "service port as a string": ("Service", "pd-decode",
                                 lambda d: d["spec"]["ports"][0].__setitem__("port", "8000")),
    "network policy peer typo": ("NetworkPolicy", "pd-decode",
                                 lambda d: d["spec"]["ingress"][0]["from"][0].__setitem__("podSelecter", {})),
    "pdb budget as a list": ("PodDisruptionBudget", "pd-decode",
                             lambda d: d["spec"].__setitem__("maxUnavailable", [1])),
    "configmap data not strings": ("ConfigMap", "pd-extproc-settings",
                                   lambda d: d["data"].__setitem__("PD_EXTPROC_MAX_INFLIGHT", 256)),
}


@pytest.mark.parametrize("plant", sorted(CORE_PLANTS))
def test_kubernetes_schema_rejects_a_planted_error(plant: str) -> None:
    kind, name, mutate = CORE_PLANTS[plant]
    body = _doc(kind, name)
    assert validate.core_problems(body) == []
    mutate(body)
    assert validate.core_problems(body) != []


# ----------------------------------------------------------------------------------------- Gateway API

GATEWAY_PLANTS: dict[str, tuple[str, str, Mutation]] = {
    "path type not in the enum": ("HTTPRoute", "pd-route",
                                  lambda d: d["spec"]["rules"][0]["matches"][0]["path"].__setitem__("type", "Prefix")),
    "timeout not a duration": ("HTTPRoute", "pd-route",
                               lambda d: d["spec"]["rules"][0]["timeouts"].__setitem__("request", "forever")),
    "backend kind as a number": ("HTTPRoute", "pd-route",
                                 lambda d: d["spec"]["rules"][0]["backendRefs"][0].__setitem__("kind", 7)),
    "listener without a protocol": ("Gateway", "pd-gateway", lambda d: d["spec"]["listeners"][0].pop("protocol")),
    "listener port as a string": ("Gateway", "pd-gateway",
                                  lambda d: d["spec"]["listeners"][0].__setitem__("port", "80")),
}


def test_gateway_api_schemas_reject_planted_errors() -> None:
    bodies = []
    for plant in sorted(GATEWAY_PLANTS):
        kind, name, mutate = GATEWAY_PLANTS[plant]
        body = _doc(kind, name)
        mutate(body)
        bodies.append(body)
    clean = [_doc("HTTPRoute", "pd-route"), _doc("Gateway", "pd-gateway")]
    answers = validate.gateway_api_problems([*clean, *bodies])
    assert answers[:2] == [[], []]
    rejected = dict(zip(sorted(GATEWAY_PLANTS), answers[2:], strict=True))
    assert {plant: bool(problems) for plant, problems in rejected.items()} == dict.fromkeys(GATEWAY_PLANTS, True)


def test_an_unknown_gateway_api_kind_has_no_schema() -> None:
    body = _doc("HTTPRoute", "pd-route") | {"kind": "HTTPRouteX"}
    assert validate.gateway_api_problems([body]) != [[]]


# ---------------------------------------------------------------------------- InferencePool (contract)

POOL_PLANTS: dict[str, Mutation] = {
    "target port as a string": lambda d: d["spec"]["targetPorts"][0].__setitem__("number", "8000"),
    "target port out of range": lambda d: d["spec"]["targetPorts"][0].__setitem__("number", 0),
    "unknown failure mode": lambda d: d["spec"]["endpointPickerRef"].__setitem__("failureMode", "Fail"),
    "misspelled spec field": lambda d: d["spec"].__setitem__("endpointPicker", {}),
    "empty selector": lambda d: d["spec"]["selector"].__setitem__("matchLabels", {}),
    "old API version": lambda d: d.__setitem__("apiVersion", "inference.networking.x-k8s.io/v1alpha2"),
}


@pytest.mark.parametrize("plant", sorted(POOL_PLANTS))
def test_inference_pool_contract_rejects_a_planted_error(plant: str) -> None:
    body = _doc("InferencePool", "pd-pool")
    assert validate.inference_pool_problems(body) == []
    POOL_PLANTS[plant](body)
    assert validate.inference_pool_problems(body) != []


# --------------------------------------------------------------------- ClientTrafficPolicy (contract)

CTP_PLANTS: dict[str, Mutation] = {
    "misspelled spec field": lambda d: d["spec"].__setitem__("header", {}),
    "buffer limit with a unit Envoy Gateway refuses": lambda d: d["spec"]["connection"].__setitem__("bufferLimit",
                                                                                                    "32MB"),
    "targets an HTTPRoute": lambda d: d["spec"]["targetRefs"][0].__setitem__("kind", "HTTPRoute"),
    "no target": lambda d: d["spec"].pop("targetRefs"),
    "remove is not a list": lambda d: d["spec"]["headers"]["earlyRequestHeaders"].__setitem__("remove", "x-a"),
    "misspelled header filter": lambda d: d["spec"]["headers"]["earlyRequestHeaders"].__setitem__("delete", ["x"]),
    "old API version": lambda d: d.__setitem__("apiVersion", "gateway.envoyproxy.io/v1beta1"),
}


@pytest.mark.parametrize("plant", sorted(CTP_PLANTS))
def test_client_traffic_policy_contract_rejects_a_planted_error(plant: str) -> None:
    body = _doc("ClientTrafficPolicy", "pd-client-traffic")
    assert validate.client_traffic_policy_problems(body) == []
    CTP_PLANTS[plant](body)
    assert validate.client_traffic_policy_problems(body) != []


# -------------------------------------------------- Prometheus Operator and GKE kinds (node validators)

NODE_PLANTS: dict[str, tuple[str, str, Mutation]] = {
    "ServiceMonitor port as a number": ("ServiceMonitor", "pd-decode",
                                        lambda d: d["spec"]["endpoints"][0].__setitem__("port", 9190)),
    "PodMonitor without endpoints list": ("PodMonitor", "pd-prefill",
                                          lambda d: d["spec"].__setitem__("podMetricsEndpoints", {"port": "http"})),
    "HealthCheckPolicy of an unknown type": ("HealthCheckPolicy", "pd-pool",
                                             lambda d: d["spec"]["default"]["config"].__setitem__("type", "HTTPX")),
    "GCPBackendPolicy timeout as text": ("GCPBackendPolicy", "pd-pool",
                                         lambda d: d["spec"]["default"].__setitem__("timeoutSec", "600s")),
}


@pytest.mark.parametrize("plant", sorted(NODE_PLANTS))
def test_node_validators_reject_a_planted_error(plant: str) -> None:
    kind, name, mutate = NODE_PLANTS[plant]
    body = _doc(kind, name)
    assert validate.gateway_api_problems([body]) == [[]]
    mutate(body)
    assert validate.gateway_api_problems([body]) != [[]]


def test_kustomize_refuses_a_broken_overlay(tmp_path: Path) -> None:
    """A patch of a field that is not there stops the render (and so the suite), never a silent skip."""
    overlay = tmp_path / "broken"
    overlay.mkdir()
    (overlay / "settings.yaml").write_text("apiVersion: v1\nkind: ConfigMap\nmetadata: {name: x}\ndata: {a: b}\n")
    (overlay / "kustomization.yaml").write_text(
        "resources: [settings.yaml]\npatches:\n  - target: {kind: ConfigMap, name: x}\n"
        "    patch: '[{op: remove, path: /data/nope}]'\n")
    with pytest.raises(validate.RenderError, match="broken"):
        validate.render_overlay(overlay)


def test_an_object_of_an_unknown_group_is_a_problem() -> None:
    doc = validate.Document(Path("planted.yaml"), 0, {"apiVersion": "gateway.envoyproxy.io/v1alpha1",
                                                      "kind": "EnvoyExtensionPolicy", "metadata": {"name": "x"}})
    assert validate.k8s_problems([doc])[doc.label] != []


# ------------------------------------------------------------------------------------------ Dockerfile

DOCKERFILE_PLANTS = {
    "runs as root": ("USER 10001:10001", "USER root"),  # the first: the server image's stage
    "default image runs as root": ("COPY --from=build /opt/envoy /opt/envoy\nUSER 10001:10001",
                                   "COPY --from=build /opt/envoy /opt/envoy\nUSER root"),
    "no healthcheck": ("HEALTHCHECK --interval", "# HEALTHCHECK --interval"),
    "unpinned base": ("ARG PYTHON_IMAGE=python:3.11.13-slim-bookworm", "ARG PYTHON_IMAGE=python:3.11-slim"),
    "compiler in the final image": ("USER 10001:10001",
                                    "RUN apt-get update && apt-get install -y gcc\nUSER 10001:10001"),
    "shell-form entrypoint": ('ENTRYPOINT ["pd-extproc"]', "ENTRYPOINT pd-extproc"),
    "single stage": ("FROM ${PYTHON_IMAGE} AS build", "# no build stage"),
}

# Each needs a registry even with a local base image (an air-gapped build).
REGISTRY_PLANTS = {
    "syntax directive": ("# Two images from this file", "# syntax=docker/dockerfile:1\n# Two images from this file"),
    "syntax directive, spaced and capitalised": ("# Two images from this file",
                                                 "#  Syntax = docker/dockerfile:1.4\n# Two images from this file"),
    "BUILDKIT_SYNTAX argument": ("ARG PYTHON_IMAGE=", "ARG BUILDKIT_SYNTAX=docker/dockerfile:1\nARG PYTHON_IMAGE="),
    "base named in FROM": ("FROM ${PYTHON_IMAGE}\n", "FROM python:3.11.13-slim-bookworm\n"),
    "COPY from an image": ("COPY --from=build /opt/envoy /opt/envoy",
                           "COPY --from=envoyproxy/envoy:v1.40.0 /usr/local/bin/envoy /opt/envoy/bin/envoy"),
    "RUN mounting an image": ("RUN groupadd", "RUN --mount=type=bind,from=busybox:1.36.1,target=/b groupadd"),
}


@pytest.mark.parametrize("plant", sorted(DOCKERFILE_PLANTS))
def test_dockerfile_lint_rejects_a_planted_error(plant: str) -> None:
    text = (validate.REPO / "Dockerfile").read_text()
    old, new = DOCKERFILE_PLANTS[plant]
    assert old in text
    assert dockerfile_lint.problems(text.replace(old, new, 1)) != []


@pytest.mark.parametrize("plant", sorted(REGISTRY_PLANTS))
def test_dockerfile_lint_rejects_what_needs_a_registry(plant: str) -> None:
    text = (validate.REPO / "Dockerfile").read_text()
    old, new = REGISTRY_PLANTS[plant]
    assert old in text
    assert dockerfile_lint.registry_problems(text) == []
    planted = dockerfile_lint.registry_problems(text.replace(old, new, 1))
    assert len(planted) == 1, planted
    assert planted[0] in dockerfile_lint.problems(text.replace(old, new, 1))


def test_a_syntax_line_below_the_first_comment_is_no_directive() -> None:
    """BuildKit reads directives only up to the first line that is not one (ParseDirectives), so this
    is a comment: no frontend is pulled and the lint agrees."""
    text = (validate.REPO / "Dockerfile").read_text()
    first, rest = text.split("\n", 1)
    planted = f"{first}\n# syntax=docker/dockerfile:1\n{rest}"
    assert dockerfile_lint.directives(planted) == {}
    assert dockerfile_lint.problems(planted) == []
