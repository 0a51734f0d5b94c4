"""docs/troubleshooting.md covers every code of the closed error table, each with a cause, a check and a fix."""

from __future__ import annotations

import ast
import re

from extproc.protocol.errors import Code
from tests.harness import REPO

PAGE = (REPO / "docs" / "troubleshooting.md").read_text()


def _rows() -> dict[str, list[str]]:
    rows = {}
    for line in PAGE.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        match = re.fullmatch(r"`([a-z_]+)`", cells[0]) if line.startswith("| `") else None
        if match:
            rows[match.group(1)] = cells[1:]
    return rows


def test_every_error_code_has_a_row_and_nothing_else_does() -> None:
    assert set(_rows()) == {code.value for code in Code}


def test_every_row_says_cause_confirm_and_fix() -> None:
    for code, cells in _rows().items():
        assert len(cells) == 3 and all(len(cell) > 3 for cell in cells), code


# Where `serve` refuses its settings before it listens: calls that raise or collect a refusal, and the functions
# that return one. Messages are compared as templates: an f-string's placeholders match any `<...>` on the page.
_REFUSAL_SOURCES: dict[str, set[str] | None] = {
    "extproc/config.py": None, "extproc/app.py": None, "extproc/adapters/__init__.py": None,
    "extproc/adapters/trtllm.py": {"option_problems"}, "extproc/upstream/decode_target.py": {"resolve"}}
_RAISING = {"ConfigError", "EngineLoadError", "Unresolvable"}
_RETURNING = {"open_prefill_policy", "protocol_problem", "option_problems"}
_PLACEHOLDER = "\0"


def _template(node: ast.AST) -> str | None:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        return "".join(part.value if isinstance(part, ast.Constant) else _PLACEHOLDER for part in node.values)
    if isinstance(node, ast.BinOp):  # "invalid settings:\n  " + "\n  ".join(problems)
        return _template(node.left)
    if isinstance(node, ast.GeneratorExp):
        return _template(node.elt)
    return None


def startup_refusals() -> list[str]:
    found = []
    for path, functions in _REFUSAL_SOURCES.items():
        for function in ast.walk(ast.parse((REPO / path).read_text())):
            if not isinstance(function, ast.FunctionDef | ast.AsyncFunctionDef) or \
                    (functions is not None and function.name not in functions):
                continue
            for node in ast.walk(function):
                values: list[ast.AST] = []
                if isinstance(node, ast.Call):
                    called = node.func
                    name = called.id if isinstance(called, ast.Name) else getattr(called, "attr", "")
                    collects = isinstance(called, ast.Attribute) and isinstance(called.value, ast.Name) \
                        and called.value.id == "problems" and name in ("append", "extend")
                    values = list(node.args) if name in _RAISING or collects else []
                elif isinstance(node, ast.Return) and function.name in _RETURNING and node.value is not None:
                    values = list(node.value.elts) if isinstance(node.value, ast.List) else [node.value]
                found += [template for value in values if (template := _template(value))]
    return [template.strip() for template in found if re.search(r"[a-z]{3}", template)]


def _on_page(template: str, text: str) -> bool:
    """The message's first 60 characters, each placeholder as any `<...>`, in backticks on the page."""
    head = template.split("\n")[0][:60]
    pattern = "".join(r"<[^<>`]*>" if char == _PLACEHOLDER else re.escape(char) for char in head)
    return re.search(r"`" + pattern, text) is not None


def test_every_startup_refusal_of_serve_has_a_row_with_cause_and_fix() -> None:
    section = PAGE[PAGE.index("### `serve` refuses to start"):PAGE.index("\n## ", PAGE.index("### `serve` refuses"))]
    refusals = startup_refusals()
    assert len(refusals) >= 25 and any("gateway mode yet" in message for message in refusals)
    missing = [message for message in refusals if not _on_page(message, section)]
    assert not missing, missing
    rows = [line for line in section.splitlines() if line.startswith("| `") and not line.startswith("| `serve` prints")]
    assert rows and all(len([cell for cell in row.strip("|").split("|") if len(cell.strip()) > 3]) == 3 for row in rows)


def test_the_startup_checks_show_where_to_look_in_both_modes() -> None:
    startup = PAGE[PAGE.index("## At startup"):PAGE.index("### `serve` refuses to start")]
    assert "logs deployment/pd-decode -c pd-extproc" in startup and "logs deployment/pd-extproc " in startup
