"""The tree is the architecture: each folder is one floor of it, and imports only go down.

  floor 6  extproc/ top level      app (the object graph), cli, plugin, supervisor, network_check, ready
  floor 5  extproc/envoy/          the edge: the only code that builds or reads Envoy's protobufs
  floor 4  extproc/ settings       config, cpus, workers (what the edge's Envoy renderer reads)
  floor 3  extproc/pipeline/       one request's P/D decision, returned as plain values
  floor 2  extproc/adapters/ | extproc/upstream/ | extproc/observability/  (side by side: none imports
           another)
  floor 1  extproc/clock.py        time as one object passed in (asyncio's sleep and timeout underneath)
         | extproc/malloc.py       the C allocator's thresholds for bodies of megabytes (side by side)
  floor 0  extproc/protocol/       the pure floor: request parsing, JSON spans, fields, steering, the
                                   prefill policy, relayed errors, the error table, the transport seam
  pd_extproc_lab/                  emulated engines and the demo stack (never on the request path)

A module imports modules of its own room and of lower floors only; the import graph has no circle
(``if TYPE_CHECKING:``, function-level and relative imports count). docs/architecture.md draws the same plan.
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

# The floors, lowest first; each floor holds one or more rooms (name prefixes). A module may import its
# own room and any lower floor, never a higher floor nor another room of its own floor.
FLOORS: tuple[tuple[tuple[str, ...], ...], ...] = (
    (("extproc.protocol", "extproc._version"),),
    # Time as one object passed in (asyncio's sleep and timeout underneath): not pure, so off the floor.
    (("extproc.clock",), ("extproc.malloc",)),
    (("extproc.adapters",), ("extproc.upstream",), ("extproc.observability",)),
    (("extproc.pipeline",),),
    # Settings sit under the edge: the Envoy bootstrap renders from Settings and the workers' addresses.
    (("extproc.config", "extproc.cpus", "extproc.workers"),),
    (("extproc.envoy",),),
    (("extproc.app", "extproc.cli", "extproc.plugin", "extproc.supervisor", "extproc.network_check",
      "extproc.ready", "extproc.__main__", "extproc"),),
)

# Imports that cross a boundary today, each a known piece of debt with its reason.
DEBT: set[tuple[str, str]] = set()


def modules() -> Iterator[tuple[str, Path]]:
    for package in PACKAGES:
        for path in sorted((REPO / package).rglob("*.py")):
            parts = path.relative_to(REPO).with_suffix("").parts
            yield ".".join(parts[:-1] if parts[-1] == "__init__" else parts), path


def imports(path: Path, *, top_level_only: bool = False) -> set[str]:
    return imports_of(path.read_text(), ".".join(path.parent.relative_to(REPO).parts), top_level_only=top_level_only)


def imports_of(source: str, package: str, *, top_level_only: bool = False) -> set[str]:
    """What a module of ``package`` imports (its source), as absolute names: ``from a.b import c`` gives
    ``a.b`` and ``a.b.c``; a relative import is resolved against ``package``."""
    tree = ast.parse(source)
    nodes = tree.body if top_level_only else list(ast.walk(tree))
    if top_level_only:  # `if TYPE_CHECKING:` blocks count as top level
        nodes = [n for node in nodes for n in ([node] if not isinstance(node, ast.If) else ast.walk(node))]
    here = package.split(".")
    found: set[str] = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = here[:len(here) - node.level + 1] if node.level else []
            origin = ".".join([*base, *([node.module] if node.module else [])])
            if origin:
                found.add(origin)
                found.update(f"{origin}.{alias.name}" for alias in node.names)
    return found


def room_of(module: str) -> tuple[int, tuple[str, ...]] | None:
    """The floor and room of an extproc module: its longest matching prefix (``extproc`` alone only for
    the package itself)."""
    best: tuple[int, tuple[str, ...], str] | None = None
    for floor, rooms in enumerate(FLOORS):
        for room in rooms:
            for prefix in room:
                hit = module == prefix or (prefix != "extproc" and module.startswith(prefix + "."))
                if hit and (best is None or len(prefix) > len(best[2])):
                    best = (floor, room, prefix)
    return None if best is None else (best[0], best[1])


def module_imports(path: Path) -> set[str]:
    """The extproc modules this file imports, as module names (``from a.b import c`` is ``a.b.c`` when
    that is a module, else ``a.b``)."""
    return extproc_modules(imports(path))


def extproc_modules(names: set[str]) -> set[str]:
    known = {name for name, _ in EXTPROC}
    found = set()
    for name in names:
        while name and name not in known:
            name = name.rpartition(".")[0]
        if name.startswith("extproc"):
            found.add(name)
    return found


def crossing(name: str, imported: str, forbidden: tuple[str, ...]) -> bool:
    hit = any(imported == f or imported.startswith(f + ".") for f in forbidden)
    owed = any(owner == name and (debt == imported or debt.startswith(imported + ".")) for owner, debt in DEBT)
    return hit and not owed


ALL = list(modules())
EXTPROC = [(name, path) for name, path in ALL if name.split(".")[0] == "extproc"]
GRAPH = {name: module_imports(path) - {name} for name, path in EXTPROC}


def test_every_module_has_a_floor() -> None:
    """A new top-level module or folder must be placed on a floor (FLOORS) before it can be imported."""
    assert [name for name, _ in EXTPROC if room_of(name) is None] == []


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    """Every edge from a lower floor to a higher one, or between two rooms of one floor, named."""
    bad = []
    for name, imported in sorted(graph.items()):
        here = room_of(name)
        for other in sorted(imported):
            there = room_of(other)
            if here is None or there is None or (name, other) in DEBT:
                continue
            if there[0] > here[0]:
                bad.append(f"{name} (floor {here[0]}) imports {other} (floor {there[0]}): an upward import")
            elif there[0] == here[0] and there[1] != here[1]:
                bad.append(f"{name} imports {other}: two rooms of floor {here[0]} ({here[1][0]}, {there[1][0]})")
    return bad


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (or a module importing itself), Tarjan's."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for other in sorted(graph.get(node, ())):
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in on_stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1 or node in graph.get(node, ()):
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_imports_only_go_down() -> None:
    bad = upward_imports(GRAPH)
    assert not bad, "\n".join(bad)


def test_the_module_graph_has_no_circle() -> None:
    found = circles(GRAPH)
    assert not found, "import circles: " + "; ".join(" <-> ".join(c) for c in found)


def test_the_checks_name_an_upward_import_and_a_circle() -> None:
    """The two checks above on main's old shape (the processor building Envoy replies; metrics and
    tracing importing each other): both fail, naming the edge."""
    old = {"extproc.pipeline.processor": {"extproc.envoy.messages"}, "extproc.envoy.messages": set(),
           "extproc.upstream.decode_queue": {"extproc.adapters.base"}, "extproc.adapters.base": set(),
           "extproc.observability.metrics": {"extproc.observability.tracing"},
           "extproc.observability.tracing": {"extproc.observability.metrics"}}
    assert upward_imports(old) == [
        "extproc.pipeline.processor (floor 3) imports extproc.envoy.messages (floor 5): an upward import",
        "extproc.upstream.decode_queue imports extproc.adapters.base: two rooms of floor 2 (extproc.upstream, "
        "extproc.adapters)"]
    assert circles(old) == [["extproc.observability.metrics", "extproc.observability.tracing"]]


def test_the_checks_read_imports_in_functions_under_type_checking_and_relative() -> None:
    """From source, as the two checks above read the tree: an import inside a function, one under
    ``if TYPE_CHECKING:`` and a relative one each count, upward, sideways or round."""
    floor = ("from typing import TYPE_CHECKING\n"
             "if TYPE_CHECKING:\n    from extproc.pipeline.decisions import LocalReply\n"
             "def reply():\n    import extproc.envoy.messages\nfrom ..upstream import client\n")
    assert extproc_modules(imports_of(floor, "extproc.protocol")) == {
        "extproc.pipeline.decisions", "extproc.envoy.messages", "extproc.upstream", "extproc.upstream.client"}
    side = "def scrape():\n    from ..adapters.base import QueueGauges\n"
    graph = {"extproc.protocol.sample": extproc_modules(imports_of(floor, "extproc.protocol")),
             "extproc.upstream.sample": extproc_modules(imports_of(side, "extproc.upstream")),
             "extproc.observability.metrics": extproc_modules(imports_of(
                 "def spans():\n    from extproc.observability import tracing\n", "extproc.observability")),
             "extproc.observability.tracing": extproc_modules(imports_of(
                 "from .metrics import Metrics\n", "extproc.observability"))}
    assert upward_imports(graph) == [
        "extproc.protocol.sample (floor 0) imports extproc.envoy.messages (floor 5): an upward import",
        "extproc.protocol.sample (floor 0) imports extproc.pipeline.decisions (floor 3): an upward import",
        "extproc.protocol.sample (floor 0) imports extproc.upstream (floor 2): an upward import",
        "extproc.protocol.sample (floor 0) imports extproc.upstream.client (floor 2): an upward import",
        "extproc.upstream.sample imports extproc.adapters.base: two rooms of floor 2 (extproc.upstream, "
        "extproc.adapters)"]
    assert circles(graph) == [["extproc.observability.metrics", "extproc.observability.tracing"]]


# What the pure floor and the adapters never import: no event loop, no sockets, no threads or processes,
# no clock, no logging, no protobufs.
IMPURE = ("asyncio", "socket", "ssl", "selectors", "threading", "multiprocessing", "concurrent", "subprocess",
          "urllib", "http", "mmap", "time", "random", "logging", "os", "grpc", "grpc_health", "envoy", "google",
          "h11", "hpack", "aiohttp", "prometheus_client", "opentelemetry")
# settings_spec's two secret-file parsers read a file when config (or an engine's build) parses a
# setting at startup, never per request.
PURE_EXCEPTIONS = {("extproc.protocol.settings_spec", "os")}


@pytest.mark.parametrize("name,path", [(n, p) for n, p in EXTPROC if n.startswith(("extproc.protocol",
                                                                                     "extproc.adapters"))],
                         ids=lambda value: value if isinstance(value, str) else "")
def test_the_floor_and_the_adapters_do_no_io(name: str, path: Path) -> None:
    """Nor does either take time from extproc/clock.py (floor 1, under the adapters): time comes to an
    adapter as a value, if at all."""
    bad = sorted(i for i in imports(path) if (i.split(".")[0] in IMPURE or i.startswith("extproc.clock"))
                 and (name, i.split(".")[0]) not in PURE_EXCEPTIONS)
    assert not bad, f"{name} imports {bad}: the floor and the adapters are pure"


@pytest.mark.parametrize("name,path", EXTPROC, ids=lambda value: value if isinstance(value, str) else "")
def test_only_the_edge_touches_envoys_protobufs(name: str, path: Path) -> None:
    bad = sorted(i for i in imports(path) if i.split(".")[0] in ("envoy", "google"))
    assert name.startswith("extproc.envoy.") or not bad, f"{name} imports {bad}: only extproc/envoy/ does"


@pytest.mark.parametrize("name,path", [(n, p) for n, p in EXTPROC if n.startswith("extproc.pipeline")],
                         ids=lambda value: value if isinstance(value, str) else "")
def test_the_pipeline_reaches_workers_only_through_the_seam(name: str, path: Path) -> None:
    forbidden = ("grpc", "grpc_health", "socket", "ssl", "h11", "aiohttp", "extproc.upstream.client",
                 "extproc.upstream.http1", "extproc.observability.httpserver", "pd_extproc_lab")
    bad = sorted(i for i in imports(path) if crossing(name, i, forbidden))
    assert not bad, f"{name} imports {bad}: the pipeline reaches workers only through the Transport seam"


@pytest.mark.parametrize("name,path", [(n, p) for n, p in ALL if n.startswith("extproc")],
                         ids=lambda value: value if isinstance(value, str) else "")
def test_the_product_never_imports_the_lab(name: str, path: Path) -> None:
    """Only the CLI's demo commands (`up`, `emulate`) reach the lab, inside the functions that run them."""
    where = imports(path, top_level_only=True) if name == "extproc.cli" else imports(path)
    bad = sorted(i for i in where if i == "pd_extproc_lab" or i.startswith("pd_extproc_lab."))
    assert not bad, f"{name} imports the lab: {bad}"


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
