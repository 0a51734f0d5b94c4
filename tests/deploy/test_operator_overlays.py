"""What an operator changes in a copy of an overlay takes effect everywhere it must: the namespace, the image
and pd-extproc's settings. Each test renders a copy of k8s/ with one edit, as docs/install/ tells operators to
make it, and checks every rendered object."""

from __future__ import annotations

import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from deploy import tools, validate
from extproc._version import __version__

pytestmark = pytest.mark.deploy

DEFAULT_NAMESPACE = "llm"
FOREIGN_NAMESPACE = "inference-prod"
# Namespaces the manifests name on purpose: the gateways' and Prometheus' own, and DNS's.
EXTERNAL_NAMESPACES = {"envoy-gateway-system", "istio-system", "monitoring", "kube-system"}
# Every kustomization an operator applies (or copies): the sidecar overlays (vLLM's and the other engines'),
# gateway mode's two roots and its examples.
SIDECAR_OVERLAYS = [*validate.overlays(), *validate.engine_overlays()]
ROOTS = [*SIDECAR_OVERLAYS, validate.GATEWAY_MODE, validate.GATEWAY_MODE / "istio",
         *validate.kustomize_roots(validate.GATEWAY_EXAMPLES)]
# A string naming the default namespace as a whole word: `llm` but not `llm-d.ai` or `vllm`.
_OLD = re.compile(rf"(?<![\w-]){DEFAULT_NAMESPACE}(?![\w-])")


def _root_id(root: Path) -> str:
    return root.relative_to(validate.K8S_DIR).as_posix()


def _copy_k8s(tmp: Path) -> Path:
    target = tmp / "k8s"
    shutil.copytree(validate.K8S_DIR, target)
    return target


def _render(root: Path) -> list[dict[str, Any]]:
    result = subprocess.run([str(tools.kubectl_bin()), "kustomize", str(root)], capture_output=True, text=True,
                            timeout=120, check=False)
    assert result.returncode == 0, result.stderr
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc]


def _strings(value: Any, path: str = "") -> Iterator[tuple[str, str]]:
    if isinstance(value, dict):
        for key, item in value.items():
            yield from _strings(item, f"{path}.{key}")
    elif isinstance(value, list):
        for index, item in enumerate(value):
            yield from _strings(item, f"{path}[{index}]")
    elif isinstance(value, str):
        yield path, value


def _kustomization(root: Path) -> dict[str, Any]:
    body: dict[str, Any] = yaml.safe_load((root / "kustomization.yaml").read_text())
    return body


def _set_namespace(root: Path, namespace: str) -> None:
    """The edit docs/install/ asks for: the `namespace:` line of the copied overlay."""
    path = root / "kustomization.yaml"
    text, count = re.subn(r"^namespace: \S+$", f"namespace: {namespace}", path.read_text(), flags=re.M)
    assert count == 1, f"{path}: expected one top-level `namespace:` line to edit"
    path.write_text(text)


@pytest.mark.parametrize("root", ROOTS, ids=_root_id)
def test_every_root_sets_its_namespace_in_one_line(root: Path) -> None:
    assert _kustomization(root).get("namespace"), f"{_root_id(root)}: no `namespace:` an operator can change"


@pytest.mark.parametrize("root", ROOTS, ids=_root_id)
def test_a_root_rendered_into_another_namespace_names_the_old_one_nowhere(root: Path, tmp_path: Path) -> None:
    copy = _copy_k8s(tmp_path) / root.relative_to(validate.K8S_DIR)
    old = _kustomization(root)["namespace"]
    _set_namespace(copy, FOREIGN_NAMESPACE)
    found = []
    for doc in _render(copy):
        label = f"{doc['kind']}/{doc['metadata']['name']}"
        namespace = doc["metadata"].get("namespace")
        if doc["kind"] != "Namespace" and namespace is not None and namespace != FOREIGN_NAMESPACE:
            found.append(f"{label}: metadata.namespace {namespace}")
        for path, value in _strings(doc):
            pattern = _OLD if old == DEFAULT_NAMESPACE else re.compile(rf"(?<![\w-]){re.escape(old)}(?![\w-])")
            if pattern.search(value) and value not in EXTERNAL_NAMESPACES:
                found.append(f"{label} {path}: {value[:120]}")
    names = [doc["metadata"]["name"] for doc in _render(copy) if doc["kind"] == "Namespace"]
    assert names in ([], [FOREIGN_NAMESPACE]), names
    assert not found, "\n".join(found)


