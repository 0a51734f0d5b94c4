"""k8s/gateway-mode (docs/gateway-chains.md): every kustomize folder renders, every object it renders passes
its schema, and the gateway's ext_proc configuration agrees with the pd-extproc container it calls."""

from __future__ import annotations

import copy
import hashlib
from collections.abc import Callable
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import yaml

from deploy import crd_schema, validate
from deploy import render_manifests as rm
from deploy.envfile import read_env_file
from extproc.config import ENVOY_MESSAGE_MARGIN, load_settings
from extproc.envoy.guard import lua_source, stripped_headers
from extproc.envoy.parts import GATEWAY_STATUS_ON_ERROR, early_header_mutation, gateway_local_reply_mappers
from extproc.protocol.errors import SPEC, Code, error_body
from extproc.protocol.headers import DATA_PARALLEL_RANKS, PICKER_HEADERS
from extproc.protocol.settings_spec import positive_size
from extproc.protocol.units import parse_address, parse_duration

pytestmark = pytest.mark.deploy

GATEWAY_MODE = validate.K8S_DIR / "gateway-mode"
ISTIO = GATEWAY_MODE / "istio"
SETTINGS_FILE = GATEWAY_MODE / "core" / "pd-extproc.env"
# GIE's endpoint picker protocol (docs/proposals/004-endpoint-picker-protocol/README.md @ v1.6.0).
DESTINATION_HEADER = "x-gateway-destination-endpoint"
# Envoy's ext_proc default message timeout (ext_proc.proto): far below any prefill leg.
ENVOY_DEFAULT_MESSAGE_TIMEOUT = 0.2
ISTIO_ROUTER = "envoy.filters.http.router"
ISTIO_PICKER_FILTER = "envoy.filters.http.ext_proc"  # pilot/pkg/xds/filters/filters.go @ 1.28.0
# pd-extproc's statusOnError, which the route's responseOverride (Envoy Gateway) or the local-reply mappers
# (Istio, --parts) turn into our JSON 503: one value for every gateway shape.
UNREACHABLE_MARK = GATEWAY_STATUS_ON_ERROR


class Rendered:
    """One kustomize folder's objects, by kind and name (the generated ConfigMap by its prefix too)."""

    def __init__(self, docs: list[validate.Document]):
        self.docs = docs
        self.index = {(d.body["kind"], d.body["metadata"]["name"]): d.body for d in docs}

    def get(self, kind: str, name: str) -> dict[str, Any]:
        return self.index[(kind, name)]

    def kinds(self) -> set[tuple[str, str]]:
        return {(validate.api_group(d.body), d.body["kind"]) for d in self.docs}

    def container(self, deployment: str, name: str) -> dict[str, Any]:
        pod = self.get("Deployment", deployment)["spec"]["template"]["spec"]
        return next(c for c in pod["containers"] if c["name"] == name)

    def settings_configmap(self) -> dict[str, Any]:
        found = [d.body for d in self.docs if d.body["kind"] == "ConfigMap"
                 and d.body["metadata"]["name"].startswith("pd-extproc-gateway-settings")]
        assert len(found) == 1
        return found[0]


@cache
def rendered(root: Path) -> Rendered:
    return Rendered(validate.kustomize_documents(root))


@cache
def report(root: Path) -> dict[str, list[str]]:
    return validate.k8s_problems(rendered(root).docs)


_QUANTITY_FACTORS = {"": 1, "k": 10**3, "M": 10**6, "G": 10**9, "Ki": 2**10, "Mi": 2**20, "Gi": 2**30}


def _quantity_bytes(value: str | int) -> int:
    """A Kubernetes quantity of bytes as Envoy Gateway's bufferLimit takes it: 33Mi, 32M, 1048576."""
    text = str(value)
    digits = text.rstrip("kMGi")
    return int(digits) * _QUANTITY_FACTORS[text[len(digits):]]


def _env() -> dict[str, str]:
    return read_env_file(SETTINGS_FILE)


def _extprocs() -> list[dict[str, Any]]:
    extprocs: list[dict[str, Any]] = rendered(GATEWAY_MODE).get("EnvoyExtensionPolicy", "pd-extproc-chain")["spec"][
        "extProc"]
    return extprocs


def _service_port(objects: Rendered, service: str, port: int) -> dict[str, Any]:
    ports: list[dict[str, Any]] = objects.get("Service", service)["spec"]["ports"]
    return next(p for p in ports if p["port"] == port)


def _container_port(container: dict[str, Any], name_or_number: str | int) -> int:
    for port in container["ports"]:
        if name_or_number in (port["name"], port["containerPort"]):
            number: int = port["containerPort"]
            return number
    raise KeyError(name_or_number)


def _istio_patch(apply_to: str) -> dict[str, Any]:
    patches = rendered(ISTIO).get("EnvoyFilter", "pd-extproc")["spec"]["configPatches"]
    found = [p for p in patches if p["applyTo"] == apply_to]
    assert len(found) == 1
    patch: dict[str, Any] = found[0]
    return patch


# ------------------------------------------------------------------------------------------ rendering

ROOTS = [GATEWAY_MODE, ISTIO]


def test_every_kustomize_folder_under_k8s_is_rendered_and_no_file_of_them_is_read_alone() -> None:
    assert set(ROOTS) <= set(validate.kustomize_roots())
    assert not any(GATEWAY_MODE in path.parents for path in validate.k8s_files())


@pytest.mark.parametrize("root", ROOTS, ids=lambda p: str(p.relative_to(validate.K8S_DIR)))
def test_every_rendered_object_passes_its_schema(root: Path) -> None:
    assert {label: problems for label, problems in report(root).items() if problems} == {}
    assert len(report(root)) == len(rendered(root).docs)


def test_the_envoy_gateway_variant_has_every_kind_the_design_needs() -> None:
    assert {("apps", "Deployment"), ("", "Service"), ("policy", "PodDisruptionBudget"),
            ("autoscaling", "HorizontalPodAutoscaler"), ("", "ConfigMap"), ("networking.k8s.io", "NetworkPolicy"),
            ("gateway.networking.k8s.io", "Gateway"), ("gateway.networking.k8s.io", "HTTPRoute"),
            ("inference.networking.k8s.io", "InferencePool"), ("gateway.envoyproxy.io", "EnvoyExtensionPolicy"),
            ("gateway.envoyproxy.io", "BackendTrafficPolicy"),
            ("gateway.envoyproxy.io", "ClientTrafficPolicy")} <= rendered(GATEWAY_MODE).kinds()
    assert ("networking.istio.io", "EnvoyFilter") in rendered(ISTIO).kinds()


def _references(pod: dict[str, Any]) -> set[tuple[str, str]]:
    """The (kind, name) of every ConfigMap, Secret and ServiceAccount a pod spec needs to start (optional
    Secrets aside)."""
    refs: set[tuple[str, str]] = set()
    if "serviceAccountName" in pod:
        refs.add(("ServiceAccount", pod["serviceAccountName"]))
    for volume in pod.get("volumes", []):
        if "configMap" in volume:
            refs.add(("ConfigMap", volume["configMap"]["name"]))
    for container in pod["containers"] + pod.get("initContainers", []):
        for source in container.get("envFrom", []):
            if "configMapRef" in source:
                refs.add(("ConfigMap", source["configMapRef"]["name"]))
        for env in container.get("env", []):
            key_ref = env.get("valueFrom", {}).get("configMapKeyRef")
            if key_ref is not None:
                refs.add(("ConfigMap", key_ref["name"]))
    return refs


