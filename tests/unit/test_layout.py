"""The tree is the architecture: each folder is one side of it, and these import boundaries hold.

  extproc/                the product: cli, app (the object graph), plugin (the engine author's API),
                          config, settings_spec, errors, units, ready
  extproc/envoy/          the Envoy side: the stream loop, ext_proc messages, bootstrap rendering, runner
  extproc/core/           one request's P/D decision: no sockets, I/O only through the transport seam
  extproc/adapters/       one pure module per engine
  extproc/upstream/       the only code that reaches workers (transport seam, client, HTTP/1.1, ...)
  extproc/observability/  metrics, tracing, logs, the health/metrics HTTP server
  pd_extproc_lab/         emulated engines, the demo stack and its process supervisor (never on the
                          request path)
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
import tomllib
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("extproc", "pd_extproc_lab")

# Imports that cross a boundary today, each a known piece of debt with its reason.
DEBT: set[tuple[str, str]] = set()


def modules() -> Iterator[tuple[str, Path]]:
    for package in PACKAGES:
        for path in sorted((REPO / package).rglob("*.py")):
            parts = path.relative_to(REPO).with_suffix("").parts
            yield ".".join(parts[:-1] if parts[-1] == "__init__" else parts), path


def imports(path: Path, *, top_level_only: bool = False) -> set[str]:
    tree = ast.parse(path.read_text())
    nodes = tree.body if top_level_only else list(ast.walk(tree))
    if top_level_only:  # `if TYPE_CHECKING:` blocks count as top level
        nodes = [n for node in nodes for n in ([node] if not isinstance(node, ast.If) else ast.walk(node))]
    found: set[str] = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return found


def crossing(name: str, imported: str, forbidden: tuple[str, ...]) -> bool:
    hit = any(imported == f or imported.startswith(f + ".") for f in forbidden)
    owed = any(owner == name and (debt == imported or debt.startswith(imported + ".")) for owner, debt in DEBT)
    return hit and not owed


ALL = list(modules())


PURE_SIDES = ("extproc.protocol", "extproc.pipeline", "extproc.adapters")


@pytest.mark.parametrize("name,path", [(n, p) for n, p in ALL if n.startswith(PURE_SIDES)],
                         ids=lambda value: value if isinstance(value, str) else "")
def test_core_and_adapters_open_no_sockets_and_know_no_shell(name: str, path: Path) -> None:
    forbidden = ("grpc", "grpc_health", "socket", "ssl", "h11", "aiohttp", "extproc.app", "extproc.cli",
                 "extproc.envoy", "envoy", "extproc.upstream.client", "extproc.upstream.http1",
                 "extproc.observability.httpserver", "pd_extproc_lab")
    bad = sorted(i for i in imports(path) if crossing(name, i, forbidden))
    assert not bad, f"{name} imports {bad}: core and adapters reach the network only through the transport seam"


@pytest.mark.parametrize("name,path", [(n, p) for n, p in ALL if n.startswith("extproc.adapters")],
                         ids=lambda value: value if isinstance(value, str) else "")
def test_adapters_are_pure(name: str, path: Path) -> None:
    forbidden = ("asyncio", "logging", "time", "random", "extproc.observability", "extproc.pipeline.processor",
                 "extproc.pipeline.admission", "extproc.pipeline.background", "extproc.upstream.discovery",
                 "extproc.upstream.decode_queue", "extproc.config")
    bad = sorted(i for i in imports(path) if crossing(name, i, forbidden))
    assert not bad, f"{name} imports {bad}: an adapter is pure (no I/O, no clock, no logging)"


@pytest.mark.parametrize("name,path", [(n, p) for n, p in ALL if n.startswith("extproc")],
                         ids=lambda value: value if isinstance(value, str) else "")
def test_the_product_never_imports_the_lab(name: str, path: Path) -> None:
    """Only the CLI's demo commands (`up`, `emulate`) reach the lab, inside the functions that run them."""
    where = imports(path, top_level_only=True) if name == "extproc.cli" else imports(path)
    bad = sorted(i for i in where if i == "pd_extproc_lab" or i.startswith("pd_extproc_lab."))
    assert not bad, f"{name} imports the lab: {bad}"


def test_the_seam_knows_no_metrics_and_no_adapter() -> None:
    seam = REPO / "extproc" / "protocol" / "transport.py"
    bad = sorted(i for i in imports(seam) if i.startswith(("extproc.observability", "extproc.adapters",
                                                           "extproc.pipeline")))
    assert not bad, f"the transport seam imports {bad}"


def test_the_plugin_example_imports_only_the_plugin_apis() -> None:
    toy = REPO / "tests" / "plugin_engine" / "toy_engine.py"
    ours = sorted(i for i in imports(toy) if i.split(".")[0] in PACKAGES)
    allowed = {"extproc.plugin", "pd_extproc_lab.plugin"}
    assert {i.rsplit(".", 1)[0] if i.rsplit(".", 1)[0] in allowed else i for i in ours} <= allowed, ours


def test_serving_does_not_load_the_lab_or_aiohttp() -> None:
    probe = ("import sys, extproc.cli, extproc.app, extproc.envoy.bootstrap, extproc.envoy.runner; "
             "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('pd_extproc_lab', 'aiohttp')); "
             "print(','.join(bad))")
    loaded = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout.strip()
    assert loaded == "", f"the product loads {loaded}"


def test_aiohttp_is_the_labs_dependency_only() -> None:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    runtime = {re.split(r"[=<>\[ ]", dep)[0].lower() for dep in project["dependencies"]}
    lab = {re.split(r"[=<>\[ ]", dep)[0].lower() for dep in project["optional-dependencies"]["lab"]}
    assert "aiohttp" not in runtime and "aiohttp" in lab


def test_the_architecture_doc_maps_every_module() -> None:
    """docs/architecture.md's module map names every module of the product and the lab."""
    doc = (REPO / "docs" / "architecture.md").read_text()
    missing = [str(path.relative_to(REPO)) for _, path in ALL
               if path.name != "__init__.py" and f"`{path.relative_to(REPO)}`" not in doc]
    assert not missing, f"docs/architecture.md does not map {missing}"
