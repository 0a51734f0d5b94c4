"""The kustomize package (k8s/base, k8s/components, k8s/overlays): what each overlay sets reaches every
object that needs it, in what `kubectl kustomize` renders (deploy/validate.py renders; the schemas are
checked in test_validation.py, the wiring in test_consistency.py for every overlay too)."""

from __future__ import annotations

import ipaddress
from typing import Any

import pytest

from deploy import validate
from extproc._version import __version__
from extproc.config import Settings
from extproc.protocol.units import parse_size
from tests.deploy.conftest import OVERLAYS, Manifests
from tests.deploy.test_consistency import provider

pytestmark = pytest.mark.deploy

VLLM_DEPLOYMENTS = ("pd-decode", "pd-prefill")
# Headers only the picker may set (llm-d-router v0.10.0 pkg/common/routing/common.go).
PICKER_HEADERS = {"x-prefiller-host-port", "x-encoder-hosts-ports", "x-kv-cache-source-host-port",
                  "x-data-parallel-rank"}


def test_every_gateway_provider_has_an_overlay() -> None:
    assert {overlay.name for overlay in OVERLAYS} == {"envoy-gateway", "istio", "gke", "none", "example"}


def _namespace(manifests: Manifests) -> str:
    [namespace] = manifests.of_kind("Namespace")
    name: str = namespace["metadata"]["name"]
    return name


def test_everything_lives_in_the_overlays_namespace(manifests: Manifests) -> None:
    namespace = _namespace(manifests)
    for doc in manifests.docs:
        if doc.body["kind"] != "Namespace":
            assert doc.body["metadata"]["namespace"] == namespace, doc.label
    [binding] = manifests.of_kind("RoleBinding")
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "pd-epp", "namespace": namespace}]
    # The picker watches the pool in its own namespace: NAMESPACE from the downward API, no fixed flag
    # (llm-d-router v0.10.0 cmd/epp/runner/runner.go, resolvePoolNamespace).
    epp = manifests.container("pd-epp", "epp")
    assert not any(arg.startswith("--pool-namespace") for arg in epp["args"])
    assert {"name": "NAMESPACE", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}} in epp["env"]


def test_the_example_overlay_moves_the_namespace() -> None:
    example = Manifests(validate.render_overlay(validate.K8S_OVERLAYS / "example"))
    assert _namespace(example) == "llm-prod"


def _model_source(manifests: Manifests, deployment: str) -> dict[str, Any]:
    env = manifests.container(deployment, "vllm")["env"]
    source: dict[str, Any] = next(e for e in env if e["name"] == "MODEL")["valueFrom"]["configMapKeyRef"]
    return source


def test_the_model_is_set_in_one_place(manifests: Manifests) -> None:
    sources = [_model_source(manifests, name) for name in VLLM_DEPLOYMENTS]
    assert sources[0] == sources[1]
    model = manifests.get("ConfigMap", sources[0]["name"])["data"][sources[0]["key"]]
    for name in VLLM_DEPLOYMENTS:
        assert "--model=$(MODEL)" in manifests.container(name, "vllm")["args"]
    assert model == ("Qwen/Qwen3-8B" if manifests.name == "example" else "Qwen/Qwen3-0.6B")


def test_the_image_is_the_release(manifests: Manifests) -> None:
    image = manifests.container("pd-decode", "pd-extproc")["image"]
    expected = "registry.example.com/llm/pd-extproc-server" if manifests.name == "example" else "pd-extproc-server"
    assert image == f"{expected}:{__version__}"


def _gpus(container: dict[str, Any]) -> tuple[str, str]:
    resources = container["resources"]
    return resources["requests"]["nvidia.com/gpu"], resources["limits"]["nvidia.com/gpu"]


def test_tensor_parallelism_matches_the_gpus_requested(manifests: Manifests) -> None:
    for name in VLLM_DEPLOYMENTS:
        vllm = manifests.container(name, "vllm")
        sizes = [arg.split("=", 1)[1] for arg in vllm["args"] if arg.startswith("--tensor-parallel-size=")]
        assert len(sizes) <= 1
        tp = int(sizes[0]) if sizes else 1
        assert _gpus(vllm) == (str(tp), str(tp)), name
        if manifests.name == "example":
            assert tp == 2
            tolerations = manifests.pod(name)["tolerations"]
            assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in tolerations


