"""No module-level mutable state in extproc/: what changes while the server runs belongs to an object
app.py builds (the processor and its caches, the clients, the watch), so two servers in one process, or
two tests, never share it.

A syntax scan of every module: a name bound at module level (a literal, a comprehension, any call) must
never be changed (a mutating method, an item or attribute assignment, ``del``) from anywhere in extproc/;
an instance of a module's own class bound at module level must not be one whose methods change it; no
``global`` rebinding; no ``functools.cache`` memo. Constant tables (a dict literal only ever read) pass by
themselves. State hidden deeper (inside another library's object) is beyond a scan: review's.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

from extproc import adapters, config
from extproc.envoy import messages

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "extproc"

# Each entry: (module, name) and why it is allowed. Keep it short: a new entry needs a reason as good.
ALLOWED = {
    # Logging is the process's (Python's logging module is process-global); the CLI configures it once,
    # before any server exists, and stops its writer thread at exit.
    ("extproc.observability.logs", "_writer"): "the process's log writer thread",
    # The text of the current second for log timestamps: a memo of a pure function of the time; any
    # owner would hold the same value.
    ("extproc.observability.logs", "_second"): "timestamp text, a function of the time",
}
# Memos of what is installed, which does not change while the process runs; each returns a read-only
# value (checked below), so no caller can change what another sees.
CACHED = {
    ("extproc.adapters", "engines"), ("extproc.adapters", "by_engine"),
    ("extproc.config", "engine_specs"), ("extproc.config", "specs"), ("extproc.config", "_spec_by_env"),
    ("extproc.envoy.messages", "_removals"),
}
MUTATORS = frozenset({
    "append", "extend", "insert", "remove", "pop", "popitem", "clear", "update", "setdefault", "add", "discard",
    "sort", "reverse", "move_to_end", "appendleft", "extendleft", "popleft", "__setitem__", "__delitem__",
    "CopyFrom", "MergeFrom", "Clear", "ClearField", "SetInParent", "MergeFromString", "ParseFromString",
})


def module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


TREES = {module_name(path): ast.parse(path.read_text()) for path in sorted(PACKAGE.rglob("*.py"))}


def top_level_bindings(tree: ast.Module) -> dict[str, ast.expr]:
    found: dict[str, ast.expr] = {}
    for stmt in tree.body:
        if isinstance(stmt, ast.Assign):
            found.update((t.id, stmt.value) for t in stmt.targets if isinstance(t, ast.Name))
        elif isinstance(stmt, ast.AnnAssign) and stmt.value is not None and isinstance(stmt.target, ast.Name):
            found[stmt.target.id] = stmt.value
    return found


BINDINGS = {module: top_level_bindings(tree) for module, tree in TREES.items()}


def aliases(module: str, tree: ast.Module) -> tuple[dict[str, tuple[str, str]], dict[str, str]]:
    """In ``module``: local names of other modules' top-level bindings, and local names of modules."""
    names = {name: (module, name) for name in BINDINGS[module]}
    modules: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                local = alias.asname or alias.name
                if alias.name in BINDINGS.get(node.module, {}):
                    names[local] = (node.module, alias.name)
                if f"{node.module}.{alias.name}" in TREES:
                    modules[local] = f"{node.module}.{alias.name}"
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name in TREES and alias.asname:
                    modules[alias.asname] = alias.name
    return names, modules


def changed_root(node: ast.expr, names: dict[str, tuple[str, str]], modules: dict[str, str]) -> tuple[str, str] | None:
    """The module-level binding an expression like ``X[k]``, ``X.a.b`` or ``mod.X.a`` reaches, if any."""
    chain: list[ast.expr] = []
    while isinstance(node, ast.Attribute | ast.Subscript):
        chain.append(node)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    if node.id in modules and chain and isinstance(chain[-1], ast.Attribute):
        target = (modules[node.id], chain[-1].attr)
        return target if target[1] in BINDINGS[target[0]] else None
    return names.get(node.id)


