"""`pd-extproc envoy-config --parts` merged into an Envoy config of the user's own: P/D works, the user's
routes and their errors are untouched, and our server down gives our JSON 503 on our route only. The
parts protect the user's routes as the full bootstrap protects its passthrough: steering members and
headers never reach decode there, and with trusted sources only those peers may name a prefill target."""

from __future__ import annotations

import contextlib
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
from tests.helpers import CHAT, COMPLETIONS, assert_error, chat_body, closed_port, eventually, only

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
    """What the parts' own notes tell an operator to do with them."""
    hcm = config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    hcm["http_filters"][-1:-1] = parts["http_filters"]  # before the router
    virtual_host = hcm["route_config"]["virtual_hosts"][0]
    virtual_host["routes"][:0] = parts["routes"]  # before the user's own routes
    virtual_host.update(parts["virtual_host_additions"])
    hcm["local_reply_config"]["mappers"][:0] = parts["local_reply_mappers"]
    hcm.setdefault("access_log", []).extend(parts["access_log"])
    hcm.setdefault("early_header_mutation_extensions", []).extend(parts["early_header_mutation_extensions"])
    config.setdefault("stats_config", {}).update(parts["stats_config"])
    config["static_resources"]["clusters"].extend(parts["clusters"])
    return config


@dataclass
class Merged:
    workers: dict[str, EmulatedWorker]
    server: Child
    envoy: EnvoyProcess
    url: str
    log_dir: Path

    def post(self, path: str, body: dict[str, Any], pd: bool = True,
             headers: dict[str, str] | None = None) -> httpx.Response:
        headers = {"content-type": "application/json", **(headers or {})}
        if pd:
            headers["x-prefiller-host-port"] = self.workers["prefill"].address
        with httpx.Client(base_url=self.url, timeout=60) as client:
            return client.post(path, content=json.dumps(body), headers=headers)

    def get(self, path: str) -> httpx.Response:
        with httpx.Client(base_url=self.url, timeout=60) as client:
            return client.get(path)


@contextlib.contextmanager
def merged_stack(trusted_sources: str) -> Iterator[Merged]:
    """Emulated workers, our server, and the user's Envoy with the parts rendered for ``trusted_sources``."""
    log_dir = Path(tempfile.mkdtemp(prefix="pd-extproc-parts-"))
    env = without_settings(os.environ)
    workers = start_workers([WorkerSpec("prefill", "prefill"), WorkerSpec("decode", "decode")], log_dir,
                            READY_TIMEOUT, env)
    settings_env = {**TEST_DEFAULTS, "PD_EXTPROC_GRPC_LISTEN": "127.0.0.1:0",
                    "PD_EXTPROC_TRUSTED_SOURCES": trusted_sources}
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


@pytest.fixture(scope="module")
def merged() -> Iterator[Merged]:
    """Our loopback client is a trusted source: the RBAC check on our route lets it through."""
    with merged_stack("127.0.0.0/8,::1/128") as stack:
        yield stack


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


_FORGED_KV = {"remote_host": "10.9.9.9", "remote_port": 5600, "remote_engine_id": "x", "remote_block_ids": [1],
              "do_remote_prefill": True}


@pytest.mark.parametrize("path,body", [
    (COMPLETIONS, {"model": "emulated", "prompt": "hi", "max_tokens": 2, "kv_transfer_params": _FORGED_KV}),
    ("/v1/responses", {"model": "emulated", "input": "hi", "kv_transfer_params": _FORGED_KV}),
    (CHAT, {**chat_body(), "bootstrap_host": "10.9.9.9", "bootstrap_room": 7}),
], ids=["completions", "responses", "chat-sglang"])
def test_steering_members_are_refused_on_the_users_route(parts: Merged, path: str, body: dict[str, Any]) -> None:
    """No x-prefiller-host-port: the user's own catch-all route takes it, and the parts' guard refuses
    it there with the P/D route's documented 400 (the parts used to render no guard at all)."""
    response = parts.post(path, body, pd=False)
    error = assert_error(response, 400, "reserved_request_field")
    assert error["param"] in ("kv_transfer_params", "bootstrap_host", "bootstrap_room")
    assert parts.workers["decode"].requests() == [] and parts.workers["prefill"].requests() == []


def test_steering_headers_never_reach_decode_on_the_users_route(parts: Merged) -> None:
    headers = {"x-override-bootstrap-host": "10.9.9.9", "x-trtllm-disagg-auth": "forged",
               "x-kv-cache-source-host-port": "10.9.9.9:1"}
    response = parts.post(COMPLETIONS, {"model": "emulated", "prompt": "hi", "max_tokens": 2}, pd=False,
                          headers=headers)
    assert response.status_code == 200, response.text
    received = {name for name, _ in only(parts.workers["decode"].requests())["headers"]}
    assert received.isdisjoint(headers), received & set(headers)


def test_pd_timing_histograms_are_recorded(parts: Merged) -> None:
    """The bootstrap's timing loggers come with the parts: a P/D request lands in pd.decode_ms (Envoy
    merges histograms at its stats flush, so the sample shows up shortly after the answer)."""
    assert parts.post(CHAT, chat_body(max_tokens=2)).status_code == 200

    def recorded() -> bool:
        stats = parts.envoy.admin_get("/stats?filter=^pd\\.decode_ms").decode()
        return "pd.decode_ms.code.200" in stats and "No recorded values" not in stats

    assert eventually(recorded), parts.envoy.admin_get("/stats?filter=^pd\\.").decode()


def test_an_untrusted_peer_cannot_name_a_prefill_target() -> None:
    """Trusted sources that exclude our loopback client: the pd route refuses it (403
    prefill_target_forbidden) before our server or any worker is reached; its plain requests still pass."""
    with merged_stack("10.0.0.0/8") as stack:
        assert_error(stack.post(CHAT, chat_body()), 403, "prefill_target_forbidden")
        assert stack.workers["prefill"].requests() == [] and stack.workers["decode"].requests() == []
        assert stack.post(CHAT, chat_body(max_tokens=2), pd=False).status_code == 200
        assert "kv_transfer_params" not in only(stack.workers["decode"].requests())["json"]

        # Counted as the full bootstrap counts it (envoy_pd_untrusted_picker_header_rq): once, the refusal only.
        def counted() -> bool:
            stats = stack.envoy.admin_get("/stats?filter=^pd\\.untrusted_picker_header_rq").decode()
            return "pd.untrusted_picker_header_rq: 1" in stats

        assert eventually(counted), stack.envoy.admin_get("/stats?filter=^pd\\.").decode()


def test_our_server_down_is_our_json_503_on_our_route_only(parts: Merged) -> None:
    parts.server.stop(sig=signal.SIGKILL)
    assert_error(parts.post(CHAT, chat_body()), 503, "pd_extproc_unavailable")
    assert parts.workers["decode"].requests() == [], "no decode without a handoff"
    assert parts.post(COMPLETIONS, {"model": "emulated", "prompt": "hi", "max_tokens": 2}, pd=False).status_code == 200
    gone = parts.get("/gone/x")
    assert gone.status_code == 503 and gone.text == USER_503