@pytest.mark.parametrize("root", ROOTS, ids=lambda p: str(p.relative_to(validate.K8S_DIR)))
def test_apply_k_is_the_whole_deployment(root: Path) -> None:
    """`kubectl apply -k` of a gateway-mode folder needs nothing applied by hand: the namespace, the
    prefill pods, the picker and every ConfigMap or ServiceAccount a pod reads are in its render."""
    objects = rendered(root)
    assert ("Namespace", "llm") in objects.index
    assert {("Deployment", name) for name in ("pd-prefill", "pd-epp", "pd-decode", "pd-extproc")} <= set(
        objects.index)
    for doc in objects.docs:
        if doc.body["kind"] == "Deployment":
            missing = _references(doc.body["spec"]["template"]["spec"]) - set(objects.index)
            assert missing == set(), (doc.body["metadata"]["name"], missing)
        if doc.body["kind"] != "Namespace":
            assert doc.body["metadata"]["namespace"] == "llm", doc.label


@pytest.mark.parametrize("root", ROOTS, ids=lambda p: str(p.relative_to(validate.K8S_DIR)))
def test_decode_and_prefill_serve_the_one_model(root: Path) -> None:
    objects = rendered(root)
    sources = [next(e for e in objects.container(name, "vllm")["env"] if e["name"] == "MODEL")["valueFrom"]
               for name in ("pd-decode", "pd-prefill")]
    assert sources[0] == sources[1] and sources[0]["configMapKeyRef"]["name"].startswith("pd-model-")


def test_the_shared_pieces_are_one_component_of_both_shapes() -> None:
    """The sidecar base and gateway mode take the namespace, prefill, picker and model from one place."""
    component = "prefill-and-picker"
    for kustomization in (validate.K8S_DIR / "base", GATEWAY_MODE / "core"):
        listed = yaml.safe_load((kustomization / "kustomization.yaml").read_text())["components"]
        assert [Path(c).name for c in listed] == [component]
    assert (validate.K8S_DIR / "components" / component / "kustomization.yaml").exists()


@pytest.mark.parametrize("root", ROOTS, ids=lambda p: str(p.relative_to(validate.K8S_DIR)))
def test_the_picker_admits_the_gateway(root: Path) -> None:
    objects = rendered(root)
    picker_labels = objects.get("Deployment", "pd-epp")["spec"]["template"]["metadata"]["labels"]
    gateway = objects.get("Gateway", "pd-gateway")
    peers = []
    for doc in objects.docs:
        spec = doc.body["spec"] if doc.body["kind"] == "NetworkPolicy" else None
        if spec is None or not spec["podSelector"]["matchLabels"].items() <= picker_labels.items():
            continue
        for rule in spec.get("ingress", []):
            if {"protocol": "TCP", "port": 9002} in rule.get("ports", []):
                peers += [peer["podSelector"]["matchLabels"] for peer in rule["from"]]
    # Each implementation's label on the Gateway's data-plane pods (network-policy.yaml's header).
    label = {"eg": "gateway.envoyproxy.io/owning-gateway-name",
             "istio": "gateway.networking.k8s.io/gateway-name"}[gateway["spec"]["gatewayClassName"]]
    assert {label: gateway["metadata"]["name"]} in peers


# ------------------------------------------------------------------------------- planted errors (CRDs)

def _set(path: tuple[str | int, ...], value: Any) -> Callable[[dict[str, Any]], None]:
    def mutate(body: dict[str, Any]) -> None:
        node: Any = body
        for key in path[:-1]:
            node = node[key]
        node[path[-1]] = value
    return mutate


CRD_PLANTS: dict[str, tuple[Path, str, str, Callable[[dict[str, Any]], None]]] = {
    "body mode not in the enum": (GATEWAY_MODE, "EnvoyExtensionPolicy", "pd-extproc-chain",
                                  _set(("spec", "extProc", 1, "processingMode", "request", "body"), "Bufered")),
    "message timeout not a duration": (GATEWAY_MODE, "EnvoyExtensionPolicy", "pd-extproc-chain",
                                       _set(("spec", "extProc", 1, "messageTimeout"), "65 seconds")),
    "status on error not an error": (GATEWAY_MODE, "EnvoyExtensionPolicy", "pd-extproc-chain",
                                     _set(("spec", "extProc", 1, "statusOnError"), 200)),
    "misspelled ext_proc field": (GATEWAY_MODE, "EnvoyExtensionPolicy", "pd-extproc-chain",
                                  _set(("spec", "extProc", 1, "failopen"), False)),
    "no endpoint override source": (GATEWAY_MODE, "BackendTrafficPolicy", "pd-decode-endpoint-override",
                                    _set(("spec", "loadBalancer", "endpointOverride", "extractFrom"), [])),
    "header removal not a list": (GATEWAY_MODE, "ClientTrafficPolicy", "pd-client-traffic",
                                  _set(("spec", "headers", "earlyRequestHeaders", "remove"), "x-prefiller-host-port")),
    "pool failure mode not in the enum": (GATEWAY_MODE, "InferencePool", "pd-pool",
                                          _set(("spec", "endpointPickerRef", "failureMode"), "FailClosed")),
    "envoy filter operation not in the enum": (ISTIO, "EnvoyFilter", "pd-extproc",
                                               _set(("spec", "configPatches", 0, "patch", "operation"), "INSERT")),
}


@pytest.mark.parametrize("plant", sorted(CRD_PLANTS))
def test_crd_schemas_reject_a_planted_error(plant: str) -> None:
    root, kind, name, mutate = CRD_PLANTS[plant]
    body = copy.deepcopy(rendered(root).get(kind, name))
    assert crd_schema.crd_problems(body) == []
    mutate(body)
    assert crd_schema.crd_problems(body) != []


def test_a_kind_without_a_committed_crd_is_a_problem() -> None:
    body = {"apiVersion": "gateway.envoyproxy.io/v1alpha1", "kind": "EnvoyPatchPolicy", "metadata": {"name": "x"}}
    assert crd_schema.crd_problems(body) != []


# ------------------------------------------------------------------ pd-extproc's settings and container

def test_the_settings_select_gateway_mode_and_the_rest_are_valid_settings() -> None:
    env = _env()
    assert env["PD_EXTPROC_MODE"] == "gateway"
    # PD_EXTPROC_MODE is the gateway-mode server's own setting; every other value must load as today.
    load_settings({k: v for k, v in env.items() if k != "PD_EXTPROC_MODE"})


def test_the_container_reads_the_generated_settings_configmap() -> None:
    objects = rendered(GATEWAY_MODE)
    container = objects.container("pd-extproc", "pd-extproc")
    configmap = objects.settings_configmap()
    assert container["envFrom"] == [{"configMapRef": {"name": configmap["metadata"]["name"]}}]
    assert configmap["data"] == _env()


def test_the_ext_proc_backend_reaches_the_port_pd_extproc_listens_on() -> None:
    objects = rendered(GATEWAY_MODE)
    backend = _extprocs()[1]["backendRefs"]
    assert len(backend) == 1 and backend[0].get("kind", "Service") == "Service"
    port = _service_port(objects, backend[0]["name"], backend[0]["port"])
    assert port["appProtocol"] == "kubernetes.io/h2c"
    container = objects.container("pd-extproc", "pd-extproc")
    listen = parse_address(_env()["PD_EXTPROC_GRPC_LISTEN"], allow_unix=True)
    assert not listen.is_unix and listen.host == "0.0.0.0"
    assert _container_port(container, port["targetPort"]) == listen.port
    selector = objects.get("Service", backend[0]["name"])["spec"]["selector"]
    labels = objects.get("Deployment", "pd-extproc")["spec"]["template"]["metadata"]["labels"]
    assert selector.items() <= labels.items()


def test_quantities_are_read_as_kubernetes_reads_them() -> None:
    assert [_quantity_bytes(q) for q in ("33Mi", "32M", 1048576, "2Gi")] == [33 << 20, 32_000_000, 1 << 20, 2 << 30]


def test_probes_and_metrics_use_the_metrics_listener() -> None:
    container = rendered(GATEWAY_MODE).container("pd-extproc", "pd-extproc")
    metrics = parse_address(_env()["PD_EXTPROC_METRICS_LISTEN"])
    assert _container_port(container, "metrics") == metrics.port
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        assert container[probe]["httpGet"]["port"] == "metrics"


