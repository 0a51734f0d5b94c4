"""The rendered Envoy bootstrap: valid for the real binary, and consistent with the settings."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import pytest

from extproc.config import load_settings
from extproc.envoy.bootstrap import _LOCAL_REPLY_RULES, render, render_yaml
from extproc.protocol.errors import SPEC, Code
from extproc.protocol.units import parse_duration
from tests.harness import envoy_bin

VARIANTS = {
    "defaults": {},
    "unix-socket": {"PD_EXTPROC_GRPC_LISTEN": "unix:/var/run/pd-extproc/extproc.sock"},
    "trusted-sources": {"PD_EXTPROC_TRUSTED_SOURCES": "10.0.0.0/8,fd00::/8"},
    "trust-client-steering": {"PD_EXTPROC_TRUST_CLIENT_STEERING": "true"},
    "workers-unix": {"PD_EXTPROC_GRPC_LISTEN": "unix:/var/run/pd-extproc/extproc.sock", "PD_EXTPROC_WORKERS": "3"},
    "workers-tcp": {"PD_EXTPROC_GRPC_LISTEN": "127.0.0.1:50051", "PD_EXTPROC_WORKERS": "2"},
    "dns-decode": {"PD_EXTPROC_DECODE": "vllm-decode.local:8200", "PD_EXTPROC_PREFILL_DEADLINE": "5m",
                   "PD_EXTPROC_DECODE_IDLE_TIMEOUT": "10m", "PD_EXTPROC_MAX_REQUEST_BYTES": "64MiB"},
}


@pytest.mark.parametrize("name", VARIANTS)
def test_rendered_config_passes_envoy_validate(name: str, tmp_path: Path) -> None:
    path = tmp_path / "envoy.yaml"
    path.write_text(render_yaml(load_settings(VARIANTS[name], {})))
    result = subprocess.run([envoy_bin(), "--mode", "validate", "-c", str(path)], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0, result.stderr[-2000:]
    assert f"configuration '{path}' OK" in result.stdout + result.stderr


def _hcm(config: dict[str, Any], chain: int = 0) -> dict[str, Any]:
    typed: dict[str, Any] = config["static_resources"]["listeners"][0]["filter_chains"][chain]["filters"][0][
        "typed_config"]
    return typed


def test_timeouts_and_limits_come_from_one_settings_object() -> None:
    settings = load_settings({"PD_EXTPROC_PREFILL_DEADLINE": "40s", "PD_EXTPROC_MAX_REQUEST_BYTES": "8MiB"}, {})
    config = render(settings)
    hcm = _hcm(config)
    ext_proc = next(f for f in hcm["http_filters"] if f["name"] == "envoy.filters.http.ext_proc")["typed_config"]
    assert parse_duration(ext_proc["message_timeout"].replace("s", "s")) == 45.0 > settings.prefill_deadline
    assert ext_proc["failure_mode_allow"] is False
    assert ext_proc["processing_mode"]["request_body_mode"] == "BUFFERED"
    assert ext_proc["processing_mode"]["response_header_mode"] == "SKIP"
    limit = next(f for f in hcm["http_filters"] if f["name"] == "envoy.filters.http.body_size_limit")
    assert limit["typed_config"]["max_request_bytes"] == 8 << 20
    pd_route = hcm["route_config"]["virtual_hosts"][0]["routes"][0]
    assert pd_route["request_body_buffer_limit"] == 8 << 20
    assert parse_duration(hcm["stream_idle_timeout"]) > parse_duration(ext_proc["message_timeout"])


def test_only_the_pd_route_runs_ext_proc_and_both_strip_the_pickers_headers() -> None:
    """ext_proc is disabled by default and enabled by the pd route alone (Envoy then builds no ext_proc
    filter for a passthrough request); the pd route's per-route config overrides nothing."""
    hcm = _hcm(render(load_settings({}, {})))
    ext_proc = next(f for f in hcm["http_filters"] if f["name"] == "envoy.filters.http.ext_proc")
    assert ext_proc["disabled"] is True
    routes = hcm["route_config"]["virtual_hosts"][0]["routes"]
    assert [r["name"] for r in routes] == ["pd", "passthrough"]
    enabled = routes[0]["typed_per_filter_config"]["envoy.filters.http.ext_proc"]
    assert enabled["@type"].endswith("envoy.config.route.v3.FilterConfig") and not enabled.get("disabled")
    assert enabled["config"]["overrides"] == {}
    assert "typed_per_filter_config" not in routes[1]
    picker = ["x-encoder-hosts-ports", "x-kv-cache-source-host-port", "x-prefiller-host-port"]
    assert all(set(picker) <= set(r["request_headers_to_remove"]) for r in routes)


