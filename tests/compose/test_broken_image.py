"""A stack that cannot start fails the compose stage with the failing container's own log in the
message, under every engine: Docker's `up --wait` exits non-zero when a service exits, podman-compose
returns and the harness finds the exited container; either way the message names the cause."""

from __future__ import annotations

import subprocess

import pytest

from tests.compose.commands import UP
from tests.compose.project import ComposeProject, brought_up, container_engine

pytestmark = pytest.mark.compose

BROKEN = ("tests/compose/broken-image.yaml",)
CAUSE = "No module named 'hpack'"  # the ModuleNotFoundError `pd-extproc serve` exits with in the broken image


def test_a_service_that_cannot_start_fails_up_with_its_log(built_image: ComposeProject) -> None:
    broken = ComposeProject("vllm", overrides=BROKEN)
    try:
        with pytest.raises(AssertionError) as failure, brought_up(broken, UP):
            pass
    finally:
        subprocess.run([container_engine(), "rmi", "pd-extproc-broken:test"], capture_output=True, timeout=60,
                       check=False)
    message = str(failure.value)
    logged = [line for line in message.splitlines() if CAUSE in line]
    assert logged, message
    # the container's own log line, prefixed with its service: "pd-extproc-1  | ..." or "[pd-extproc] | ..."
    assert all("pd-extproc" in line.split("|")[0] for line in logged), logged
    assert broken.containers() == [], "brought down after the failure"