def test_hpa_and_pdb_select_the_pd_extproc_deployment() -> None:
    objects = rendered(GATEWAY_MODE)
    deployment = objects.get("Deployment", "pd-extproc")
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    hpa = objects.get("HorizontalPodAutoscaler", "pd-extproc")["spec"]
    assert hpa["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": "pd-extproc"}
    assert 2 <= hpa["minReplicas"] <= hpa["maxReplicas"]
    pdb = objects.get("PodDisruptionBudget", "pd-extproc")["spec"]
    assert pdb["selector"]["matchLabels"].items() <= labels.items()
    assert pdb["minAvailable"] >= 1 and hpa["minReplicas"] > pdb["minAvailable"]


def test_the_grace_period_outlasts_the_drain() -> None:
    pod = rendered(GATEWAY_MODE).get("Deployment", "pd-extproc")["spec"]["template"]["spec"]
    container = pod["containers"][0]
    drain = parse_duration(_env()["PD_EXTPROC_DRAIN_TIMEOUT"])
    assert pod["terminationGracePeriodSeconds"] > container["lifecycle"]["preStop"]["sleep"]["seconds"] + drain


def test_decode_pods_run_the_engine_alone_on_the_pool_target_port() -> None:
    objects = rendered(GATEWAY_MODE)
    pod = objects.get("Deployment", "pd-decode")["spec"]["template"]["spec"]
    assert [c["name"] for c in pod["containers"]] == ["vllm"]
    vllm = pod["containers"][0]
    pool_port = objects.get("InferencePool", "pd-pool")["spec"]["targetPorts"][0]["number"]
    assert "--host=0.0.0.0" in vllm["args"] and f"--port={pool_port}" in vllm["args"]
    assert _container_port(vllm, "http") == pool_port


# ------------------------------------------------------------- Envoy Gateway: the chain and the route

def test_the_picker_runs_first_and_pd_extproc_second_on_the_same_route() -> None:
    objects = rendered(GATEWAY_MODE)
    policy = objects.get("EnvoyExtensionPolicy", "pd-extproc-chain")["spec"]
    assert policy["targetRefs"] == [{"group": "gateway.networking.k8s.io", "kind": "HTTPRoute", "name": "pd-route"}]
    picker, ours = _extprocs()
    pool = objects.get("InferencePool", "pd-pool")["spec"]["endpointPickerRef"]
    assert picker["backendRefs"] == [{"name": pool["name"], "port": pool["port"]["number"]}]
    assert ours["backendRefs"][0]["name"] == "pd-extproc"


def test_the_picker_is_configured_as_the_endpoint_picker_protocol_wants_it() -> None:
    picker = _extprocs()[0]
    pool = rendered(GATEWAY_MODE).get("InferencePool", "pd-pool")["spec"]["endpointPickerRef"]
    # full-duplex streaming both ways; fail closed as the pool says (FailOpen would let a client's
    # own header through unchecked).
    assert picker["processingMode"] == {"request": {"body": "FullDuplexStreamed"},
                                        "response": {"body": "FullDuplexStreamed"}}
    assert pool["failureMode"] == "FailClose" and picker["failOpen"] is False


def test_the_picker_backend_is_the_picker_service_of_k8s_epp(manifests: Any) -> None:
    picker = _extprocs()[0]["backendRefs"][0]
    service = manifests.get("Service", picker["name"])
    port = next(p for p in service["spec"]["ports"] if p["port"] == picker["port"])
    assert port["appProtocol"] == "kubernetes.io/h2c"


def test_the_policy_carries_the_client_guard_generated_from_its_source() -> None:
    """One source of truth: the Lua Envoy Gateway reads for pd-route is extproc/envoy/guard.py's."""
    objects = rendered(GATEWAY_MODE)
    policy = objects.get("EnvoyExtensionPolicy", "pd-extproc-chain")
    (lua,) = policy["spec"]["lua"]
    assert lua["type"] == "ValueRef" and lua["valueRef"]["kind"] == "ConfigMap" and lua["valueRef"]["group"] == ""
    assert eg_lua_source(objects, policy["metadata"]["namespace"], lua) == lua_source()
    assert "filterContext" not in lua


def test_envoy_gateway_runs_the_guard_before_both_ext_procs() -> None:
    """Lua sorts at 13 + index, ext_proc at 100 + index (httpfilters.go:131-134 @ v1.9.0): the guard reads the
    client's body before the picker, never pd-extproc's rewritten P/D body."""
    assert eg_filter_order(f"{LUA_FILTER}/envoyextensionpolicy/llm/p/lua/0") < eg_filter_order(
        f"{EXT_PROC_FILTER}/envoyextensionpolicy/llm/p/extproc/0")
    assert len(rendered(GATEWAY_MODE).get("EnvoyExtensionPolicy", "pd-extproc-chain")["spec"]["lua"]) < 100 - 13


def test_pd_extproc_processing_mode_is_the_sidecars() -> None:
    ours = _extprocs()[1]
    # request headers SEND and a BUFFERED body; no `response`: response headers SKIP, body NONE.
    assert ours["processingMode"] == {"request": {"body": "Buffered"}, "allowModeOverride": True}


def test_pd_extproc_failures_are_refused_never_passed_through() -> None:
    ours = _extprocs()[1]
    assert ours["failOpen"] is False
    assert ours["statusOnError"] == UNREACHABLE_MARK


def test_pd_extproc_unreachable_becomes_our_json_503_and_nothing_else_is_rewritten() -> None:
    """statusOnError marks Envoy's reply with a status no other local reply of the route has; the route's
    responseOverride turns exactly that (source Local: never an engine's answer) into our JSON error."""
    (override,) = rendered(GATEWAY_MODE).get("BackendTrafficPolicy", "pd-decode-endpoint-override")["spec"][
        "responseOverride"]
    assert override["match"] == {"statusCodes": [{"type": "Value", "value": UNREACHABLE_MARK}]}
    assert override["source"] == "Local"
    spec = SPEC[Code.PD_EXTPROC_UNAVAILABLE]
    assert override["response"] == {"statusCode": spec.status, "contentType": "application/json", "body": {
        "type": "Inline", "inline": error_body(Code.PD_EXTPROC_UNAVAILABLE).decode()}}
    assert "%" not in override["response"]["body"]["inline"]  # Envoy reads the body as a format string
    # Nothing pd-extproc or Envoy answers on its own uses the mark (a prefill engine's own 510 aside).
    assert UNREACHABLE_MARK not in {s.status for s in SPEC.values()}


def test_the_message_timeout_outlasts_the_prefill_deadline() -> None:
    timeout = parse_duration(_extprocs()[1]["messageTimeout"])
    deadline = parse_duration(_env()["PD_EXTPROC_PREFILL_DEADLINE"])
    assert timeout == deadline + ENVOY_MESSAGE_MARGIN
    assert timeout > ENVOY_DEFAULT_MESSAGE_TIMEOUT


def test_circuit_breakers_are_above_envoys_default_and_the_in_flight_limit() -> None:
    breaker = _extprocs()[1]["backendSettings"]["circuitBreaker"]
    inflight = int(_env()["PD_EXTPROC_MAX_INFLIGHT"])
    for field in ("maxConnections", "maxPendingRequests", "maxParallelRequests"):
        assert breaker[field] > 1024 and breaker[field] >= inflight


def test_the_gateway_buffers_a_body_as_large_as_pd_extproc_accepts() -> None:
    policy = rendered(GATEWAY_MODE).get("ClientTrafficPolicy", "pd-client-traffic")["spec"]
    assert _quantity_bytes(policy["connection"]["bufferLimit"]) > positive_size(_env()["PD_EXTPROC_MAX_REQUEST_BYTES"])