def test_untrusted_sources_get_no_pd_route_and_no_ext_proc() -> None:
    config = render(load_settings({"PD_EXTPROC_TRUSTED_SOURCES": "10.0.0.0/8"}, {}))
    chains = config["static_resources"]["listeners"][0]["filter_chains"]
    assert chains[0]["filter_chain_match"]["source_prefix_ranges"] == [{"address_prefix": "10.0.0.0", "prefix_len": 8}]
    untrusted = _hcm(config, 1)
    routes = untrusted["route_config"]["virtual_hosts"][0]["routes"]
    # A P/D request naming a prefill target is refused there (as the parts' RBAC refuses it); the header on
    # any other request is dropped and the request served as a passthrough, on a route of its own; both counted.
    assert [r["name"] for r in routes] == ["untrusted_picker_header", "untrusted_picker_header_passthrough",
                                           "passthrough"]
    trusted_pd = _hcm(config, 0)["route_config"]["virtual_hosts"][0]["routes"][0]
    assert routes[0]["match"] == trusted_pd["match"] and routes[0]["direct_response"] == {"status": 403}
    assert "route" not in routes[0]
    assert routes[1]["route"] == routes[2]["route"]
    assert routes[1]["request_headers_to_remove"] == routes[2]["request_headers_to_remove"]
    assert "x-prefiller-host-port" in routes[1]["request_headers_to_remove"]
    assert all("typed_per_filter_config" not in route or "envoy.filters.http.ext_proc" not in
               route["typed_per_filter_config"] for route in routes)
    assert all(f["name"] != "envoy.filters.http.ext_proc" for f in untrusted["http_filters"])
    first = untrusted["local_reply_config"]["mappers"][0]
    assert first["body_format_override"]["json_format"]["error"]["code"] == "prefill_target_forbidden"
    assert first["status_code"] == 403
    assert "untrusted_picker_header'" in first["filter"]["extension_filter"]["typed_config"]["expression"]


def test_local_reply_rules_are_ordered() -> None:
    """Envoy's own errors map to our codes; the catch-all gateway_error comes last and keeps the status;
    every mapper leaves our own pd_* replies alone."""
    codes = [code for _, code, _ in _LOCAL_REPLY_RULES]
    assert codes[-1] is Code.GATEWAY_ERROR and _LOCAL_REPLY_RULES[-1][2] is True
    assert codes.index(Code.PD_EXTPROC_TIMEOUT) < codes.index(Code.PD_EXTPROC_UNAVAILABLE)
    mappers = _hcm(render(load_settings({}, {})))["local_reply_config"]["mappers"]
    for mapper, (_, code, keep) in zip(mappers, _LOCAL_REPLY_RULES, strict=True):
        expression = mapper["filter"]["extension_filter"]["typed_config"]["expression"]
        assert expression.startswith("!response.code_details.startsWith('pd_')")
        assert mapper["body_format_override"]["json_format"]["error"]["code"] == code.value
        assert ("status_code" not in mapper) if keep else mapper["status_code"] == SPEC[code].status
