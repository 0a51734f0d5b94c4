"""The compose stage's fixtures: the image is built once per run (README's `build`), and each engine's
project is brought up once (README's `up`) for the module's tests, whose last one brings it down.

A failing test gets the project's container list and the tail of every container's log.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from tests.compose.commands import BUILD, DOWN, UP
from tests.compose.project import BUILD_TIMEOUT, ComposeProject, brought_up, container_engine
from tests.conftest import SUMMARY, failed_with

ENGINES = ("vllm", "sglang", "trtllm")  # PD_ENGINE; vllm is README's walk-through


@pytest.fixture(scope="session")
def built_image() -> ComposeProject:
    builder = ComposeProject("vllm")
    ran = builder.run(BUILD, timeout=BUILD_TIMEOUT)
    SUMMARY.append(f"compose stage ({container_engine()}): image built in {ran.seconds:.0f} s "
                   f"({' '.join(ran.argv[-3:])})")
    return builder


@pytest.fixture(scope="module", params=ENGINES)
def project(request: pytest.FixtureRequest, built_image: ComposeProject) -> Iterator[ComposeProject]:
    with brought_up(ComposeProject(request.param), UP) as running:
        up = running.history[0]
        SUMMARY.append(f"compose stage ({container_engine()}): {request.param} up and serving, "
                       f"`up` took {up.seconds:.1f} s")
        yield running
        for ran in running.history:
            if ran.argv[-len(DOWN.args):] == DOWN.args:
                SUMMARY.append(f"compose stage ({container_engine()}): {request.param} down in {ran.seconds:.1f} s")


@pytest.fixture
def stack(project: ComposeProject) -> ComposeProject:
    """The running project with both workers' records and scripts cleared."""
    project.reset_workers()
    return project


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[Any]) -> Any:
    report = yield
    running = failed_with(item, report, ComposeProject)
    if running is not None:
        report.sections.append((f"compose project ({running.engine})", running.logs()))
    return report