def test_a_clients_picker_headers_are_removed_before_any_filter() -> None:
    objects = rendered(GATEWAY_MODE)
    policy = objects.get("ClientTrafficPolicy", "pd-client-traffic")["spec"]
    route = objects.get("HTTPRoute", "pd-route")["spec"]
    gateway = route["parentRefs"][0]["name"]
    assert policy["targetRefs"] == [{"group": "gateway.networking.k8s.io", "kind": "Gateway", "name": gateway}]
    removed = set(policy["headers"]["earlyRequestHeaders"]["remove"])
    assert PICKER_HEADERS | {"x-data-parallel-rank", DESTINATION_HEADER} <= removed
    # Everything the drop-in parts remove early, the engines' steering headers included (only pd-extproc
    # may send one to an engine).
    parts = {m["remove"] for m in early_header_mutation()["typed_config"]["mutations"]}
    assert parts <= removed and set(stripped_headers()) <= removed
    assert "x-data-parallel-rank" in DATA_PARALLEL_RANKS



@pytest.mark.parametrize("root", ROOTS, ids=lambda p: str(p.relative_to(validate.K8S_DIR)))
def test_the_route_removes_the_picker_headers_before_decode_and_nothing_else(root: Path) -> None:
    # Gateway API's RequestHeaderModifier is the route's request_headers_to_remove, applied by the
    # router after every filter: the picker and pd-extproc have read them; decode must not see them.
    (rule,) = rendered(root).get("HTTPRoute", "pd-route")["spec"]["rules"]
    (header_filter,) = rule["filters"]
    assert header_filter["type"] == "RequestHeaderModifier"
    assert set(header_filter["requestHeaderModifier"]) == {"remove"}
    removed = header_filter["requestHeaderModifier"]["remove"]
    assert len(removed) == len(set(removed)) and set(removed) == PICKER_HEADERS


def test_the_decode_leg_goes_to_the_endpoint_the_picker_named() -> None:
    objects = rendered(GATEWAY_MODE)
    policy = objects.get("BackendTrafficPolicy", "pd-decode-endpoint-override")["spec"]
    assert policy["targetRefs"] == [{"group": "gateway.networking.k8s.io", "kind": "HTTPRoute", "name": "pd-route"}]
    assert policy["loadBalancer"]["endpointOverride"]["extractFrom"] == [{"header": DESTINATION_HEADER}]
    (rule,) = objects.get("HTTPRoute", "pd-route")["spec"]["rules"]
    assert rule["timeouts"] == {"request": "0s"}
    (backend,) = rule["backendRefs"]
    decode = objects.get("Service", backend["name"])["spec"]
    pool = objects.get("InferencePool", "pd-pool")["spec"]
    # The Service's endpoints are the pool's decode pods on the pool's port: the picked endpoint is one.
    assert pool["selector"]["matchLabels"].items() <= decode["selector"].items()
    assert decode["selector"]["llm-d.ai/role"] == "decode"
    port = _service_port(objects, backend["name"], backend["port"])
    assert _container_port(objects.container("pd-decode", "vllm"), port["targetPort"]) == pool["targetPorts"][0][
        "number"]


def test_the_pool_is_the_sidecar_modes_pool() -> None:
    """Gateway mode's pool is the one the sidecar package's Envoy Gateway overlay renders (same namespace)."""
    sidecar = rendered(validate.K8S_OVERLAYS / "envoy-gateway").get("InferencePool", "pd-pool")
    for root in ROOTS:
        assert rendered(root).get("InferencePool", "pd-pool") == sidecar


# ---------------------------------------------------------------------- Istio: the same filter settings

def test_istio_inserts_pd_extproc_before_the_router_after_the_picker() -> None:
    patch = _istio_patch("HTTP_FILTER")
    assert patch["match"]["context"] == "GATEWAY"
    assert patch["match"]["listener"]["filterChain"]["filter"]["subFilter"] == {"name": ISTIO_ROUTER}
    assert patch["patch"]["operation"] == "INSERT_BEFORE"
    # Not the picker's name: Istio's per-route picker config is keyed by it.
    assert patch["patch"]["value"]["name"] != ISTIO_PICKER_FILTER
    selector = rendered(ISTIO).get("EnvoyFilter", "pd-extproc")["spec"]["workloadSelector"]["labels"]
    assert selector == {"gateway.networking.k8s.io/gateway-name": rendered(ISTIO).get("Gateway", "pd-gateway")[
        "metadata"]["name"]}


def test_istios_ext_proc_settings_match_envoy_gateways() -> None:
    config = _istio_patch("HTTP_FILTER")["patch"]["value"]["typed_config"]
    ours = _extprocs()[1]
    assert config["failure_mode_allow"] is False and ours["failOpen"] is False
    # The same mark in both: Istio's mappers, like Envoy Gateway's responseOverride, turn it into our JSON 503.
    assert config["status_on_error"] == {"code": UNREACHABLE_MARK}
    assert ours["statusOnError"] == UNREACHABLE_MARK
    assert parse_duration(config["message_timeout"]) == parse_duration(ours["messageTimeout"])
    assert config["allow_mode_override"] is ours["processingMode"]["allowModeOverride"]
    assert config["processing_mode"] == {"request_header_mode": "SEND", "request_body_mode": "BUFFERED",
                                         "request_trailer_mode": "SKIP", "response_header_mode": "SKIP",
                                         "response_body_mode": "NONE", "response_trailer_mode": "SKIP"}


def test_istios_cluster_name_is_the_pd_extproc_services_outbound_cluster() -> None:
    config = _istio_patch("HTTP_FILTER")["patch"]["value"]["typed_config"]
    service = rendered(ISTIO).get("Service", "pd-extproc")
    port = next(p for p in service["spec"]["ports"] if p["name"] == "grpc")
    meta = service["metadata"]
    # model.BuildSubsetKey(TrafficDirectionOutbound, "", host, port) (pilot/pkg/model/service.go).
    assert config["grpc_service"]["envoy_grpc"]["cluster_name"] == (
        f"outbound|{port['port']}||{meta['name']}.{meta['namespace']}.svc.cluster.local")


def test_istio_removes_the_same_headers_early_and_buffers_the_same_body() -> None:
    hcm = _istio_patch("NETWORK_FILTER")["patch"]["value"]["typed_config"]
    (early,) = hcm["early_header_mutation_extensions"]
    removed = {m["remove"] for m in early["typed_config"]["mutations"]}
    ctp = rendered(GATEWAY_MODE).get("ClientTrafficPolicy", "pd-client-traffic")["spec"]
    assert removed == set(ctp["headers"]["earlyRequestHeaders"]["remove"])
    listener = _istio_patch("LISTENER")["patch"]["value"]
    assert listener["per_connection_buffer_limit_bytes"] == _quantity_bytes(ctp["connection"]["bufferLimit"])


def _istio_patched_bootstrap(envoy_filter: dict[str, Any]) -> str:
    """A bootstrap holding exactly what the EnvoyFilter patches in (its values are Envoy's own protos,
    which the CRD leaves unchecked), so that Envoy itself validates them."""
    patches = {p["applyTo"]: p["patch"]["value"] for p in envoy_filter["spec"]["configPatches"]}
    ext_proc = patches["HTTP_FILTER"]
    cluster = ext_proc["typed_config"]["grpc_service"]["envoy_grpc"]["cluster_name"]
    hcm = {"@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3."
                    "HttpConnectionManager",
           "stat_prefix": "gateway",
           "route_config": {"virtual_hosts": [{"name": "all", "domains": ["*"],
                                               "routes": [{"match": {"prefix": "/"}, "route": {"cluster": cluster}}]}]},
           "http_filters": [ext_proc, {"name": "envoy.filters.http.router", "typed_config": {
               "@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"}}]}
    hcm.update({k: v for k, v in patches["NETWORK_FILTER"]["typed_config"].items() if k != "@type"})
    listener = {"name": "gateway", "address": {"socket_address": {"address": "127.0.0.1", "port_value": 0}},
                "filter_chains": [{"filters": [{"name": "envoy.filters.network.http_connection_manager",
                                                "typed_config": hcm}]}]}
    listener.update(patches["LISTENER"])
    bootstrap = {"static_resources": {
        "listeners": [listener],
        "clusters": [{"name": cluster, "type": "STATIC", "connect_timeout": "1s",
                      "typed_extension_protocol_options": {
                          "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                              "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
                              "explicit_http_config": {"http2_protocol_options": {}}}},
                      "load_assignment": {"cluster_name": cluster, "endpoints": [{"lb_endpoints": [{"endpoint": {
                          "address": {"socket_address": {"address": "127.0.0.1", "port_value": 50051}}}}]}]}}]}}
    return yaml.safe_dump(bootstrap, sort_keys=False)


