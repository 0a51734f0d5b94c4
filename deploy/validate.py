"""Offline validation of every deployment file in the repository.

    .venv/bin/python -m deploy.validate      # all checks; exit 1 on any problem

What is checked, and against what (sources and versions: deploy/schemas/SOURCES.md):
- Envoy bootstraps (envoy/*.yaml and Envoy configs inside k8s ConfigMaps): ``envoy --mode validate``
  with the Envoy the tests run.
- envoy/docker-compose.yaml and its GPU override envoy/docker-compose.gpu.yaml: the Compose
  Specification schema of docker compose v2.40.3 (deploy/schemas/compose-spec.json), then ``docker
  compose config`` of that same release, for every PD_ENGINE and for the GPU override merged in.
  (tests/compose also builds the image and brings the file up with a real container engine.)
- Kubernetes: what ``kubectl kustomize`` (kubectl 1.37.1 from PyPI, deploy/tools.py) renders from every
  overlay in k8s/overlays, object by object:
  - core kinds: kubernetes-validate's schemas, strict (unknown fields are errors), for every Kubernetes
    version in K8S_VERSIONS;
  - Gateway API, prometheus-operator (ServiceMonitor, PodMonitor) and GKE (HealthCheckPolicy,
    GCPBackendPolicy) kinds: the @kubernetes-models packages' schemas (Node.js from PyPI,
    deploy/schemas/gateway-api);
  - custom resources (InferencePool, Envoy Gateway's policies, Istio's EnvoyFilter): the released CRDs'
    schemas in deploy/schemas/crds (deploy/crd_schema.py), strictly; InferencePools also pass
    ``inference_pool_problems`` and ClientTrafficPolicies ``client_traffic_policy_problems``, contract
    checks of the fields these manifests rely on.
- Gateway mode (k8s/gateway-mode and its variants, each a kustomization): rendered the same way, every
  rendered object checked as above. Plain files elsewhere under k8s/ are validated one by one.
Each validator returns a list of problems (empty = valid), so tests can plant errors and see them.
"""

from __future__ import annotations

import contextlib
import json
import re
import subprocess
import sys
import tempfile
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jsonschema  # type: ignore[import-untyped]
import kubernetes_validate  # type: ignore[import-untyped]
import yaml
from kubernetes_validate.utils import SchemaNotFoundError  # type: ignore[import-untyped]

from deploy import crd_schema, tools
from deploy.render_manifests import COMPOSE_ENGINES, SETTINGS_CONFIGMAP
from extproc.config import load_settings
from extproc.envoy.bootstrap import render_yaml

REPO = tools.REPO
COMPOSE_FILE = REPO / "envoy" / "docker-compose.yaml"
COMPOSE_GPU_FILE = REPO / "envoy" / "docker-compose.gpu.yaml"
COMPOSE_SCHEMA = REPO / "deploy" / "schemas" / "compose-spec.json"
K8S_DIR = REPO / "k8s"
K8S_OVERLAYS = REPO / "k8s" / "overlays"
# The oldest Kubernetes the manifests need (the preStop `sleep` action is on by default from 1.30)
# and the newest kubernetes-validate 1.37.0 knows.
K8S_VERSIONS = ("1.30.0", "1.37.0")
GATEWAY_API_GROUPS = ("gateway.networking.k8s.io", "gateway.networking.x-k8s.io")
# Kinds the node validator knows (deploy/schemas/gateway-api/validate.mjs): Gateway API, Prometheus
# Operator, GKE.
NODE_GROUPS = (*GATEWAY_API_GROUPS, "monitoring.coreos.com", "networking.gke.io")
INFERENCE_GROUP = "inference.networking.k8s.io"
ENVOY_GATEWAY_GROUP = "gateway.envoyproxy.io"
TIMEOUT = 120


@dataclass(frozen=True, slots=True)
class Document:
    """One YAML document of a manifest file."""

    path: Path
    index: int
    body: dict[str, Any]

    @property
    def label(self) -> str:
        meta = self.body.get("metadata") or {}
        return f"{_rel(self.path)}#{self.index} {self.body.get('kind')}/{meta.get('name')}"


def _rel(path: Path) -> str:
    try:
        return str(path.relative_to(REPO))
    except ValueError:
        return str(path)


