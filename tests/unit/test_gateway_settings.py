"""PD_EXTPROC_MODE and the sidecar settings gateway mode refuses (config._gateway_problems)."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from extproc.config import ConfigError, load_settings
from extproc.envoy.bootstrap import _LOCAL_REPLY_RULES, EXT_PROC_FAILED, render
from extproc.envoy.parts import (
    GATEWAY_STATUS_ON_ERROR,
    gateway_local_reply_rules,
    gateway_parts,
    render_parts_yaml,
    sidecar_parts,
)
from extproc.protocol.errors import SPEC, Code
from tests.harness import envoy_bin


def test_sidecar_is_the_default_mode() -> None:
    assert load_settings({}, {}).mode == "sidecar"
    assert load_settings({"PD_EXTPROC_MODE": "gateway"}, {}).mode == "gateway"


@pytest.mark.parametrize("env,problem", [
    ({"PD_EXTPROC_MODE": "ingress"}, "expected one of"),
    ({"PD_EXTPROC_MODE": "gateway", "PD_EXTPROC_DECODE_QUEUE_LIMIT": "8"}, "decode_queue_limit: not in gateway mode"),
    ({"PD_EXTPROC_MODE": "gateway", "PD_EXTPROC_ADAPTER": "sglang"}, "not supported in gateway mode"),
    ({"PD_EXTPROC_MODE": "gateway", "PD_EXTPROC_WORKERS": "2"}, "workers: not in gateway mode .* more replicas"),
], ids=["unknown", "decode-queue", "concurrent-adapter", "workers"])
def test_settings_without_meaning_in_gateway_mode_refuse_to_start(env: dict[str, str], problem: str) -> None:
    with pytest.raises(ConfigError, match=problem):
        load_settings(env, {})


def test_the_aggregated_fallback_is_allowed_in_gateway_mode() -> None:
    """It sends the client's body to the decode endpoint the picker chose (docs/gateway.md)."""
    settings = load_settings({"PD_EXTPROC_MODE": "gateway", "PD_EXTPROC_PREFILL_FALLBACK": "aggregated"}, {})
    assert settings.prefill_fallback == "aggregated"


def test_envoy_config_in_gateway_mode_renders_only_parts(capsys: pytest.CaptureFixture[str]) -> None:
    from extproc.cli import EXIT_CONFIG, main

    assert main(["envoy-config"], {"PD_EXTPROC_MODE": "gateway"}) == EXIT_CONFIG
    assert "use --parts" in capsys.readouterr().err
    assert main(["envoy-config", "--parts", "--route-name", "httproute/llm/r/rule/0/match/0/*"],
                {"PD_EXTPROC_MODE": "gateway"}) == 0
    parts = yaml.safe_load(capsys.readouterr().out)
    body_limit, guard, ext_proc = parts["http_filters"]
    assert body_limit["typed_config"]["max_request_bytes"] == 32 << 20
    assert guard["name"] == "envoy.filters.http.lua", "the client guard first, for requests we do not read as P/D"
    skipped_for = guard["typed_config"]["xds_matcher"]["matcher_list"]["matchers"][0]["predicate"]
    assert [p["single_predicate"]["input"]["name"] for p in skipped_for["and_matcher"]["predicate"]] == [
        ":method", ":path", "x-prefiller-host-port"], "skipped only for what our server reads as P/D"
    wrapper = ext_proc["typed_config"]
    skip = wrapper["xds_matcher"]["matcher_list"]["matchers"]
    assert len(skip) == 1 and skip[0]["on_match"]["action"]["typed_config"]["@type"].endswith("SkipFilter")
    assert skip[0]["predicate"]["not_matcher"]["single_predicate"]["input"]["typed_config"]["header_name"] == \
        "x-prefiller-host-port", "skipped only when the picker set no prefill target"
    config = wrapper["extension_config"]["typed_config"]
    assert config["allow_mode_override"] is True and config["failure_mode_allow"] is False
    assert config["status_on_error"] == {"code": GATEWAY_STATUS_ON_ERROR}
    assert config["allowed_override_modes"] == [{"request_header_mode": "SEND", "request_trailer_mode": "SKIP",
                                                 "response_header_mode": "SKIP", "response_trailer_mode": "SKIP"}]
    assert "disabled" not in ext_proc
    assert all("xds.route_name == 'httproute/llm/r/rule/0/match/0/*'" in m["filter"]["extension_filter"]
               ["typed_config"]["expression"] for m in parts["local_reply_mappers"])


GATEWAY = load_settings({"PD_EXTPROC_MODE": "gateway"}, {})
SIDECAR = load_settings({}, {})


