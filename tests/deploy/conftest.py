"""Fixtures over the committed deployment files (nothing here starts a process)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from deploy import render_manifests as rm
from deploy import validate
from extproc.config import Settings

OVERLAYS = validate.overlays()


class Manifests:
    """What one kustomize overlay renders, looked up by kind and name."""

    def __init__(self, docs: list[validate.Document], overlay: Path | None = None):
        self.docs = docs
        self.overlay = overlay
        self._index = {(d.body["kind"], d.body["metadata"]["name"]): d.body for d in docs}

    @property
    def name(self) -> str:
        return self.overlay.name if self.overlay is not None else ""

    def of_kind(self, kind: str) -> list[dict[str, Any]]:
        return [d.body for d in self.docs if d.body["kind"] == kind]

    def has(self, kind: str, name: str) -> bool:
        return (kind, name) in self._index

    def get(self, kind: str, name: str) -> dict[str, Any]:
        return self._index[(kind, name)]

    def container(self, deployment: str, name: str) -> dict[str, Any]:
        pod = self.get("Deployment", deployment)["spec"]["template"]["spec"]
        return next(c for c in pod["containers"] if c["name"] == name)

    def pod(self, deployment: str) -> dict[str, Any]:
        spec: dict[str, Any] = self.get("Deployment", deployment)["spec"]["template"]["spec"]
        return spec


@pytest.fixture(scope="session", params=OVERLAYS, ids=[overlay.name for overlay in OVERLAYS])
def manifests(request: pytest.FixtureRequest) -> Manifests:
    """Each overlay in turn (k8s/overlays/*): every check on the manifests holds for what each renders."""
    overlay: Path = request.param
    return Manifests(validate.render_overlay(overlay), overlay)


@pytest.fixture(scope="session")
def k8s_settings() -> Settings:
    return rm.target_settings(rm.K8S_SETTINGS)[0]


@pytest.fixture(scope="session")
def compose_settings() -> Settings:
    """What the compose containers read for the default engine (PD_ENGINE=vllm)."""
    return rm.compose_settings(rm.COMPOSE_ENGINES[0])[0]


@pytest.fixture(scope="session")
def compose() -> dict[str, Any]:
    body: dict[str, Any] = yaml.safe_load(validate.COMPOSE_FILE.read_text())
    return body


@pytest.fixture(scope="session")
def compose_gpu() -> dict[str, Any]:
    """The GPU override file alone (the services it replaces, not the merged project)."""
    body: dict[str, Any] = yaml.safe_load(validate.COMPOSE_GPU_FILE.read_text())
    return body


@pytest.fixture(scope="session")
def repo() -> Path:
    return rm.REPO
