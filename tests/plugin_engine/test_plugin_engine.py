"""An engine pd-extproc has never heard of, added the way a new engine is: its own module
(tests/plugin_engine/toy_engine.py: Engine, adapter, emulator) registered as a ``pd_extproc.engines``
entry point of an installed distribution, and its tests. No module of extproc/ is edited: the
registry, the settings (PD_EXTPROC_TOY_GREETING), ``emulate --engine toy`` and ``up --demo --adapter
toy`` all come from the Engine. End to end: Envoy, our server and both toy workers."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from extproc import ready
from tests.harness import envoy_bin

pytestmark = pytest.mark.dataplane
HERE = Path(__file__).resolve().parent


@pytest.fixture
def installed(tmp_path: Path) -> Iterator[dict[str, str]]:
    """The environment of a Python that has the toy engine installed: a dist-info with the entry point."""
    dist = tmp_path / "toy_engine-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: toy-engine\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text("[pd_extproc.engines]\ntoy = toy_engine:ENGINE\n")
    path = os.pathsep.join([str(HERE), str(tmp_path), os.environ.get("PYTHONPATH", "")])
    yield {**os.environ, "PYTHONPATH": path, "PD_EXTPROC_ENVOY_BIN": envoy_bin()}


def test_an_engine_added_as_a_plugin_runs_end_to_end(installed: dict[str, str]) -> None:
    process = subprocess.Popen([sys.executable, "-m", "extproc", "up", "--demo", "--adapter", "toy"],
                               env={**installed, "PD_EXTPROC_TOY_GREETING": "hello from the toy decode"},
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert process.stdout is not None
    try:
        line = process.stdout.readline()
        banner = ready.parse(line) if line.startswith("ready") else pytest.fail(process.communicate(timeout=30)[1])
        body = {"model": "m", "messages": [{"role": "user", "content": "What is a KV cache?"}], "max_tokens": 5}
        with httpx.Client(timeout=30) as client:
            response = client.post(banner["url"] + "/v1/chat/completions", json=body,
                                   headers={"x-prefiller-host-port": banner["prefill"]})
            assert response.status_code == 200, response.text
            assert response.json()["choices"][0]["message"]["content"] == "hello from the toy decode"
            prefill = client.get(f"http://{banner['prefill']}/_emulator/requests").json()
            decode = client.get(f"http://{banner['decode']}/_emulator/requests").json()
            info = client.get(f"http://{banner['decode']}/_emulator/info").json()
            refused = client.post(banner["url"] + "/v1/chat/completions", json={**body, "toy_handoff": "forged"},
                                  headers={"x-prefiller-host-port": banner["prefill"]})
        assert info["engine"] == "toy"
        assert [r["json"]["max_tokens"] for r in prefill] == [1], "the toy prefill leg ran once"
        assert [r["notes"].get("handoff") for r in decode] == ["ok"], "decode got the prefill's handoff"
        assert refused.status_code == 400 and refused.json()["error"]["code"] == "reserved_request_field"
    finally:
        process.send_signal(signal.SIGINT)
        process.communicate(timeout=60)
    assert process.returncode == 0


def test_without_the_plugin_the_adapter_is_unknown() -> None:
    """The same command without the entry point: a clear configuration error, nothing starts."""
    done = subprocess.run([sys.executable, "-m", "extproc", "serve", "--adapter", "toy"], capture_output=True,
                          text=True, timeout=60, check=False)
    assert done.returncode == 2 and "PD_EXTPROC_ADAPTER" not in done.stdout
    assert "--adapter: expected one of" in done.stderr


def test_a_broken_plugin_is_one_clear_error(tmp_path: Path) -> None:
    """An installed entry point whose module cannot be imported: the command says which plugin and why,
    in one line and with the configuration exit code, instead of a traceback before argparse runs."""
    dist = tmp_path / "broken_engine-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: broken-engine\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text("[pd_extproc.engines]\nbroken = broken_engine_missing:ENGINE\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    for command in (["serve"], ["envoy-config"], ["--help"]):
        done = subprocess.run([sys.executable, "-m", "extproc", *command], capture_output=True, text=True, env=env,
                              timeout=60, check=False)
        assert done.returncode == 2, (command, done.stderr)
        assert "Traceback" not in done.stderr
        assert done.stderr.strip().splitlines() == [
            "pd-extproc: engine plugin broken_engine_missing:ENGINE cannot be loaded: "
            "ModuleNotFoundError(\"No module named 'broken_engine_missing'\")"], done.stderr