def changes() -> Iterator[tuple[tuple[str, str], str]]:
    """Every change of a module-level binding anywhere in extproc/: (the binding, where and how)."""
    for module, tree in TREES.items():
        names, modules = aliases(module, tree)
        for node in ast.walk(tree):
            targets: list[ast.expr] = []
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in MUTATORS:
                targets = [node.func.value]
            elif isinstance(node, ast.Assign | ast.AugAssign | ast.AnnAssign | ast.Delete):
                chosen = node.targets if isinstance(node, ast.Assign | ast.Delete) else [node.target]
                targets = [t for t in chosen if isinstance(t, ast.Attribute | ast.Subscript)]
            for target in targets:
                root = changed_root(target, names, modules)
                if root is not None:
                    yield root, f"{module}:{node.lineno} {ast.unparse(node)[:80]}"


def stateful_singletons() -> Iterator[tuple[tuple[str, str], str]]:
    """Module-level instances of the module's own classes whose methods (past __init__) assign to self."""
    for module, tree in TREES.items():
        classes = {node.name: node for node in tree.body if isinstance(node, ast.ClassDef)}
        for name, value in BINDINGS[module].items():
            if not (isinstance(value, ast.Call) and isinstance(value.func, ast.Name) and value.func.id in classes):
                continue
            for method in classes[value.func.id].body:
                if isinstance(method, ast.FunctionDef) and method.name != "__init__" and assigns_to_self(method):
                    yield (module, name), f"{module}: {value.func.id}.{method.name} assigns to self"


def assigns_to_self(method: ast.FunctionDef) -> bool:
    for node in ast.walk(method):
        if isinstance(node, ast.Assign | ast.AugAssign):
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                parts = target.elts if isinstance(target, ast.Tuple) else [target]
                if any(isinstance(part, ast.Attribute) for part in parts):
                    return True
    return False


def globals_rebound() -> Iterator[tuple[tuple[str, str], str]]:
    for module, tree in TREES.items():
        for node in ast.walk(tree):
            if isinstance(node, ast.Global):
                for name in node.names:
                    yield (module, name), f"{module}:{node.lineno} global {name}"


def memos() -> Iterator[tuple[str, str]]:
    for module, tree in TREES.items():
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                for decorator in node.decorator_list:
                    called = decorator.func if isinstance(decorator, ast.Call) else decorator
                    if ast.unparse(called).split(".")[-1] in ("cache", "lru_cache"):
                        yield module, node.name


def test_no_module_level_binding_is_changed_and_no_global_is_rebound() -> None:
    found = [*changes(), *stateful_singletons(), *globals_rebound()]
    bad = sorted({where for binding, where in found if binding not in ALLOWED})
    assert not bad, "module-level state (give it an owner app.py builds):\n" + "\n".join(bad)


def test_the_allow_list_names_only_what_is_still_there() -> None:
    found = {binding for binding, _ in (*changes(), *stateful_singletons(), *globals_rebound())}
    assert set(ALLOWED) <= found, f"stale entries: {sorted(set(ALLOWED) - found)}"


def test_every_memo_is_listed_and_returns_a_read_only_value() -> None:
    assert set(memos()) == CACHED
    for value in (adapters.engines(), adapters.by_engine(), config._spec_by_env()):
        with pytest.raises(TypeError):
            value["x"] = value[next(iter(value))]  # type: ignore[index]
    assert isinstance(config.specs(), tuple) and isinstance(config.engine_specs(), tuple)
    assert isinstance(messages._removals(("x-a",)), bytes)


def test_the_scan_sees_each_kind_of_change() -> None:
    """The scan itself, on a module written to break the rule each way it knows."""
    sample = ast.parse(
        "import extproc.protocol.errors as errors_module\n"
        "from extproc.protocol.errors import SPEC\n"
        "_SEEN = {}\n_LIST = []\n"
        "class _Memo:\n    def note(self):\n        self.last = 1\n"
        "_MEMO = _Memo()\n_COUNT = 0\n"
        "def f(key):\n"
        "    global _COUNT\n    _SEEN[key] = 1\n    _LIST.append(key)\n    SPEC.clear()\n"
        "    errors_module.SPEC.update({})\n")
    TREES["sample"], BINDINGS["sample"] = sample, top_level_bindings(sample)
    try:
        found = {binding for binding, _ in (*changes(), *stateful_singletons(), *globals_rebound())}
    finally:
        del TREES["sample"], BINDINGS["sample"]
    assert {("sample", "_SEEN"), ("sample", "_LIST"), ("sample", "_MEMO"), ("sample", "_COUNT"),
            ("extproc.protocol.errors", "SPEC")} <= found