def load_documents(paths: Iterable[Path]) -> list[Document]:
    docs = []
    for path in paths:
        for index, body in enumerate(yaml.safe_load_all(path.read_text())):
            if body is None:
                continue
            if not isinstance(body, dict):
                raise ValueError(f"{_rel(path)}#{index}: not a mapping")
            docs.append(Document(path, index, body))
    return docs


# The kustomize package and gateway mode: validated as what they render, never file by file.
KUSTOMIZE_DIRS = ("base", "components", "overlays", "engine-overlays", "gateway-mode", "gateway-mode-examples")
GATEWAY_MODE = K8S_DIR / "gateway-mode"
GATEWAY_EXAMPLES = K8S_DIR / "gateway-mode-examples"  # adopters' overlays of gateway mode, one per gateway
ENGINE_OVERLAYS = K8S_DIR / "engine-overlays"  # sidecar mode with SGLang or TensorRT-LLM engines, one per engine
KUSTOMIZATION = "kustomization.yaml"


def k8s_files(directory: Path = K8S_DIR) -> list[Path]:
    """Plain manifests under k8s/ outside the kustomize package (validated as they are)."""
    return sorted(p for p in directory.rglob("*") if p.suffix in (".yaml", ".yml", ".json")
                  and p.relative_to(directory).parts[0] not in KUSTOMIZE_DIRS)


def overlays(directory: Path = K8S_OVERLAYS) -> list[Path]:
    """Every kustomize overlay (a directory with a kustomization.yaml)."""
    return sorted(p.parent for p in directory.glob("*/kustomization.yaml"))


def engine_overlays() -> list[Path]:
    """The sidecar overlays whose engines are not vLLM (k8s/engine-overlays/*)."""
    return overlays(ENGINE_OVERLAYS)


class RenderError(ValueError):
    """kubectl kustomize refused an overlay; the message is its error."""


_RENDERED: dict[Path, list[Document]] = {}


def render_overlay(overlay: Path) -> list[Document]:
    """The objects ``kubectl kustomize`` renders from an overlay (cached: the files do not change in a run)."""
    if overlay not in _RENDERED:
        result = subprocess.run([str(tools.kubectl_bin()), "kustomize", str(overlay)], capture_output=True,
                                text=True, timeout=TIMEOUT, check=False)
        if result.returncode != 0:
            raise RenderError(f"kubectl kustomize {_rel(overlay)}: {result.stderr.strip()}")
        bodies = [body for body in yaml.safe_load_all(result.stdout) if body is not None]
        _RENDERED[overlay] = [Document(overlay, index, body) for index, body in enumerate(bodies)]
    return list(_RENDERED[overlay])


def kustomize_roots(directory: Path = GATEWAY_MODE) -> list[Path]:
    """Gateway mode's kustomize folders (each holds a kustomization.yaml)."""
    return sorted(p.parent for p in directory.rglob(KUSTOMIZATION))


def kustomize_documents(root: Path) -> list[Document]:
    """``kubectl kustomize ROOT``: the objects that ``kubectl apply -k ROOT`` would send."""
    return render_overlay(root)


def k8s_documents() -> list[Document]:
    """Every object every overlay and gateway-mode folder renders, and the plain manifests beside them."""
    roots = overlays() + engine_overlays() + kustomize_roots() + kustomize_roots(GATEWAY_EXAMPLES)
    rendered = [doc for root in roots for doc in render_overlay(root)]
    return rendered + load_documents(k8s_files())


# ---------------------------------------------------------------------------------------------- Envoy

def is_envoy_bootstrap(text: str) -> bool:
    try:
        body = yaml.safe_load(text)
    except yaml.YAMLError:
        return False
    return isinstance(body, dict) and "static_resources" in body