def test_istios_patches_are_valid_envoy_config() -> None:
    envoy_filter = rendered(ISTIO).get("EnvoyFilter", "pd-extproc")
    assert validate.envoy_problems(_istio_patched_bootstrap(envoy_filter)) == []


@pytest.mark.parametrize(("apply_to", "path", "value"), [
    ("HTTP_FILTER", ("typed_config", "message_timeot"), "65s"),
    ("HTTP_FILTER", ("typed_config", "processing_mode", "request_body_mode"), "BUFFER"),
    ("NETWORK_FILTER", ("typed_config", "early_header_mutation_extensions", 0, "typed_config", "mutations", 0),
     {"remov": "x-prefiller-host-port"}),
])
def test_envoy_rejects_a_planted_error_in_istios_patches(apply_to: str, path: tuple[str | int, ...],
                                                         value: Any) -> None:
    envoy_filter = copy.deepcopy(rendered(ISTIO).get("EnvoyFilter", "pd-extproc"))
    patch = next(p for p in envoy_filter["spec"]["configPatches"] if p["applyTo"] == apply_to)
    _set(path, value)(patch["patch"]["value"])
    assert validate.envoy_problems(_istio_patched_bootstrap(envoy_filter)) != []


@pytest.mark.parametrize("path", sorted(crd_schema.CRD_DIR.rglob("*.yaml")), ids=lambda p: p.name)
def test_every_committed_crd_is_recorded_with_its_hash(path: Path) -> None:
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    sources = (crd_schema.CRD_DIR.parent / "SOURCES.md").read_text()
    assert f"`{digest[:8]}…{digest[-4:]}`" in sources
    assert path.parent.name.rsplit("-", 1)[-1].lstrip("v") in sources  # the version in the folder name


# ------------------------------------------------------------------------------ the kustomize tooling

def test_a_kustomization_that_does_not_build_is_an_error_naming_it(tmp_path: Path) -> None:
    (tmp_path / "kustomization.yaml").write_text("resources:\n  - missing.yaml\n")
    with pytest.raises(ValueError, match="kubectl kustomize"):
        validate.kustomize_documents(tmp_path)


# ------------------------------------------- what Envoy Gateway renders from these objects, on Envoy 1.40

# Envoy Gateway v1.9.0's translation, read in its source (docs/gateway-chains.md has the lines):
# body modes (internal/xds/translator/extproc.go translateExtProcBodyProcessingMode), filter and
# cluster names (perRouteFilterName; the goldens' envoyextensionpolicy/<ns>/<name>/<index>/<service>),
# the route name (internal/gatewayapi/helpers.go:550, `*` without hostname) and the 10s gRPC timeout
# it always sets (extproc.go:105).
_EG_BODY_MODES = {"Buffered": "BUFFERED", "BufferedPartial": "BUFFERED_PARTIAL", "Streamed": "STREAMED",
                  "FullDuplexStreamed": "FULL_DUPLEX_STREAMED"}


def _eg_processing_mode(mode: dict[str, Any]) -> dict[str, str]:
    """extproc.go buildProcessingMode: everything SKIP/NONE, then what `request`/`response` ask for."""
    out = {"request_header_mode": "SKIP", "response_header_mode": "SKIP", "request_body_mode": "NONE",
           "response_body_mode": "NONE", "request_trailer_mode": "SKIP", "response_trailer_mode": "SKIP"}
    for side in ("request", "response"):
        if side in mode:
            out[f"{side}_header_mode"] = "SEND"
            body = _EG_BODY_MODES[mode[side]["body"]] if "body" in mode[side] else "NONE"
            out[f"{side}_body_mode"] = body
            if body == "FULL_DUPLEX_STREAMED":
                out[f"{side}_trailer_mode"] = "SEND"
    return out


def _static_cluster(name: str, port: int, http2: bool) -> dict[str, Any]:
    cluster: dict[str, Any] = {"name": name, "type": "STATIC", "connect_timeout": "10s", "load_assignment": {
        "cluster_name": name, "endpoints": [{"lb_endpoints": [{"endpoint": {"address": {"socket_address": {
            "address": "127.0.0.1", "port_value": port}}}}]}]}}
    if http2:
        cluster["typed_extension_protocol_options"] = {"envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
            "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
            "explicit_http_config": {"http2_protocol_options": {}}}}
    return cluster


LUA_FILTER = "envoy.filters.http.lua"
EXT_PROC_FILTER = "envoy.filters.http.ext_proc"
CUSTOM_RESPONSE_FILTER = "envoy.filters.http.custom_response"


def eg_filter_order(name: str) -> int:
    """Envoy Gateway's sort key for the filters this shape has (internal/xds/translator/httpfilters.go:101-102,
    131-134, 159 @ v1.9.0: custom_response 0, Lua 13 + index, ext_proc 100 + index, the index being the
    name's last segment, :356; the router 310), ties broken by name (:175-176)."""
    if name.startswith(CUSTOM_RESPONSE_FILTER):
        return 0
    index = int(name.rsplit("/", 1)[-1]) if "/" in name else 0
    if name.startswith(LUA_FILTER):
        return 13 + index
    if name.startswith(EXT_PROC_FILTER):
        return 100 + index
    assert name == "envoy.filters.http.router", name
    return 310


_STATUS_INPUT = {"name": "http-response-status-code-match-input", "typed_config": {
    "@type": "type.googleapis.com/envoy.type.matcher.v3.HttpResponseStatusCodeMatchInput"}}
_LOCAL_REPLY_INPUT = {"name": "http-response-local-reply-match-input", "typed_config": {
    "@type": "type.googleapis.com/envoy.type.matcher.v3.HttpResponseLocalReplyMatchInput"}}


def eg_custom_response(ns: str, policy: str, overrides: list[dict[str, Any]]) -> dict[str, Any]:
    """A BackendTrafficPolicy's responseOverride as Envoy Gateway renders it (internal/xds/translator/
    custom_response.go @ v1.9.0: one filter per policy, disabled in the HCM, :81-102; rules in order, a
    status Value as an exact match on the status input, :270-318; `source` Local/Backend ANDs the local-reply
    input, :139-147, :369-403; the response as a LocalResponsePolicy, :561-590). Only what this shape uses."""
    matchers = []
    for index, override in enumerate(overrides):
        (code,) = override["match"]["statusCodes"]
        assert code["type"] == "Value" and "responseHeaders" not in override["match"]
        predicates = [{"single_predicate": {"input": _STATUS_INPUT, "value_match": {"exact": str(code["value"])}}}]
        if override.get("source", "All") != "All":
            predicates.append({"single_predicate": {"input": _LOCAL_REPLY_INPUT, "value_match": {
                "exact": "true" if override["source"] == "Local" else "false"}}})
        response = override["response"]
        assert response["body"]["type"] == "Inline"
        action = {"@type": "type.googleapis.com/envoy.extensions.http.custom_response.local_response_policy.v3."
                           "LocalResponsePolicy",
                  "body_format": {"text_format": response["body"]["inline"]},
                  "response_headers_to_add": [{"header": {"key": "Content-Type", "value": response["contentType"]},
                                               "append_action": "OVERWRITE_IF_EXISTS_OR_ADD"}],
                  "status_code": response["statusCode"]}
        matchers.append({
            "predicate": predicates[0] if len(predicates) == 1 else {"and_matcher": {"predicate": predicates}},
            "on_match": {"action": {"name": f"backendtrafficpolicy/{ns}/{policy}/responseoverride/rule/{index}",
                                    "typed_config": action}}})
    return {"name": f"{CUSTOM_RESPONSE_FILTER}/backendtrafficpolicy/{ns}/{policy}", "disabled": True,
            "typed_config": {"@type": "type.googleapis.com/envoy.extensions.filters.http.custom_response.v3."
                                      "CustomResponse",
                             "custom_response_matcher": {"matcher_list": {"matchers": matchers}}}}


