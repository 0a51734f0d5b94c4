from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from tests.conftest import failed_with
from tests.gateway.stack import GatewayStack, gateway_stack


@pytest.fixture(scope="module")
def gateway_running() -> Iterator[GatewayStack]:
    with gateway_stack() as stack:
        yield stack


@pytest.fixture
def gw(gateway_running: GatewayStack) -> GatewayStack:
    """The gateway stack with every worker's records, and the picker's, cleared."""
    return gateway_running.reset()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[Any]) -> Any:
    report = yield
    stack = failed_with(item, report, GatewayStack)
    if stack is not None:
        report.sections.append(("logs of the gateway stack", stack.logs()))
    return report