def decode_settings(docs: Sequence[Mapping[str, Any]]) -> dict[str, str]:
    """The PD_EXTPROC_* variables a rendered overlay gives the decode pod: the data of the ConfigMap its
    pd-extproc container reads (kustomize's hashed ``pd-extproc-settings-<hash>``)."""
    by_name = {(d["kind"], d["metadata"]["name"]): d for d in docs}
    pod = by_name[("Deployment", "pd-decode")]["spec"]["template"]["spec"]
    container = next(c for c in pod["containers"] if c["name"] == "pd-extproc")
    name = container["envFrom"][0]["configMapRef"]["name"]
    if not name.startswith(SETTINGS_CONFIGMAP):
        raise ValueError(f"pd-decode's pd-extproc reads {name}, not {SETTINGS_CONFIGMAP}")
    data: dict[str, str] = by_name[("ConfigMap", name)]["data"]
    return data


def envoy_configs(compose_dir: Path = REPO / "envoy") -> dict[str, str]:
    """Every Envoy bootstrap the repository ships, by label: the compose files, and for each sidecar overlay
    what its decode pods' init container renders (``pd-extproc envoy-config`` on that overlay's settings)."""
    found = {}
    for path in sorted(compose_dir.glob("*.yaml")):
        text = path.read_text()
        if is_envoy_bootstrap(text):
            found[_rel(path)] = text
    for overlay in overlays() + engine_overlays():
        env = decode_settings([doc.body for doc in render_overlay(overlay)])
        with _mounted_secrets(env) as settings_env:
            found[f"{_rel(overlay)} (init container envoy-config)"] = render_yaml(load_settings(settings_env, {}))
    return found


# Settings that name a file a Secret mounts in the pod: they must exist when the settings load.
_SECRET_FILE_SETTINGS = ("PD_EXTPROC_TRTLLM_AUTH_KEY_FILE",)


@contextlib.contextmanager
def _mounted_secrets(env: Mapping[str, str]) -> Iterator[dict[str, str]]:
    """``env`` with each Secret-mounted file replaced by a stand-in, as the pod would have it."""
    with tempfile.TemporaryDirectory() as tmp:
        out = dict(env)
        for name in _SECRET_FILE_SETTINGS:
            if out.get(name):
                stand_in = Path(tmp) / name
                stand_in.write_text("stand-in key")
                out[name] = str(stand_in)
        yield out


def envoy_problems(text: str) -> list[str]:
    with tempfile.TemporaryDirectory(prefix="pd-envoy-validate-") as tmp:
        path = Path(tmp) / "envoy.yaml"
        path.write_text(text)
        result = subprocess.run([tools.envoy_bin(), "--mode", "validate", "-c", str(path), "--log-level", "warn"],
                                capture_output=True, text=True, timeout=TIMEOUT, check=False)
    if result.returncode == 0:
        return []
    output = (result.stderr + result.stdout).strip().splitlines()
    return [f"envoy --mode validate exited {result.returncode}: " + " | ".join(output[-5:])]


# -------------------------------------------------------------------------------------------- Compose

def compose_schema_problems(body: Any) -> list[str]:
    schema = json.loads(COMPOSE_SCHEMA.read_text())
    validator = jsonschema.Draft7Validator(schema)
    errors = sorted(validator.iter_errors(body), key=lambda e: list(e.absolute_path))
    return [f"{'.'.join(str(p) for p in e.absolute_path) or '<root>'}: {e.message}" for e in errors]


def compose_tool_problems(path: Path, *overrides: Path, env: Mapping[str, str] | None = None) -> list[str]:
    """``docker compose config`` of a file (with override files merged in, and variables such as
    PD_ENGINE set): the schema plus Compose's own checks (references, interpolation, env files)."""
    binary = tools.compose_bin()
    files = [arg for file in (path, *overrides) for arg in ("-f", str(file))]
    result = subprocess.run([str(binary), *files, "config", "--quiet"], cwd=path.parent,
                            capture_output=True, text=True, timeout=TIMEOUT, check=False,
                            env={"PATH": "/usr/bin:/bin", "HOME": str(path.parent), **(env or {})})
    if result.returncode == 0:
        return []
    return [f"docker compose config exited {result.returncode}: {(result.stderr + result.stdout).strip()}"]


# ----------------------------------------------------------------------------------------- Kubernetes

def api_group(body: Mapping[str, Any]) -> str:
    api_version = str(body.get("apiVersion", ""))
    return api_version.rpartition("/")[0] if "/" in api_version else ""


def is_core(body: Mapping[str, Any]) -> bool:
    group = api_group(body)
    return "." not in group or (group.endswith(".k8s.io") and group not in (*GATEWAY_API_GROUPS, INFERENCE_GROUP))