def _ext_proc_config(filter_: dict[str, Any]) -> dict[str, Any]:
    """The ExternalProcessor config of an http filter, inside its matcher if it has one."""
    typed: dict[str, Any] = filter_["typed_config"]
    return dict(typed.get("extension_config", {}).get("typed_config", typed))


def test_our_filter_fails_with_its_own_mark_in_gateway_mode_and_503_in_the_sidecar() -> None:
    """Gateway mode runs two ext_procs; the mark is a status nothing else answers on the route: none of our
    codes, none of the statuses Envoy or the picker answer locally there. The sidecar keeps 503."""
    assert _ext_proc_config(gateway_parts(GATEWAY, "r")["http_filters"][-1])["status_on_error"] == {
        "code": GATEWAY_STATUS_ON_ERROR}
    assert _ext_proc_config(sidecar_parts(SIDECAR)["http_filters"][-1])["status_on_error"] == {"code": 503}
    assert GATEWAY_STATUS_ON_ERROR not in {spec.status for spec in SPEC.values()}
    assert GATEWAY_STATUS_ON_ERROR not in {400, 404, 408, 413, 429, 431, 500, 502, 503, 504}


def test_gateway_mappers_label_only_our_mark_pd_extproc_unavailable() -> None:
    """The sidecar's rules, except the ext_proc rule: our mark is pd_extproc_unavailable (503), and any other
    ext_proc failure (the picker's) is gateway_error with its own status, before the decode 503/504 rules
    could name it a decode failure. The message timeout rule (a fixed 504 for both filters) is unchanged."""
    rules = gateway_local_reply_rules()
    codes = [code for _, code, _ in rules]
    ours = codes.index(Code.PD_EXTPROC_UNAVAILABLE)
    assert rules[ours] == (f"response.code == {GATEWAY_STATUS_ON_ERROR}", Code.PD_EXTPROC_UNAVAILABLE, False)
    assert rules[ours + 1] == (EXT_PROC_FAILED, Code.GATEWAY_ERROR, True)
    assert ours + 1 < codes.index(Code.DECODE_UPSTREAM_TIMEOUT) < codes.index(Code.DECODE_UPSTREAM_UNAVAILABLE)
    assert codes.index(Code.PD_EXTPROC_TIMEOUT) < ours
    assert [r for r in rules if r[0] not in (EXT_PROC_FAILED, rules[ours][0])] == [
        r for r in _LOCAL_REPLY_RULES if r[0] != EXT_PROC_FAILED]
    mappers = gateway_parts(GATEWAY, "r")["local_reply_mappers"]
    assert [m["body_format_override"]["json_format"]["error"]["code"] for m in mappers] == [c.value for c in codes]
    assert mappers[ours]["status_code"] == SPEC[Code.PD_EXTPROC_UNAVAILABLE].status
    assert "status_code" not in mappers[ours + 1]


def test_the_sidecar_mappers_are_unchanged() -> None:
    """One ext_proc in the sidecar's Envoy: any ext_proc failure is ours, and the parts equal the bootstrap."""
    assert (EXT_PROC_FAILED, Code.PD_EXTPROC_UNAVAILABLE, False) in _LOCAL_REPLY_RULES
    hcm = render(SIDECAR)["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    def expressions(mappers: list[dict[str, Any]]) -> list[str]:
        return [m["filter"]["extension_filter"]["typed_config"]["expression"] for m in mappers]

    assert expressions(sidecar_parts(SIDECAR)["local_reply_mappers"]) == [
        f"xds.route_name == 'pd' && ({e})" for e in expressions(hcm["local_reply_config"]["mappers"])]


def test_the_gateway_parts_in_a_gateway_shaped_envoy_pass_envoy_validate(tmp_path: Path) -> None:
    """The rendered --parts (gateway mode) in the hand-written gateway shape tests/gateway runs, with the
    mappers and status_on_error above: accepted by the real Envoy."""
    from tests.gateway.bootstrap import ROUTE, gateway_bootstrap

    assert yaml.safe_load(render_parts_yaml(GATEWAY, route_name=ROUTE))["local_reply_mappers"] == \
        gateway_parts(GATEWAY, ROUTE)["local_reply_mappers"]
    path = tmp_path / "envoy.yaml"
    path.write_text(yaml.safe_dump(gateway_bootstrap(GATEWAY, "127.0.0.1:9002", ["127.0.0.1:50051"])))
    result = subprocess.run([envoy_bin(), "--mode", "validate", "-c", str(path)], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0, result.stderr[-2000:]
