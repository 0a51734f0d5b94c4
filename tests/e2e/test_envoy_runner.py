"""`pd-extproc envoy ARGS`: Envoy under our graceful stop (what the compose file's Envoy service runs).

Plain Envoy resets a request in flight on SIGTERM; under `pd-extproc envoy` the request finishes,
then Envoy exits 0. Runs on the host against the harness's server and workers, so it needs no
container engine (tests/compose checks the same inside the image).
"""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from extproc.envoy.bootstrap import render_yaml
from extproc.protocol.units import parse_address
from tests.harness import Stack, running_stack
from tests.helpers import CHAT, chat_body, eventually
from tests.ports import unused_port

pytestmark = pytest.mark.dataplane
DRAINING = b"pd-extproc envoy: draining Envoy"  # the runner's line once Envoy's listeners drain


@pytest.fixture
def runner_stack() -> Iterator[Stack]:
    with running_stack() as stack:
        yield stack


def _refused_by_pd_extproc(url: str) -> bool:
    """A P/D request to a target outside the allow-list: 403 once Envoy reaches our server."""
    try:
        response = httpx.post(url + CHAT, json=chat_body(), headers={"x-prefiller-host-port": "10.0.0.1:1"}, timeout=5)
    except httpx.HTTPError:
        return False
    return response.status_code == 403


def test_sigterm_lets_the_request_in_flight_finish_then_envoy_exits_0(runner_stack: Stack) -> None:
    """The request is held at prefill until the runner says Envoy drains: Envoy is then still running
    and the request unanswered; released, it ends 200 from decode, then Envoy exits 0."""
    port = unused_port()
    settings = dataclasses.replace(runner_stack.settings, listen=parse_address(f"127.0.0.1:{port}"))
    config = runner_stack.log_dir / "runner-envoy.yaml"
    config.write_text(render_yaml(settings))
    env = {**os.environ, "PD_EXTPROC_ENVOY_BIN": settings.envoy_bin, "PD_EXTPROC_DRAIN_TIMEOUT": "120s"}
    log_path = runner_stack.log_dir / "runner-envoy.log"
    with log_path.open("wb") as log:
        runner = subprocess.Popen([sys.executable, "-m", "extproc", "envoy", "-c", str(config), "--log-level",
                                   "warning", "--disable-hot-restart"], env=env, stdout=log, stderr=log)
        try:
            url = f"http://127.0.0.1:{port}"
            deadline = time.monotonic() + 60
            while not _refused_by_pd_extproc(url):
                assert runner.poll() is None and time.monotonic() < deadline, "Envoy never reached pd-extproc"
                time.sleep(0.1)
            runner_stack.reset()
            runner_stack.prefill.script({"hold": True})
            with ThreadPoolExecutor(max_workers=1) as pool:
                pending = pool.submit(httpx.post, url + CHAT, json=chat_body(max_tokens=3),
                                      headers=runner_stack.pd_headers(), timeout=120)
                assert runner_stack.prefill.wait("pending")
                runner.send_signal(signal.SIGTERM)
                assert eventually(lambda: DRAINING in log_path.read_bytes()), log_path.read_text()
                assert runner.poll() is None, "Envoy stopped with a request in flight"
                assert not pending.done(), "the held request was answered before its release"
                assert runner_stack.prefill.release() == 1
                response = pending.result(timeout=60)
            assert response.status_code == 200, response.text
            assert response.headers["x-emulator-worker"] == "decode"
            assert runner.wait(timeout=60) == 0
        finally:
            if runner.poll() is None:
                runner.kill()
                runner.wait()