def eg_lua_source(objects: Rendered, namespace: str, lua: dict[str, Any]) -> str:
    """A Lua entry's code as Envoy Gateway reads it (envoyextensionpolicy.go buildLua, :1342-1392: inline, or
    the ConfigMap's key `lua`, else its first value)."""
    if lua.get("type", "Inline") == "Inline":
        return str(lua["inline"])
    configmap = objects.get("ConfigMap", lua["valueRef"]["name"])
    assert configmap["metadata"]["namespace"] == namespace
    data: dict[str, str] = configmap["data"]
    return data["lua"] if "lua" in data else next(iter(data.values()))


def envoy_gateway_shape(objects: Rendered) -> dict[str, Any]:
    """The listener, route and clusters Envoy Gateway renders for pd-route with these policies (by hand,
    after its translator; endpoints are placeholders)."""
    policy = objects.get("EnvoyExtensionPolicy", "pd-extproc-chain")
    ns, name = policy["metadata"]["namespace"], policy["metadata"]["name"]
    route = objects.get("HTTPRoute", "pd-route")
    (rule,) = route["spec"]["rules"]
    route_name = f"httproute/{ns}/{route['metadata']['name']}/rule/0/match/0/*"
    backend_cluster = f"httproute/{ns}/{route['metadata']['name']}/rule/0"
    filters, clusters, enable = [], [], {}
    # Lua (internal/xds/translator/lua.go @ v1.9.0): one filter per entry named <type>/<policy>/lua/<index>
    # (:94-96, envoyextensionpolicy.go:1544), disabled in the connection manager (:85-91), enabled on the
    # route by an empty FilterConfig when the entry has no filterContext (:137-142).
    for index, lua in enumerate(policy["spec"].get("lua", [])):
        filter_name = f"{LUA_FILTER}/envoyextensionpolicy/{ns}/{name}/lua/{index}"
        filters.append({"name": filter_name, "disabled": True, "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.lua.v3.Lua",
            "default_source_code": {"inline_string": eg_lua_source(objects, ns, lua)}}})
        enable[filter_name] = {"@type": "type.googleapis.com/envoy.config.route.v3.FilterConfig", "config": {}}
    for index, ext in enumerate(policy["spec"]["extProc"]):
        filter_name = f"envoy.filters.http.ext_proc/envoyextensionpolicy/{ns}/{name}/extproc/{index}"
        (ref,) = ext["backendRefs"]
        cluster = f"envoyextensionpolicy/{ns}/{name}/{index}/{ref['name']}"
        config: dict[str, Any] = {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor",
            "grpc_service": {"envoy_grpc": {"cluster_name": cluster, "authority": f"{ref['name']}.{ns}:{ref['port']}"},
                             "timeout": "10s"},
            "processing_mode": _eg_processing_mode(ext["processingMode"]),
            "failure_mode_allow": ext["failOpen"], "message_timeout": ext["messageTimeout"],
            "allow_mode_override": ext["processingMode"].get("allowModeOverride", False)}
        if "statusOnError" in ext:
            config["status_on_error"] = {"code": ext["statusOnError"]}
        filters.append({"name": filter_name, "disabled": True, "typed_config": config})
        enable[filter_name] = {"@type": "type.googleapis.com/envoy.config.route.v3.FilterConfig", "config": {}}
        clusters.append(_static_cluster(cluster, ref["port"], http2=True))
    traffic = objects.get("BackendTrafficPolicy", "pd-decode-endpoint-override")
    if "responseOverride" in traffic["spec"]:
        custom = eg_custom_response(ns, traffic["metadata"]["name"], traffic["spec"]["responseOverride"])
        filters.append(custom)
        enable[custom["name"]] = {"@type": "type.googleapis.com/envoy.config.route.v3.FilterConfig", "config": {}}
    override = traffic["spec"]["loadBalancer"]
    decode = _static_cluster(backend_cluster, rule["backendRefs"][0]["port"], http2=False)
    decode["load_balancing_policy"] = {"policies": [{"typed_extension_config": {
        "name": "envoy.load_balancing_policies.override_host", "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.load_balancing_policies.override_host.v3.OverrideHost",
            "override_host_sources": [{"header": s["header"]} for s in override["endpointOverride"]["extractFrom"]],
            "fallback_policy": {"policies": [{"typed_extension_config": {
                "name": "envoy.load_balancing_policies.least_request", "typed_config": {
                    "@type": "type.googleapis.com/envoy.extensions.load_balancing_policies.least_request.v3."
                             "LeastRequest"}}}]}}}}]}
    client = objects.get("ClientTrafficPolicy", "pd-client-traffic")["spec"]
    hcm = {"@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3."
                    "HttpConnectionManager",
           "stat_prefix": "http",
           "early_header_mutation_extensions": [{
               "name": "envoy.http.early_header_mutation.header_mutation", "typed_config": {
                   "@type": "type.googleapis.com/envoy.extensions.http.early_header_mutation.header_mutation.v3."
                            "HeaderMutation",
                   "mutations": [{"remove": h} for h in client["headers"]["earlyRequestHeaders"]["remove"]]}}],
           "route_config": {"virtual_hosts": [{"name": "all", "domains": ["*"], "routes": [{
               "name": route_name, "match": {"path_separated_prefix": rule["matches"][0]["path"]["value"].rstrip("/")},
               "route": {"cluster": backend_cluster, "timeout": "0s"},
               "request_headers_to_remove": rule["filters"][0]["requestHeaderModifier"]["remove"],
               "typed_per_filter_config": enable}]}]},
           "http_filters": sorted([*filters, {"name": "envoy.filters.http.router", "typed_config": {
               "@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"}}],
               key=lambda f: (eg_filter_order(f["name"]), f["name"]))}
    listener = {"name": f"{ns}/{route['spec']['parentRefs'][0]['name']}/http",
                "address": {"socket_address": {"address": "127.0.0.1", "port_value": 0}},
                "per_connection_buffer_limit_bytes": _quantity_bytes(client["connection"]["bufferLimit"]),
                "default_filter_chain": {"filters": [{"name": "envoy.filters.network.http_connection_manager",
                                                      "typed_config": hcm}]}}
    return {"static_resources": {"listeners": [listener], "clusters": [*clusters, decode]}}


def test_what_envoy_gateway_renders_from_these_objects_is_a_valid_envoy_config() -> None:
    bootstrap = envoy_gateway_shape(rendered(GATEWAY_MODE))
    names = [f["name"] for f in bootstrap["static_resources"]["listeners"][0]["default_filter_chain"]["filters"][0][
        "typed_config"]["http_filters"]]
    assert names[-1] == "envoy.filters.http.router" and names[0].startswith(CUSTOM_RESPONSE_FILTER + "/")
    assert [n.rsplit("/", 2)[-2:] for n in names[1:-1]] == [["lua", "0"], ["extproc", "0"], ["extproc", "1"]]
    assert validate.envoy_problems(yaml.safe_dump(bootstrap, sort_keys=False)) == []


