"""The real-vLLM stage's fixtures and ordering.

* ``real_pd`` (session): a real vLLM prefill and decode worker plus Envoy and our server, started
  once per run, stopped (every process of their groups) at the end.
* The stage's tests run after every other test, and within the stage ``@pytest.mark.realvllm(phase=...)``
  orders them: "late" (deliberate KV-load failures) before "last" (the whole-run transfer ledger).
* A failing test gets the tail of both vLLM logs and of our server's and Envoy's logs.
* The summary at the end prints the stage's wall time and the NIXL transfer evidence.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from tests.conftest import failed_with
from tests.realvllm import stage
from tests.realvllm.stage import RealPd

PHASES = {None: 0, "late": 1, "last": 2}


@pytest.fixture(scope="session")
def real_pd() -> Iterator[RealPd]:
    with stage.running_stage() as real:
        yield real


def _phase(item: pytest.Item) -> int | None:
    """None for tests outside the stage, else the stage phase's rank."""
    markers = list(item.iter_markers("realvllm"))
    if not markers:
        return None
    named = [m.kwargs["phase"] for m in markers if "phase" in m.kwargs]
    return PHASES[named[0] if named else None]


def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list[pytest.Item]) -> None:
    others = [item for item in items if _phase(item) is None]
    staged = [item for item in items if _phase(item) is not None]
    staged.sort(key=lambda item: _phase(item) or 0)  # stable: file order within a phase
    items[:] = others + staged


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[Any]) -> Any:
    report = yield
    real = failed_with(item, report, RealPd)
    if real is not None:
        report.sections.append(("logs of the real-vLLM stage", real.logs()))
        stalled = real.stalls.between(call.start, call.stop) if real.stalls else []
        if stalled:
            report.sections.append(("machine stalls", (
                f"this process was not scheduled for {', '.join(f'{s:.1f}s' for s in stalled)} while the test "
                "ran: the whole machine stalled (VM paused by its host?); timeouts and KV leases count "
                "that time too")))
    return report


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if stage.REPORT:
        terminalreporter.write_sep("-", "real vLLM P/D stage")
        for line in stage.REPORT:
            terminalreporter.write_line(line)
