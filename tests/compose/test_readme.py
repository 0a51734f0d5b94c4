"""The Compose install page (docs/install/compose.md) shows, command for command, what the compose stage runs."""

from __future__ import annotations

import pytest

from tests.compose.commands import README_BEGIN, README_END, readme_block
from tests.compose.project import REPO

pytestmark = pytest.mark.deploy


def test_the_compose_install_page_shows_the_commands_the_compose_stage_runs() -> None:
    readme = (REPO / "docs" / "install" / "compose.md").read_text()
    assert readme.count(README_BEGIN) == 1 and readme.count(README_END) == 1
    shown = readme.split(README_BEGIN, 1)[1].split(README_END, 1)[0].strip()
    assert shown == readme_block(), "docs/install/compose.md's block differs from tests/compose/commands.py"