@pytest.mark.parametrize("root", ROOTS, ids=_root_id)
def test_one_images_entry_sets_every_pd_extproc_container(root: Path, tmp_path: Path) -> None:
    entries = [e for e in _kustomization(root).get("images", []) if e["name"] == "pd-extproc-server"]
    assert len(entries) == 1 and entries[0]["newTag"] == __version__, entries
    copy = _copy_k8s(tmp_path) / root.relative_to(validate.K8S_DIR)
    path = copy / "kustomization.yaml"
    text, count = re.subn(r"(\n  - name: pd-extproc-server\n    newName: )\S+", r"\1registry.test/ai/pd-extproc-server",
                          path.read_text())
    assert count == 1
    path.write_text(text)
    images = {c["image"] for doc in _render(copy) if doc["kind"] == "Deployment"
              for c in doc["spec"]["template"]["spec"].get("containers", [])
              + doc["spec"]["template"]["spec"].get("initContainers", [])
              if "pd-extproc" in c["image"]}
    assert images == {f"registry.test/ai/pd-extproc-server:{__version__}"}


SETTINGS_OVERRIDE = """
configMapGenerator:
  - name: pd-extproc-settings
    behavior: merge
    literals:
      - PD_EXTPROC_TRUSTED_SOURCES=192.168.0.0/16
      - PD_EXTPROC_PREFILL_ALLOW=192.168.0.0/16:8000
"""


def _settings_configmap_name(docs: list[dict[str, Any]]) -> str:
    (name,) = [doc["metadata"]["name"] for doc in docs
               if doc["kind"] == "ConfigMap" and doc["metadata"]["name"].startswith("pd-extproc-settings-")]
    return str(name)


@pytest.mark.parametrize("overlay", SIDECAR_OVERLAYS, ids=_root_id)
def test_a_setting_changed_in_an_overlay_reaches_pd_extproc_and_envoy_and_rolls_the_pods(
        overlay: Path, tmp_path: Path) -> None:
    before = _render(overlay)
    copy = _copy_k8s(tmp_path) / overlay.relative_to(validate.K8S_DIR)
    assert "configMapGenerator" not in (copy / "kustomization.yaml").read_text() or overlay.name == "example"
    body = _kustomization(copy)
    body.setdefault("configMapGenerator", []).extend(yaml.safe_load(SETTINGS_OVERRIDE)["configMapGenerator"])
    (copy / "kustomization.yaml").write_text(yaml.safe_dump(body, sort_keys=False))
    after = _render(copy)
    settings = validate.decode_settings(after)
    assert settings["PD_EXTPROC_TRUSTED_SOURCES"] == "192.168.0.0/16"
    assert settings["PD_EXTPROC_PREFILL_ALLOW"] == "192.168.0.0/16:8000"
    # A new content hash: the Deployment's pod template changes, so the decode pods roll.
    assert _settings_configmap_name(after) != _settings_configmap_name(before)
    decode = next(doc for doc in after if doc["kind"] == "Deployment" and doc["metadata"]["name"] == "pd-decode")
    pod = decode["spec"]["template"]["spec"]
    sources = {c["envFrom"][0]["configMapRef"]["name"] for c in pod["containers"] + pod["initContainers"]
               if "envFrom" in c}
    assert sources == {_settings_configmap_name(after)}
