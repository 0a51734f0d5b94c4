"""The SGLang and TensorRT-LLM overlays (k8s/engine-overlays/*): each swaps both engine containers, and the
engine's flags, ports, the adapter's settings, the route's paths and the picker's configuration agree with one
another and with what pd-extproc serves for that adapter. (Rendering, namespaces, the image line and the CRD
schemas are checked for them as for vLLM's overlays: test_operator_overlays.py, test_validation.py.)"""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import Any

import pytest
import yaml

from deploy import validate
from extproc import adapters
from extproc.protocol.pd_request import path_regex
from tests.deploy.conftest import Manifests
from tests.deploy.test_epp_config import PLUGINS, check, epp_config, pod_labels

pytestmark = pytest.mark.deploy

SGLANG = validate.ENGINE_OVERLAYS / "sglang"
TRTLLM = validate.ENGINE_OVERLAYS / "trtllm"
# The picker's engine label and the name of each engine's built-in metric mapping (llm-d-router v0.10.0,
# extractor/metrics/mapping_registry.go DefaultEngineTypeLabelKey, factories.go defaultEngineConfigs).
ENGINE_LABEL = "llm-d.ai/engine-type"
ENGINE = {SGLANG: ("sglang", "sglang"), TRTLLM: ("trtllm", "trtllm-serve")}  # container, picker engine
ROLES = ("pd-decode", "pd-prefill")


@pytest.fixture(params=[SGLANG, TRTLLM], ids=lambda p: p.name)
def overlay(request: pytest.FixtureRequest) -> Path:
    path: Path = request.param
    return path


def _manifests(overlay: Path) -> Manifests:
    return Manifests(validate.render_overlay(overlay), overlay)


def _settings(manifests: Manifests) -> dict[str, str]:
    return validate.decode_settings([doc.body for doc in manifests.docs])


def _flags(container: dict[str, Any]) -> dict[str, str]:
    """An engine's --name=value and --name value arguments, from its args or its shell command line."""
    words = [word for arg in container.get("args", []) for word in (shlex.split(arg) if " " in arg else [arg])]
    out: dict[str, str] = {}
    for index, word in enumerate(words):
        if word.startswith("--"):
            name, sep, value = word.partition("=")
            out[name] = value if sep else (words[index + 1] if index + 1 < len(words) else "")
    return out


def test_the_engine_overlays_exist_beside_vllms() -> None:
    assert validate.engine_overlays() == [SGLANG, TRTLLM]


def test_both_roles_run_the_engine_and_no_vllm_container_is_left(overlay: Path) -> None:
    manifests = _manifests(overlay)
    container, picker_engine = ENGINE[overlay]
    for role in ROLES:
        pod = manifests.pod(role)
        names = [c["name"] for c in pod["containers"]]
        assert names[0] == container and "vllm" not in names, (role, names)
        assert not any("vllm" in c["image"] for c in pod["containers"]), role
        assert not any(e["name"].startswith("VLLM_") for c in pod["containers"] for e in c.get("env", [])), role
        assert pod_labels(manifests, role)[ENGINE_LABEL] == picker_engine
    assert manifests.pod("pd-decode")["containers"][0]["image"] == manifests.pod("pd-prefill")["containers"][0][
        "image"], "both roles must run the same engine release"


def test_decode_listens_where_envoy_sends_the_decode_leg_and_prefill_on_the_pools_port(overlay: Path) -> None:
    manifests = _manifests(overlay)
    decode_flags = _flags(manifests.pod("pd-decode")["containers"][0])
    prefill = manifests.pod("pd-prefill")["containers"][0]
    prefill_flags = _flags(prefill)
    host, _, port = _settings(manifests)["PD_EXTPROC_DECODE"].rpartition(":")
    assert (decode_flags["--host"], decode_flags["--port"]) == (host, port) == ("127.0.0.1", "8200")
    pool = manifests.get("InferencePool", "pd-pool")["spec"]
    assert prefill_flags["--host"] == "0.0.0.0"
    assert [int(prefill_flags["--port"])] == [p["number"] for p in pool["targetPorts"]]
    assert any(p["containerPort"] == int(prefill_flags["--port"]) and p["name"] == "http" for p in prefill["ports"])


def test_pd_extproc_runs_the_engines_adapter(overlay: Path) -> None:
    assert _settings(_manifests(overlay))["PD_EXTPROC_ADAPTER"] == ENGINE[overlay][0]


def test_in_flight_limit_matches_the_decode_engines_capacity(overlay: Path) -> None:
    manifests = _manifests(overlay)
    flags = _flags(manifests.pod("pd-decode")["containers"][0])
    capacity = flags.get("--max-running-requests") or flags.get("--max_batch_size")
    assert capacity == _settings(manifests)["PD_EXTPROC_MAX_INFLIGHT"]


def test_the_route_sends_exactly_the_paths_the_adapter_serves_pd_and_envoy_agrees(overlay: Path) -> None:
    manifests = _manifests(overlay)
    served = {endpoint.value for endpoint in adapters.served(_settings(manifests)["PD_EXTPROC_ADAPTER"])}
    [rule] = manifests.get("HTTPRoute", "pd-route")["spec"]["rules"]
    matches = [m["path"] for m in rule["matches"]]
    prefixes = [m["value"] for m in matches if m["type"] == "PathPrefix"]
    exact = {m["value"] for m in matches if m["type"] == "Exact"}
    # Every P/D path reaches the pool; an exact match is there only for a path the adapter serves P/D.
    assert all(path in exact or any(path.startswith(p) for p in prefixes) for path in served), (served, matches)
    assert exact <= served, exact - served
    # The decode pod's Envoy (rendered from the same settings) routes the same paths P/D.
    bootstrap = validate.envoy_configs()[f"{validate._rel(overlay)} (init container envoy-config)"]
    assert path_regex(frozenset(adapters.served(ENGINE[overlay][0]))) in bootstrap