def test_the_picker_survives_one_pod_going(manifests: Manifests) -> None:
    deployment = manifests.get("Deployment", "pd-epp")
    assert deployment["spec"]["replicas"] >= 2
    pdb = manifests.get("PodDisruptionBudget", "pd-epp")["spec"]
    assert pdb["selector"]["matchLabels"].items() <= deployment["spec"]["template"]["metadata"]["labels"].items()
    assert 1 <= pdb["minAvailable"] < deployment["spec"]["replicas"]
    assert deployment["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"] == 0
    assert manifests.get("InferencePool", "pd-pool")["spec"]["endpointPickerRef"]["failureMode"] == "FailClose"


def test_envoy_gateway_accepts_what_decode_accepts_and_strips_the_pickers_headers(
        manifests: Manifests, k8s_settings: Settings) -> None:
    policies = manifests.of_kind("ClientTrafficPolicy")
    if provider(manifests) != "gateway-envoy-gateway":
        assert policies == []
        return
    [policy] = policies
    spec = policy["spec"]
    assert spec["targetRefs"] == [{"group": "gateway.networking.k8s.io", "kind": "Gateway", "name": "pd-gateway"}]
    limit = spec["connection"]["bufferLimit"]  # a Kubernetes quantity: 32Mi
    assert parse_size(limit.replace("Mi", "MiB").replace("Ki", "KiB").replace("Gi", "GiB")) >= \
        k8s_settings.max_request_bytes
    assert set(spec["headers"]["earlyRequestHeaders"]["remove"]) == PICKER_HEADERS


def test_gke_health_checks_the_pool_port(manifests: Manifests) -> None:
    pool = manifests.get("InferencePool", "pd-pool")
    checks = manifests.of_kind("HealthCheckPolicy")
    if provider(manifests) != "gateway-gke":
        assert checks == [] and manifests.of_kind("GCPBackendPolicy") == []
        return
    ref = {"group": "inference.networking.k8s.io", "kind": "InferencePool", "name": "pd-pool"}
    [check] = checks
    assert check["spec"]["targetRef"] == ref
    assert check["spec"]["default"]["config"]["httpHealthCheck"] == {
        "requestPath": "/health", "port": pool["spec"]["targetPorts"][0]["number"]}
    assert manifests.get("GCPBackendPolicy", "pd-pool")["spec"]["targetRef"] == ref


def _service_ports(service: dict[str, Any]) -> set[str]:
    return {port["name"] for port in service["spec"]["ports"]}


def test_monitors_scrape_named_ports_of_what_they_select(manifests: Manifests) -> None:
    monitors = manifests.of_kind("ServiceMonitor")
    if manifests.name != "example":
        assert monitors == [] and manifests.of_kind("PodMonitor") == []
        return
    services = manifests.of_kind("Service")
    for monitor in monitors:
        selector = monitor["spec"]["selector"]["matchLabels"]
        [service] = [s for s in services if selector.items() <= s["metadata"]["labels"].items()]
        assert {e["port"] for e in monitor["spec"]["endpoints"]} <= _service_ports(service), monitor
        assert monitor["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    assert {m["metadata"]["name"] for m in monitors} == {"pd-decode", "pd-epp"}
    [pods] = manifests.of_kind("PodMonitor")
    prefill = manifests.get("Deployment", "pd-prefill")["spec"]["template"]
    assert pods["spec"]["selector"]["matchLabels"].items() <= prefill["metadata"]["labels"].items()
    vllm_ports = {p["name"] for p in manifests.container("pd-prefill", "vllm")["ports"]}
    assert {e["port"] for e in pods["spec"]["podMetricsEndpoints"]} <= vllm_ports


def test_the_gateway_proxies_are_trusted_sources(manifests: Manifests, k8s_settings: Settings) -> None:
    """The peers that reach both Envoy and the picker are the gateway's proxies: the ones that set
    x-prefiller-host-port. An address range among them must be inside PD_EXTPROC_TRUSTED_SOURCES, or
    Envoy refuses their P/D requests (403 prefill_target_forbidden)."""
    envoy_peers = manifests.get("NetworkPolicy", "pd-decode")["spec"]["ingress"][0]["from"]
    picker_rules = manifests.get("NetworkPolicy", "pd-epp")["spec"]["ingress"]
    proxies = [peer for rule in picker_rules for peer in rule["from"] if peer in envoy_peers]
    for peer in proxies:
        if "ipBlock" in peer:
            block = ipaddress.ip_network(peer["ipBlock"]["cidr"])
            assert any(block.subnet_of(trusted) for trusted in k8s_settings.trusted_sources  # type: ignore[arg-type]
                       if trusted.version == block.version), peer
    assert bool(proxies) == (provider(manifests) != "")
