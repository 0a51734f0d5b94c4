from __future__ import annotations

from collections.abc import Iterator
from typing import Any, TypeVar

import pytest

from tests.harness import Stack, running_stack

# Lines a test wants in the run's output whether it passes or fails (printed at the end of the run).
SUMMARY: list[str] = []


@pytest.fixture(scope="session")
def pd() -> Iterator[Stack]:
    """The default stack: Envoy + pd-extproc (vllm_nixl) + one emulated prefill and one decode worker."""
    with running_stack() as stack:
        yield stack


@pytest.fixture
def stack(pd: Stack) -> Stack:
    """The default stack with both workers' records and scripts cleared."""
    return pd.reset()


T = TypeVar("T")


def failed_with(item: pytest.Item, report: pytest.TestReport, kind: type[T]) -> T | None:
    """The first fixture of type ``kind`` a failed test used (for its logs in the report), else None."""
    if report.when != "call" or not report.failed:
        return None
    return next((value for value in getattr(item, "funcargs", {}).values() if isinstance(value, kind)), None)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[Any]) -> Any:
    report = yield
    stack = failed_with(item, report, Stack)
    if stack is not None:
        report.sections.append(("logs of the stack", stack.logs()))
    return report


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if SUMMARY:
        terminalreporter.write_sep("-", "measured by the tests")
        for line in SUMMARY:
            terminalreporter.write_line(line)