def test_envoy_rejects_the_shape_with_a_planted_error() -> None:
    objects = rendered(GATEWAY_MODE)
    broken = copy.deepcopy(objects.get("EnvoyExtensionPolicy", "pd-extproc-chain"))
    broken["spec"]["extProc"][1]["messageTimeout"] = "-1s"
    planted = Rendered([validate.Document(d.path, d.index, broken if d.body["kind"] == "EnvoyExtensionPolicy"
                                          else d.body) for d in objects.docs])
    assert validate.envoy_problems(yaml.safe_dump(envoy_gateway_shape(planted), sort_keys=False)) != []


# ------------------------------------------- what Istio 1.28 renders + these EnvoyFilters, on Envoy 1.40

# istio/istio @ b8d1df54465060428c2a2a38286e360beb85fb31 (1.28.0); docs/gateway-chains.md has the lines.
ISTIO_GRPC_STATS = "envoy.filters.http.grpc_stats"  # pkg/wellknown/wellknown.go:55
ISTIO_FAULT, ISTIO_CORS = "envoy.filters.http.fault", "envoy.filters.http.cors"
ISTIO_LB_NAMESPACE, ISTIO_ENDPOINT_HINT = "envoy.lb", DESTINATION_HEADER  # pkg/config/constants/constants.go:216,218


def istio_outbound_cluster(name: str, namespace: str, port: int) -> str:
    """model.BuildSubsetKey(TrafficDirectionOutbound, "", host, port) (pilot/pkg/model/service.go:1595-1596)."""
    return f"outbound|{port}||{name}.{namespace}.svc.cluster.local"


def istio_envoy_filters(objects: Rendered) -> list[dict[str, Any]]:
    return [d.body for d in objects.docs if d.body["kind"] == "EnvoyFilter"]


def istio_base_gateway(objects: Rendered) -> dict[str, Any]:
    """Istio's gateway listener for pd-gateway before any EnvoyFilter, by hand after its source: the HTTP
    filters of a Gateway with an InferencePool (listener_builder.go:395-456: authn/authz/Wasm filters, none
    here; the picker's inert ext_proc, xds/filters/filters.go:170-196; grpc_stats :119-129; fault, cors
    :101-112; Telemetry's istio.stats, not in upstream Envoy, left out; the router), the route of the
    HTTPRoute rule (route/route.go:488-547: its name, the picker enabled by ExtProcPerRoute overrides; the
    rule's header removal), and the pool's cluster with override_host on the picker's envoy.lb metadata
    (networking/core/cluster.go:363-365, cluster_builder.go:208-267). Endpoints are placeholders."""
    route = objects.get("HTTPRoute", "pd-route")
    ns = route["metadata"]["namespace"]
    (rule,) = route["spec"]["rules"]
    pool = objects.get("InferencePool", "pd-pool")["spec"]
    picker = pool["endpointPickerRef"]
    picker_cluster = istio_outbound_cluster(picker["name"], ns, picker["port"]["number"])
    # The pool's shadow Service (Istio names it <pool>-ip-<hash>; the hash is not computed here).
    pool_cluster = istio_outbound_cluster("pd-pool-ip-shadow", ns, pool["targetPorts"][0]["number"])
    duplex = "FULL_DUPLEX_STREAMED"
    picker_route = {"@type": "type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExtProcPerRoute",
                    "overrides": {"failure_mode_allow": picker["failureMode"] == "FailOpen",
                                  "grpc_service": {"envoy_grpc": {"cluster_name": picker_cluster}},
                                  "processing_mode": {"request_header_mode": "SEND", "request_body_mode": duplex,
                                                      "request_trailer_mode": "SEND", "response_header_mode": "SEND",
                                                      "response_body_mode": duplex, "response_trailer_mode": "SEND"}}}
    lb = {"untyped": [ISTIO_LB_NAMESPACE]}
    filters = [
        {"name": ISTIO_PICKER_FILTER, "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor",
            "grpc_service": {"envoy_grpc": {"cluster_name": "dummy"}, "timeout": "10s"},
            "failure_mode_allow": True, "message_timeout": "1000s",
            "processing_mode": {"request_header_mode": "SKIP", "response_header_mode": "SKIP"},
            "metadata_options": {"receiving_namespaces": lb, "forwarding_namespaces": lb}}},
        {"name": ISTIO_GRPC_STATS, "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.grpc_stats.v3.FilterConfig",
            "emit_filter_state": True, "stats_for_all_methods": False}},
        {"name": ISTIO_FAULT, "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.fault.v3.HTTPFault"}},
        {"name": ISTIO_CORS, "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.cors.v3.Cors"}},
        {"name": ISTIO_ROUTER, "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"}},
    ]
    hcm = {"@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3."
                    "HttpConnectionManager",
           "stat_prefix": "outbound_0.0.0.0_80",
           "route_config": {"name": "http.80", "virtual_hosts": [{"name": "*:80", "domains": ["*"], "routes": [{
               "name": rm.istio_route_name(),
               "match": {"prefix": rule["matches"][0]["path"]["value"]},
               "route": {"cluster": pool_cluster, "timeout": "0s"},
               "request_headers_to_remove": rule["filters"][0]["requestHeaderModifier"]["remove"],
               "typed_per_filter_config": {ISTIO_PICKER_FILTER: picker_route}}]}]},
           "http_filters": filters}
    decode = _static_cluster(pool_cluster, pool["targetPorts"][0]["number"], http2=False)
    decode["lb_policy"] = "CLUSTER_PROVIDED"
    decode["load_balancing_policy"] = {"policies": [{"typed_extension_config": {
        "name": "envoy.load_balancing_policies.override_host", "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.load_balancing_policies.override_host.v3.OverrideHost",
            "override_host_sources": [{"metadata": {"key": ISTIO_LB_NAMESPACE,
                                                    "path": [{"key": ISTIO_ENDPOINT_HINT}]}}],
            "fallback_policy": {"policies": [{"typed_extension_config": {
                "name": "envoy.load_balancing_policies.round_robin", "typed_config": {
                    "@type": "type.googleapis.com/envoy.extensions.load_balancing_policies.round_robin.v3."
                             "RoundRobin"}}}]}}}}]}
    listener = {"name": "0.0.0.0_80", "address": {"socket_address": {"address": "127.0.0.1", "port_value": 0}},
                "filter_chains": [{"filters": [{"name": "envoy.filters.network.http_connection_manager",
                                                "typed_config": hcm}]}]}
    pd_extproc = objects.get("Service", "pd-extproc")
    grpc_port = next(p for p in pd_extproc["spec"]["ports"] if p["name"] == "grpc")["port"]
    clusters = [_static_cluster(picker_cluster, picker["port"]["number"], http2=True),
                _static_cluster(istio_outbound_cluster("pd-extproc", ns, grpc_port), grpc_port, http2=True),
                decode]
    return {"static_resources": {"listeners": [listener], "clusters": clusters}}


def _proto_merge(dst: dict[str, Any], src: dict[str, Any]) -> None:
    """A proto merge on the JSON form: messages merged field by field, repeated fields appended, scalars
    replaced (istio pkg/proto/merge/merge.go:60-125)."""
    for key, value in src.items():
        if isinstance(value, dict) and isinstance(dst.get(key), dict):
            _proto_merge(dst[key], value)
        elif isinstance(value, list) and isinstance(dst.get(key), list):
            dst[key] = dst[key] + copy.deepcopy(value)
        else:
            dst[key] = copy.deepcopy(value)


