"""`pd-extproc envoy-config --parts` merged into an Envoy config of the user's own: P/D works, the user's
routes and their errors are untouched, and our server down gives our JSON 503 on our route only."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from extproc import ready
from pd_extproc_lab.emulator.worker import EmulatedWorker, WorkerSpec, start_workers
from pd_extproc_lab.process import Child, EnvoyProcess, python_child
from pd_extproc_lab.stack import without_settings
from tests.harness import READY_TIMEOUT, TEST_DEFAULTS, envoy_bin
from tests.helpers import CHAT, COMPLETIONS, assert_error, chat_body, closed_port, only

pytestmark = pytest.mark.dataplane

_HCM = "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager"
USER_503 = "the user's own 503 page"


def _address(host: str, port: int) -> dict[str, Any]:
    return {"socket_address": {"address": host, "port_value": port}}


def users_envoy(decode: str) -> dict[str, Any]:
    """An Envoy config written by hand, knowing nothing of pd-extproc: its own routes (one to a dead
    backend, everything else to the decode worker) and its own local reply for 503s."""
    def cluster(name: str, host_port: str) -> dict[str, Any]:
        host, _, port = host_port.rpartition(":")
        endpoint = {"endpoint": {"address": _address(host, int(port))}}
        return {"name": name, "type": "STATIC", "connect_timeout": "1s", "load_assignment": {
            "cluster_name": name, "endpoints": [{"lb_endpoints": [endpoint]}]}}

    hcm = {
        "@type": _HCM, "stat_prefix": "users_ingress", "codec_type": "AUTO",
        "local_reply_config": {"mappers": [{
            "filter": {"status_code_filter": {"comparison": {"op": "EQ", "value": {
                "default_value": 503, "runtime_key": "user.local_reply_503"}}}},
            "body": {"inline_string": USER_503},
        }]},
        "route_config": {"name": "users_routes", "virtual_hosts": [{"name": "users", "domains": ["*"], "routes": [
            {"name": "user_gone", "match": {"prefix": "/gone/"}, "route": {"cluster": "user_gone"}},
            {"name": "user_decode", "match": {"prefix": "/"}, "route": {"cluster": "user_decode", "timeout": "0s"}},
        ]}]},
        "http_filters": [{"name": "envoy.filters.http.router", "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"}}],
    }
    return {
        "admin": {"address": _address("127.0.0.1", 0)},
        "static_resources": {
            "listeners": [{"name": "users", "address": _address("127.0.0.1", 0), "filter_chains": [{"filters": [
                {"name": "envoy.filters.network.http_connection_manager", "typed_config": hcm}]}]}],
            "clusters": [cluster("user_decode", decode), cluster("user_gone", f"127.0.0.1:{closed_port()}")],
        },
    }


def merge(config: dict[str, Any], parts: dict[str, Any]) -> dict[str, Any]:
    """What the README tells an operator to do with the parts."""
    hcm = config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    hcm["http_filters"][-1:-1] = parts["http_filters"]  # before the router
    routes = hcm["route_config"]["virtual_hosts"][0]["routes"]
    routes[:0] = parts["routes"]  # before the user's own routes
    hcm["local_reply_config"]["mappers"][:0] = parts["local_reply_mappers"]
    config["static_resources"]["clusters"].extend(parts["clusters"])
    return config


@dataclass
class Merged:
    workers: dict[str, EmulatedWorker]
    server: Child
    envoy: EnvoyProcess
    url: str
    log_dir: Path

    def post(self, path: str, body: dict[str, Any], pd: bool = True) -> httpx.Response:
        headers = {"content-type": "application/json"}
        if pd:
            headers["x-prefiller-host-port"] = self.workers["prefill"].address
        with httpx.Client(base_url=self.url, timeout=60) as client:
            return client.post(path, content=json.dumps(body), headers=headers)

    def get(self, path: str) -> httpx.Response:
        with httpx.Client(base_url=self.url, timeout=60) as client:
            return client.get(path)


@pytest.fixture(scope="module")
def merged() -> Iterator[Merged]:
    log_dir = Path(tempfile.mkdtemp(prefix="pd-extproc-parts-"))
    env = without_settings(os.environ)
    workers = start_workers([WorkerSpec("prefill", "prefill"), WorkerSpec("decode", "decode")], log_dir,
                            READY_TIMEOUT, env)
    settings_env = {**TEST_DEFAULTS, "PD_EXTPROC_GRPC_LISTEN": "127.0.0.1:0"}
    server = python_child("pd-extproc-serve", ["serve"], {**env, **settings_env}, log_dir)
    envoy: EnvoyProcess | None = None
    try:
        server.start()
        grpc = str(ready.parse(server.wait_ready(READY_TIMEOUT))["grpc"])
        rendered = subprocess.run(
            [sys.executable, "-m", "extproc", "envoy-config", "--parts", "--decode-cluster", "user_decode"],
            env={**env, **settings_env, "PD_EXTPROC_GRPC_LISTEN": grpc}, capture_output=True, text=True, check=True)
        config = merge(users_envoy(workers["decode"].address), yaml.safe_load(rendered.stdout))
        path = log_dir / "envoy.yaml"
        path.write_text(yaml.safe_dump(config, sort_keys=False))
        envoy = EnvoyProcess.launch(envoy_bin(), path, log_dir)
        url = "http://" + envoy.wait_ready(READY_TIMEOUT)
        yield Merged(workers, server, envoy, url, log_dir)
    finally:
        if envoy is not None:
            envoy.child.stop()
        server.stop()
        for worker in workers.values():
            worker.stop()
        shutil.rmtree(log_dir, ignore_errors=True)


@pytest.fixture
def parts(merged: Merged) -> Merged:
    for worker in merged.workers.values():
        worker.reset()
    return merged


def test_pd_works_through_the_merged_parts(parts: Merged) -> None:
    response = parts.post(CHAT, chat_body(max_tokens=3))
    assert response.status_code == 200, response.text
    prefill, decode = only(parts.workers["prefill"].requests()), only(parts.workers["decode"].requests())
    assert decode["json"]["kv_transfer_params"] == prefill["notes"]["kv_transfer_params"]


def test_the_users_routes_and_their_errors_are_untouched(parts: Merged) -> None:
    plain = parts.post(COMPLETIONS, {"model": "emulated", "prompt": "hi", "max_tokens": 2}, pd=False)
    assert plain.status_code == 200 and "kv_transfer_params" not in only(parts.workers["decode"].requests())["json"]
    assert parts.workers["prefill"].requests() == []
    gone = parts.get("/gone/x")
    assert gone.status_code == 503 and gone.text == USER_503, "the user's own local reply, not our JSON"


def test_our_server_down_is_our_json_503_on_our_route_only(parts: Merged) -> None:
    parts.server.stop(sig=signal.SIGKILL)
    assert_error(parts.post(CHAT, chat_body()), 503, "pd_extproc_unavailable")
    assert parts.workers["decode"].requests() == [], "no decode without a handoff"
    assert parts.post(COMPLETIONS, {"model": "emulated", "prompt": "hi", "max_tokens": 2}, pd=False).status_code == 200
    gone = parts.get("/gone/x")
    assert gone.status_code == 503 and gone.text == USER_503