def core_problems(body: dict[str, Any], versions: Sequence[str] = K8S_VERSIONS) -> list[str]:
    problems = []
    for version in versions:
        try:
            kubernetes_validate.validate(body, version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            where = ".".join(str(p) for p in exc.path) or "<root>"
            problems.append(f"Kubernetes {version}: {where}: {exc.message}")
        except SchemaNotFoundError as exc:
            problems.append(f"Kubernetes {version}: {exc.message}")
    return problems


def gateway_api_problems(bodies: Sequence[Mapping[str, Any]]) -> list[list[str]]:
    """Problems per object, in order, from the pinned @kubernetes-models schemas (one node process):
    Gateway API, Prometheus Operator and GKE kinds."""
    if not bodies:
        return []
    script = tools.gateway_api_validator()
    result = subprocess.run([str(tools.node_bin()), str(script)], input=json.dumps(list(bodies)), capture_output=True,
                            text=True, timeout=TIMEOUT, check=False, cwd=script.parent)
    if result.returncode not in (0, 1):
        raise RuntimeError(f"gateway-api validator failed: {result.stderr.strip()}")
    answers = json.loads(result.stdout)
    return [[f"{api_group(body)} schema: {e}" for e in answer["errors"]] for body, answer in zip(bodies, answers,
                                                                                               strict=True)]


_DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")
_POOL_SPEC_KEYS = {"selector", "targetPorts", "endpointPickerRef"}
_PICKER_KEYS = {"group", "kind", "name", "port", "failureMode"}


def _port_problem(value: Any, where: str) -> list[str]:
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 65535:
        return [f"{where}: expected a port number 1-65535, got {value!r}"]
    return []


def inference_pool_problems(body: Mapping[str, Any]) -> list[str]:
    """Contract check of an InferencePool (NOT the upstream CRD schema, which is not available offline).

    Checks the fields these manifests rely on, as GIE v1 defines them: apiVersion, a DNS-label name,
    spec.selector.matchLabels (non-empty string map), spec.targetPorts (non-empty list of
    {number: 1-65535}), spec.endpointPickerRef (name, port.number, failureMode FailOpen|FailClose);
    unknown spec keys are refused.
    """
    problems: list[str] = []
    if body.get("apiVersion") != f"{INFERENCE_GROUP}/v1" or body.get("kind") != "InferencePool":
        return [f"InferencePool contract: expected {INFERENCE_GROUP}/v1 InferencePool"]
    name = (body.get("metadata") or {}).get("name")
    if not isinstance(name, str) or not _DNS_LABEL.fullmatch(name):
        problems.append("metadata.name: expected a DNS label")
    spec = body.get("spec")
    if not isinstance(spec, dict):
        return [*problems, "spec: expected a mapping"]
    problems.extend(f"spec.{key}: unknown field" for key in sorted(set(spec) - _POOL_SPEC_KEYS))
    labels = (spec.get("selector") or {}).get("matchLabels") if isinstance(spec.get("selector"), dict) else None
    if not isinstance(labels, dict) or not labels or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in labels.items()):
        problems.append("spec.selector.matchLabels: expected a non-empty map of strings")
    ports = spec.get("targetPorts")
    if not isinstance(ports, list) or not ports:
        problems.append("spec.targetPorts: expected a non-empty list")
    else:
        for i, port in enumerate(ports):
            if not isinstance(port, dict) or set(port) != {"number"}:
                problems.append(f"spec.targetPorts[{i}]: expected {{number: N}}")
            else:
                problems.extend(_port_problem(port["number"], f"spec.targetPorts[{i}].number"))
    picker = spec.get("endpointPickerRef")
    if not isinstance(picker, dict):
        problems.append("spec.endpointPickerRef: expected a mapping")
    else:
        problems.extend(f"spec.endpointPickerRef.{key}: unknown field" for key in sorted(set(picker) - _PICKER_KEYS))
        if not isinstance(picker.get("name"), str) or not _DNS_LABEL.fullmatch(picker["name"]):
            problems.append("spec.endpointPickerRef.name: expected a DNS label")
        port = picker.get("port")
        if not isinstance(port, dict) or set(port) != {"number"}:
            problems.append("spec.endpointPickerRef.port: expected {number: N}")
        else:
            problems.extend(_port_problem(port["number"], "spec.endpointPickerRef.port.number"))
        if picker.get("failureMode", "FailClose") not in ("FailOpen", "FailClose"):
            problems.append("spec.endpointPickerRef.failureMode: expected FailOpen or FailClose")
    return [f"InferencePool contract: {p}" for p in problems]


