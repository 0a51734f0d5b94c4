"""docs/troubleshooting.md covers every code of the closed error table, each with a cause, a check and a fix."""

from __future__ import annotations

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
