from __future__ import annotations

from collections.abc import Iterator
from typing import Any

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
    pd.reset()
    return pd


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[Any]) -> Any:
    report = yield
    if report.when == "call" and report.failed:
        for name in ("stack", "short", "unix_stack", "adapter_none", "no_decode", "ipv6_stack", "trap_stack",
                     "pd", "short_deadline", "target_stack"):
            fixture = getattr(item, "funcargs", {}).get(name)
            if isinstance(fixture, Stack):
                report.sections.append((f"logs of {name}", fixture.logs()))
                break
    return report


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if SUMMARY:
        terminalreporter.write_sep("-", "measured by the tests")
        for line in SUMMARY:
            terminalreporter.write_line(line)