# Envoy Gateway v1.9.0 (tag commit 39763b1c07ec30a5526fe70434a2cfe4181de642), api/v1alpha1:
# ClientTrafficPolicySpec (clienttrafficpolicy_types.go) with PolicyTargetReferences inlined
# (policy_helpers.go); HeaderSettings (clienttrafficpolicy_types.go); ClientConnection (connection_types.go:
# bufferLimit is a resource.Quantity with the pattern below); HTTPHeaderFilter (shared_types.go).
_CTP_SPEC_KEYS = {"targetRef", "targetRefs", "targetSelectors", "tcpKeepalive", "enableProxyProtocol", "proxyProtocol",
                  "clientIPDetection", "tls", "path", "headers", "timeout", "connection", "http1", "http2", "http3",
                  "grpc", "healthCheck", "scheme"}
_CTP_HEADER_KEYS = {"enableEnvoyHeaders", "disableRateLimitHeaders", "xForwardedClientCert", "withUnderscoresAction",
                    "preserveXRequestID", "requestID", "earlyRequestHeaders", "lateResponseHeaders"}
_CTP_CONNECTION_KEYS = {"connectionLimit", "bufferLimit", "socketBufferLimit", "maxAcceptPerSocketEvent"}
_HEADER_FILTER_KEYS = {"set", "add", "addIfAbsent", "remove"}
_QUANTITY = re.compile(r"[1-9]+[0-9]*([EPTGMK]i|[EPTGMk])?")
_HEADER_NAME = re.compile(r"[A-Za-z0-9!#$%&'*+\-.^_`|~]+")  # gwapiv1.HTTPHeaderName


def client_traffic_policy_problems(body: Mapping[str, Any]) -> list[str]:
    """Contract check of an Envoy Gateway ClientTrafficPolicy: the fields we rely on (its CRD schema is checked
    too, by crd_schema.crd_problems).

    Checks: apiVersion gateway.envoyproxy.io/v1alpha1; spec keys known to v1.9.0; targetRefs (the only way
    we target: a non-empty list of {group: gateway.networking.k8s.io, kind: Gateway, name}, the CRD's CEL
    rules); connection keys, bufferLimit's pattern; headers keys, earlyRequestHeaders' keys, remove a list
    of 1-64 header names.
    """
    problems: list[str] = []
    if body.get("apiVersion") != f"{ENVOY_GATEWAY_GROUP}/v1alpha1" or body.get("kind") != "ClientTrafficPolicy":
        return [f"ClientTrafficPolicy contract: expected {ENVOY_GATEWAY_GROUP}/v1alpha1 ClientTrafficPolicy"]
    spec = body.get("spec")
    if not isinstance(spec, dict):
        return ["ClientTrafficPolicy contract: spec: expected a mapping"]
    problems.extend(f"spec.{key}: unknown field" for key in sorted(set(spec) - _CTP_SPEC_KEYS))
    refs = spec.get("targetRefs")
    if not isinstance(refs, list) or not refs:
        problems.append("spec.targetRefs: expected a non-empty list")
    else:
        for i, ref in enumerate(refs):
            if not isinstance(ref, dict) or set(ref) - {"group", "kind", "name", "sectionName"}:
                problems.append(f"spec.targetRefs[{i}]: expected {{group, kind, name[, sectionName]}}")
            elif (ref.get("group"), ref.get("kind")) != ("gateway.networking.k8s.io", "Gateway") or \
                    not isinstance(ref.get("name"), str) or not _DNS_LABEL.fullmatch(ref["name"]):
                problems.append(f"spec.targetRefs[{i}]: expected a Gateway (group gateway.networking.k8s.io) by name")
    connection = spec.get("connection", {})
    if not isinstance(connection, dict):
        problems.append("spec.connection: expected a mapping")
    else:
        problems.extend(f"spec.connection.{key}: unknown field"
                        for key in sorted(set(connection) - _CTP_CONNECTION_KEYS))
        limit = connection.get("bufferLimit")
        if limit is not None and not _QUANTITY.fullmatch(str(limit)):
            problems.append(f"spec.connection.bufferLimit: {limit!r} does not match {_QUANTITY.pattern}")
    headers = spec.get("headers", {})
    if not isinstance(headers, dict):
        problems.append("spec.headers: expected a mapping")
    else:
        problems.extend(f"spec.headers.{key}: unknown field" for key in sorted(set(headers) - _CTP_HEADER_KEYS))
        early = headers.get("earlyRequestHeaders", {})
        if not isinstance(early, dict):
            problems.append("spec.headers.earlyRequestHeaders: expected a mapping")
        else:
            problems.extend(f"spec.headers.earlyRequestHeaders.{key}: unknown field"
                            for key in sorted(set(early) - _HEADER_FILTER_KEYS))
            remove = early.get("remove")
            if remove is not None and (not isinstance(remove, list) or not 1 <= len(remove) <= 64 or not all(
                    isinstance(name, str) and _HEADER_NAME.fullmatch(name) for name in remove)):
                problems.append("spec.headers.earlyRequestHeaders.remove: expected 1-64 header names")
    return [f"ClientTrafficPolicy contract: {p}" for p in problems]