def apply_istio_patches(bootstrap: dict[str, Any], envoy_filters: list[dict[str, Any]]) -> dict[str, Any]:
    """The EnvoyFilters' GATEWAY patches as Istio applies them to a finished listener (envoyfilter/
    listener_patch.go @ 1.28.0): LISTENER MERGE first, then per network filter its NETWORK_FILTER MERGE
    (:393-431), then the HTTP_FILTER patches in order (:450-516), INSERT_BEFORE at the first filter of exactly
    that name (:479-493, :758-766, util.go:33-52) and nothing when none matches. Only what these patches use."""
    out = copy.deepcopy(bootstrap)
    (listener,) = out["static_resources"]["listeners"]
    (chain,) = listener["filter_chains"]
    (hcm_filter,) = chain["filters"]
    patches = [p for f in envoy_filters for p in f["spec"]["configPatches"]]
    for patch in patches:
        assert patch["match"]["context"] == "GATEWAY"
        assert patch["patch"]["operation"] in ("MERGE", "INSERT_BEFORE"), patch["patch"]["operation"]
    for patch in (p for p in patches if p["applyTo"] == "LISTENER"):
        _proto_merge(listener, patch["patch"]["value"])
    for patch in (p for p in patches if p["applyTo"] == "NETWORK_FILTER"):
        assert patch["match"]["listener"]["filterChain"]["filter"]["name"] == hcm_filter["name"]
        _proto_merge(hcm_filter, patch["patch"]["value"])
    http_filters = hcm_filter["typed_config"]["http_filters"]
    for patch in (p for p in patches if p["applyTo"] == "HTTP_FILTER"):
        anchor = patch["match"]["listener"]["filterChain"]["filter"]["subFilter"]["name"]
        index = next((i for i, f in enumerate(http_filters) if f["name"] == anchor), None)
        if index is not None:
            http_filters.insert(index, copy.deepcopy(patch["patch"]["value"]))
    return out


def istio_gateway_shape(objects: Rendered, reverse: bool = False) -> dict[str, Any]:
    """pd-gateway's listener after k8s/gateway-mode/istio's EnvoyFilters (same priority: Istio orders them by
    creation time, push_context.go:2303-2319, unknown here; ``reverse`` applies them the other way round)."""
    filters = istio_envoy_filters(objects)
    return apply_istio_patches(istio_base_gateway(objects), filters[::-1] if reverse else filters)


def _istio_http_filters(bootstrap: dict[str, Any]) -> list[str]:
    hcm = bootstrap["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    return [f["name"] for f in hcm["http_filters"]]


def test_istio_runs_the_guard_before_the_picker_and_pd_extproc_after_it() -> None:
    objects = rendered(ISTIO)
    ours = _istio_patch("HTTP_FILTER")["patch"]["value"]["name"]
    expected = [rm.ISTIO_GUARD_FILTER, ISTIO_PICKER_FILTER, ISTIO_GRPC_STATS, ISTIO_FAULT, ISTIO_CORS, ours,
                ISTIO_ROUTER]
    for reverse in (False, True):
        assert _istio_http_filters(istio_gateway_shape(objects, reverse)) == expected


def test_istios_guard_is_the_generated_lua_and_each_envoy_filter_selects_the_gateway() -> None:
    objects = rendered(ISTIO)
    guard = objects.get("EnvoyFilter", "pd-client-guard")["spec"]
    (patch,) = guard["configPatches"]
    assert patch["applyTo"] == "HTTP_FILTER" and patch["patch"]["operation"] == "INSERT_BEFORE"
    assert patch["match"]["listener"]["filterChain"]["filter"]["subFilter"] == {"name": ISTIO_PICKER_FILTER}
    value = patch["patch"]["value"]
    assert value["typed_config"]["default_source_code"]["inline_string"] == lua_source()
    # Its own name: neither the picker's (Istio's route override is keyed by it) nor a plain Lua filter's.
    assert value["name"] not in (ISTIO_PICKER_FILTER, LUA_FILTER) and "disabled" not in value
    selector = objects.get("EnvoyFilter", "pd-extproc")["spec"]["workloadSelector"]
    for envoy_filter in istio_envoy_filters(objects):
        assert envoy_filter["spec"]["workloadSelector"] == selector
        assert envoy_filter["metadata"]["namespace"] == objects.get("Gateway", "pd-gateway")["metadata"]["namespace"]


def test_istios_local_replies_are_the_parts_mappers_scoped_to_the_inference_route() -> None:
    """Istio names the rule's route by the rule's own name (Istio 1.28 conversion.go convertHTTPRoute; without one,
    <namespace>.<route>.<index>); the mappers match only there, so the Gateway's other routes keep Envoy's own
    errors, and the name does not change with the namespace."""
    objects = rendered(ISTIO)
    route = objects.get("HTTPRoute", "pd-route")
    (rule,) = route["spec"]["rules"]
    assert rule["backendRefs"][0]["kind"] == "InferencePool"
    name = rule["name"]
    assert rm.istio_route_name() == name == "pd-inference"
    (patch,) = objects.get("EnvoyFilter", "pd-extproc-local-replies")["spec"]["configPatches"]
    assert patch["applyTo"] == "NETWORK_FILTER" and patch["patch"]["operation"] == "MERGE"
    mappers = patch["patch"]["value"]["typed_config"]["local_reply_config"]["mappers"]
    assert mappers == gateway_local_reply_mappers(name)
    for mapper in mappers:
        expression = mapper["filter"]["extension_filter"]["typed_config"]["expression"]
        assert expression.startswith(f"xds.route_name == '{name}' && (")
    # pd-extproc's own status_on_error is the mark the unavailable mapper reads (the picker's failures are not).
    ours = _istio_patch("HTTP_FILTER")["patch"]["value"]["typed_config"]
    assert ours["status_on_error"]["code"] == UNREACHABLE_MARK
    (unavailable,) = [m for m in mappers if m["body_format_override"]["json_format"]["error"]["code"]
                      == Code.PD_EXTPROC_UNAVAILABLE.value]
    assert f"response.code == {UNREACHABLE_MARK})" in unavailable["filter"]["extension_filter"]["typed_config"][
        "expression"] and unavailable["status_code"] == SPEC[Code.PD_EXTPROC_UNAVAILABLE].status


def test_the_generator_refuses_an_envoy_filter_whose_status_the_mappers_do_not_read(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """envoyfilter.yaml is hand-written and client-guard.yaml's mappers depend on its status_on_error: `make
    manifests` fails naming the file rather than render mappers that would label pd-extproc down a
    gateway_error."""
    planted = tmp_path / "envoyfilter.yaml"
    planted.write_text(rm.ISTIO_EXT_PROC.read_text().replace(f"status_on_error: {{code: {UNREACHABLE_MARK}}}",
                                                             "status_on_error: {code: 503}"))
    assert rm.istio_status_on_error(planted) == 503 and rm.istio_status_on_error() == UNREACHABLE_MARK
    monkeypatch.setattr(rm, "ISTIO_EXT_PROC", planted)
    with pytest.raises(ValueError, match=f"status_on_error is 503.*expect {UNREACHABLE_MARK}"):
        rm.istio_envoy_filters()


def test_what_istio_renders_with_these_envoy_filters_is_a_valid_envoy_config() -> None:
    bootstrap = istio_gateway_shape(rendered(ISTIO))
    assert validate.envoy_problems(yaml.safe_dump(bootstrap, sort_keys=False)) == []


@pytest.mark.parametrize("plant", ["lua syntax", "cel syntax"])
def test_envoy_rejects_a_planted_error_in_the_generated_envoy_filters(plant: str) -> None:
    filters = copy.deepcopy(istio_envoy_filters(rendered(ISTIO)))
    by_name = {f["metadata"]["name"]: f for f in filters}
    if plant == "lua syntax":
        value = by_name["pd-client-guard"]["spec"]["configPatches"][0]["patch"]["value"]
        value["typed_config"]["default_source_code"]["inline_string"] += "\nlocal = ("
    else:
        hcm = by_name["pd-extproc-local-replies"]["spec"]["configPatches"][0]["patch"]["value"]["typed_config"]
        hcm["local_reply_config"]["mappers"][0]["filter"]["extension_filter"]["typed_config"]["expression"] += " &&"
    bootstrap = apply_istio_patches(istio_base_gateway(rendered(ISTIO)), filters)
    assert validate.envoy_problems(yaml.safe_dump(bootstrap, sort_keys=False)) != []
