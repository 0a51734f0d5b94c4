"""PROTOCOL.md is checked against the code: the error table, and that every named test exists."""

from __future__ import annotations

import re

from extproc.protocol.errors import SPEC, Code
from tests.harness import REPO

DOC = (REPO / "PROTOCOL.md").read_text()


def table_rows() -> dict[str, list[str]]:
    table = DOC.split("<!-- error-table -->", 1)[1].split("<!-- /error-table -->", 1)[0]
    rows = {}
    for line in table.strip().splitlines()[2:]:
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        rows[cells[0].strip("`")] = cells
    return rows


def test_every_code_is_in_the_table_with_its_status_and_type() -> None:
    rows = table_rows()
    assert set(rows) == {code.value for code in Code}
    for code, spec in SPEC.items():
        status, kind = rows[code.value][1], rows[code.value][2]
        assert kind == spec.type, code
        if code not in (Code.PREFILL_UPSTREAM_ERROR, Code.GATEWAY_ERROR):
            assert status == str(spec.status), code


def test_every_code_names_a_test_that_exists() -> None:
    sources = "\n".join(path.read_text() for path in (REPO / "tests").rglob("test_*.py"))
    for code, cells in table_rows().items():
        test = cells[-1].strip("`")
        assert re.search(rf"def {re.escape(test)}\(", sources), f"{code}: test {test} does not exist"