def test_sglang_decode_asks_the_port_the_prefill_bootstrap_server_listens_on() -> None:
    manifests = _manifests(SGLANG)
    prefill = manifests.pod("pd-prefill")["containers"][0]
    flags = _flags(prefill)
    port = flags["--disaggregation-bootstrap-port"]
    assert _settings(manifests)["PD_EXTPROC_SGLANG_BOOTSTRAP_PORT"] == port
    assert {"name": "bootstrap", "containerPort": int(port)} in prefill["ports"]
    assert {p["name"]: p["port"] for p in manifests.get("Service", "pd-prefill")["spec"]["ports"]} == {
        "http": 8000, "bootstrap": int(port)}
    decode = _flags(manifests.pod("pd-decode")["containers"][0])
    assert (decode["--disaggregation-mode"], flags["--disaggregation-mode"]) == ("decode", "prefill")
    assert decode["--disaggregation-transfer-backend"] == flags["--disaggregation-transfer-backend"]


def _mounts(container: dict[str, Any]) -> dict[str, str]:
    return {m["name"]: m["mountPath"] for m in container.get("volumeMounts", [])}


def test_trtllm_workers_and_pd_extproc_share_one_key_from_the_secret() -> None:
    manifests = _manifests(TRTLLM)
    key_file = _settings(manifests)["PD_EXTPROC_TRTLLM_AUTH_KEY_FILE"]
    assert "PD_EXTPROC_PROTOCOL" not in _settings(manifests)  # the default pin: it signs generation requests
    for role in ROLES:
        pod = manifests.pod(role)
        [volume] = [v for v in pod["volumes"] if v["name"] == "trtllm-auth"]
        assert volume["secret"]["secretName"] == "trtllm-auth" and "optional" not in volume["secret"]
        engine = pod["containers"][0]
        assert _mounts(engine)["trtllm-auth"] + "/key" == key_file
        # The key enters the worker's YAML (internal_request_auth_key), then the worker starts with it.
        [script] = engine["args"]
        assert f"$(cat {key_file})" in script and "internal_request_auth_key" in script
        assert _flags(engine)["--extra_llm_api_options"].startswith(_mounts(engine)["trtllm-run"] + "/")
        assert next(v for v in pod["volumes"] if v["name"] == "trtllm-run")["emptyDir"]["medium"] == "Memory"
    decode = manifests.pod("pd-decode")
    for container in (manifests.container("pd-decode", "pd-extproc"),
                      next(c for c in decode["initContainers"] if c["name"] == "envoy-config")):
        assert _mounts(container)["trtllm-auth"] + "/key" == key_file, container["name"]
    assert "trtllm-auth" not in _mounts(manifests.container("pd-decode", "envoy"))


def test_trtllm_workers_transfer_kv_and_serve_the_metrics_the_picker_reads() -> None:
    manifests = _manifests(TRTLLM)
    [name] = [doc.body["metadata"]["name"] for doc in manifests.docs if doc.body["kind"] == "ConfigMap"
              and doc.body["metadata"]["name"].startswith("trtllm-worker-config-")]
    worker = yaml.safe_load(manifests.get("ConfigMap", name)["data"]["worker.yaml"])
    assert worker == {"cache_transceiver_config": {"backend": "NIXL"}, "return_perf_metrics": True}
    for role in ROLES:
        volume = next(v for v in manifests.pod(role)["volumes"] if v["name"] == "trtllm-config")
        assert volume["configMap"]["name"] == name
    config = epp_config(manifests)
    plugins = {p.get("name") or p["type"]: p for p in config["plugins"]}
    assert plugins["metrics-data-source"]["parameters"] == {"path": "/prometheus/metrics"}
    sources = config["dataLayer"]["sources"]
    assert [(s["pluginRef"], [e["pluginRef"] for e in s["extractors"]]) for s in sources] == [
        ("metrics-data-source", ["core-metrics-extractor"])]
    assert all(PLUGINS[plugins[ref]["type"]].kind in ("data-source", "extractor")
               for s in sources for ref in [s["pluginRef"], *(e["pluginRef"] for e in s["extractors"])])


def test_the_picker_config_is_what_the_pinned_release_reads(overlay: Path) -> None:
    manifests = _manifests(overlay)
    assert check(epp_config(manifests), pod_labels(manifests, "pd-prefill"), pod_labels(manifests, "pd-decode")) == []


def test_sglang_serves_the_metrics_page_the_picker_the_queue_limit_and_the_monitors_read() -> None:
    """SGLang 0.5.23 mounts /metrics only with --enable-metrics (srt/entrypoints/http_server.py, behind
    `enable_metrics`, default off in srt/arg_groups/fields/observability.py): without it the picker's
    queue-scorer, PD_EXTPROC_DECODE_QUEUE_LIMIT and the monitoring component read a 404."""
    manifests = _manifests(SGLANG)
    for role in ROLES:
        assert "--enable-metrics" in _flags(manifests.pod(role)["containers"][0]), role