def k8s_problems(docs: Sequence[Document]) -> dict[str, list[str]]:
    """Problems per document label; every document is checked by exactly one validator."""
    out: dict[str, list[str]] = {}
    gateway_docs = [d for d in docs if api_group(d.body) in NODE_GROUPS]
    for doc, problems in zip(gateway_docs, gateway_api_problems([d.body for d in gateway_docs]), strict=True):
        out[doc.label] = problems
    for doc in docs:
        if doc in gateway_docs:
            continue
        if api_group(doc.body) == INFERENCE_GROUP:
            out[doc.label] = crd_schema.crd_problems(doc.body) + inference_pool_problems(doc.body)
        elif api_group(doc.body) == ENVOY_GATEWAY_GROUP and doc.body.get("kind") == "ClientTrafficPolicy":
            out[doc.label] = crd_schema.crd_problems(doc.body) + client_traffic_policy_problems(doc.body)
        elif api_group(doc.body) in crd_schema.groups():
            out[doc.label] = crd_schema.crd_problems(doc.body)
        elif is_core(doc.body):
            out[doc.label] = core_problems(doc.body)
        else:
            out[doc.label] = [f"no schema for {doc.body.get('apiVersion')} {doc.body.get('kind')}"]
    return out


# --------------------------------------------------------------------------------------------- report

def all_problems() -> dict[str, list[str]]:
    report: dict[str, list[str]] = {}
    for label, text in envoy_configs().items():
        report[f"envoy: {label}"] = envoy_problems(text)
    for path in (COMPOSE_FILE, COMPOSE_GPU_FILE):
        report[f"compose schema: {_rel(path)}"] = compose_schema_problems(yaml.safe_load(path.read_text()))
    for engine in COMPOSE_ENGINES:
        report[f"docker compose config: {_rel(COMPOSE_FILE)} PD_ENGINE={engine}"] = compose_tool_problems(
            COMPOSE_FILE, env={"PD_ENGINE": engine})
    report[f"docker compose config: {_rel(COMPOSE_FILE)} + {_rel(COMPOSE_GPU_FILE)}"] = compose_tool_problems(
        COMPOSE_FILE, COMPOSE_GPU_FILE)
    try:
        docs = k8s_documents()
    except RenderError as exc:
        report["kubectl kustomize"] = [str(exc)]
        docs = []
    for label, problems in k8s_problems(docs).items():
        report[f"k8s: {label}"] = problems
    return report


def main() -> int:
    report = all_problems()
    failed = 0
    for label, problems in report.items():
        sys.stdout.write(f"{'FAIL' if problems else 'ok  '} {label}\n")
        for problem in problems:
            sys.stdout.write(f"     {problem}\n")
        failed += bool(problems)
    sys.stdout.write(f"{len(report) - failed} passed, {failed} failed\n")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
