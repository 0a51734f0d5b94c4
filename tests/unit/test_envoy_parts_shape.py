"""What `envoy-config --parts` renders: everything the full bootstrap protects P/D with (the guard, the
body limit, header stripping on the other routes, the trusted-sources check, the timing loggers), and a
gateway ext_proc cluster that reaches a Service or fails Envoy's validation until it is set."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import yaml

from extproc.config import load_settings
from extproc.envoy.bootstrap import EXT_PROC_FILTER, render, timing_logs
from extproc.envoy.guard import LUA_FILTER, guard_filter, stripped_headers
from extproc.envoy.parts import RBAC_FILTER, gateway_parts, render_parts_yaml, sidecar_parts
from extproc.protocol.headers import PICKER_HEADERS
from extproc.protocol.units import parse_address
from tests.harness import envoy_bin


def _names(parts: dict[str, Any]) -> list[str]:
    return [f["name"] for f in parts["http_filters"]]


def _trusted_hcm(settings_env: dict[str, str]) -> dict[str, Any]:
    chain = render(load_settings(settings_env))["static_resources"]["listeners"][0]["filter_chains"][0]
    return dict(chain["filters"][0]["typed_config"])


def test_sidecar_parts_carry_the_bootstraps_filters_in_its_order() -> None:
    """The parts used to be the ext_proc filter alone: no guard, no body limit."""
    parts = sidecar_parts(load_settings({}))
    hcm = _trusted_hcm({})
    assert parts["http_filters"] == hcm["http_filters"][:-1], "the bootstrap's filters but its router"
    assert _names(parts) == ["envoy.filters.http.body_size_limit", LUA_FILTER, EXT_PROC_FILTER]
    assert parts["http_filters"][1] == guard_filter()
    route = parts["routes"][0]
    assert route["typed_per_filter_config"][LUA_FILTER]["disabled"] is True, "our server reads the pd route's body"


def test_sidecar_parts_protect_the_users_other_routes() -> None:
    settings = load_settings({})
    parts = sidecar_parts(settings)
    assert parts["virtual_host_additions"] == {"request_headers_to_remove": sorted(PICKER_HEADERS),
                                               "request_body_buffer_limit": settings.max_request_bytes}
    removed = [m["remove"] for m in parts["early_header_mutation_extensions"][0]["typed_config"]["mutations"]]
    assert removed == stripped_headers()
    assert parts["access_log"] == timing_logs("pd") == [
        log for log in _trusted_hcm({})["access_log"] if log["name"] == "envoy.access_loggers.stats"]
    assert parts["stats_config"] == render(settings)["stats_config"]


def test_sidecar_parts_check_trusted_sources_on_the_pd_route() -> None:
    parts = sidecar_parts(load_settings({"PD_EXTPROC_TRUSTED_SOURCES": "10.0.0.0/8,fd00::/8"}))
    assert _names(parts) == ["envoy.filters.http.body_size_limit", LUA_FILTER, RBAC_FILTER, EXT_PROC_FILTER]
    rbac = parts["routes"][0]["typed_per_filter_config"][RBAC_FILTER]["config"]["rbac"]["rules"]
    assert rbac["action"] == "ALLOW"
    assert rbac["policies"]["trusted_sources"]["principals"] == [
        {"direct_remote_ip": {"address_prefix": "10.0.0.0", "prefix_len": 8}},
        {"direct_remote_ip": {"address_prefix": "fd00::", "prefix_len": 8}}]
    first = parts["local_reply_mappers"][0]
    assert "rbac_access_denied" in first["filter"]["extension_filter"]["typed_config"]["expression"]
    assert first["body_format_override"]["json_format"]["error"]["code"] == "prefill_target_forbidden"
    assert RBAC_FILTER not in _names(sidecar_parts(load_settings({}))), "no check without trusted sources"


def test_trust_client_steering_drops_the_guard_from_the_parts_as_from_the_bootstrap() -> None:
    parts = sidecar_parts(load_settings({"PD_EXTPROC_TRUST_CLIENT_STEERING": "true"}))
    assert LUA_FILTER not in _names(parts) and "early_header_mutation_extensions" not in parts
    assert parts["http_filters"] == _trusted_hcm({"PD_EXTPROC_TRUST_CLIENT_STEERING": "true"})["http_filters"][:-1]


def _validate(tmp_path: Path, cluster: dict[str, Any]) -> subprocess.CompletedProcess[str]:
    path = tmp_path / "envoy.yaml"
    path.write_text(yaml.safe_dump({"static_resources": {"clusters": [cluster]}}))
    return subprocess.run([envoy_bin(), "--mode", "validate", "-c", str(path)], capture_output=True, text=True,
                          timeout=60)


def test_gateway_parts_name_a_dns_cluster_or_a_placeholder_envoy_refuses(tmp_path: Path) -> None:
    """It used to be a STATIC 127.0.0.1 cluster, which cannot reach a Service."""
    settings = load_settings({"PD_EXTPROC_MODE": "gateway"})
    placeholder = gateway_parts(settings, "r")["clusters"][0]
    assert placeholder["type"] == "STRICT_DNS"
    refused = _validate(tmp_path, placeholder)
    assert refused.returncode != 0 and "SocketAddressValidationError.Address" in refused.stderr
    set_cluster = gateway_parts(settings, "r", parse_address("10.1.2.3:50051"))["clusters"][0]
    assert set_cluster["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]["address"] == {
        "socket_address": {"address": "10.1.2.3", "port_value": 50051}}
    assert set_cluster["health_checks"] == render(load_settings({}))["static_resources"]["clusters"][0]["health_checks"]
    accepted = _validate(tmp_path, set_cluster)
    assert accepted.returncode == 0, accepted.stderr[-2000:]


def test_gateway_parts_carry_the_body_limit_and_the_timing_loggers_for_the_route() -> None:
    parts = gateway_parts(load_settings({"PD_EXTPROC_MODE": "gateway"}), "httproute/llm/r/rule/0/match/0/*")
    assert _names(parts)[0] == "envoy.filters.http.body_size_limit"
    assert parts["access_log"] == timing_logs("httproute/llm/r/rule/0/match/0/*")
    assert "xds.route_name == 'httproute/llm/r/rule/0/match/0/*'" in \
        parts["access_log"][0]["filter"]["extension_filter"]["typed_config"]["expression"]


def test_envoy_config_takes_the_ext_proc_service_address(capsys: Any) -> None:
    from extproc.cli import EXIT_CONFIG, main

    gateway = {"PD_EXTPROC_MODE": "gateway"}
    assert main(["envoy-config", "--parts", "--ext-proc-address", "pd-extproc.llm.svc:50051"], gateway) == 0
    cluster = yaml.safe_load(capsys.readouterr().out)["clusters"][0]
    assert cluster["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]["address"] == {
        "socket_address": {"address": "pd-extproc.llm.svc", "port_value": 50051}}
    assert main(["envoy-config", "--parts", "--ext-proc-address", "no-port"], gateway) == EXIT_CONFIG
    assert "--ext-proc-address" in capsys.readouterr().err


LOOSENED = {"PD_EXTPROC_GUARD_ALLOW_COMPRESSED_BODIES": "true", "PD_EXTPROC_GUARD_ALLOW_FORM_JSON_FIELDS": "true"}


def test_the_guards_loosenings_reach_the_parts_as_they_reach_the_bootstrap() -> None:
    """The parts used to render the guard with both loosenings off whatever the settings said."""
    settings = load_settings({"PD_EXTPROC_TRUSTED_SOURCES": "10.0.0.0/8", **LOOSENED})
    loosened = guard_filter(allow_compressed=True, allow_form_json=True)
    assert sidecar_parts(settings)["http_filters"][1] == loosened
    assert loosened in _trusted_hcm({"PD_EXTPROC_TRUSTED_SOURCES": "10.0.0.0/8", **LOOSENED})["http_filters"]
    gateway_guard = gateway_parts(settings, "inference")["http_filters"][1]
    assert gateway_guard["typed_config"]["extension_config"]["typed_config"] == loosened["typed_config"]


def test_the_sidecar_parts_header_says_where_they_send_and_what_they_need_beside_them() -> None:
    """The header's placement notes: the route already names --decode-cluster's cluster (nothing to set),
    and the histograms need the bootstrap's stats flush interval, which the parts cannot carry."""
    settings = load_settings({})
    text = render_parts_yaml(settings, "my_decode")
    header = text[:text.index("\nhttp_filters:")]
    assert "route.cluster" not in header and "--decode-cluster" in header
    assert [route["route"]["cluster"] for route in yaml.safe_load(text)["routes"]] == ["my_decode"]
    assert f"stats_flush_interval: {render(settings)['stats_flush_interval']}" in header
