"""PD_EXTPROC_MODE and the sidecar settings gateway mode refuses (config._gateway_problems)."""

from __future__ import annotations

import pytest
import yaml

from extproc.config import ConfigError, load_settings


def test_sidecar_is_the_default_mode() -> None:
    assert load_settings({}, {}).mode == "sidecar"
    assert load_settings({"PD_EXTPROC_MODE": "gateway"}, {}).mode == "gateway"


@pytest.mark.parametrize("env,problem", [
    ({"PD_EXTPROC_MODE": "ingress"}, "expected one of"),
    ({"PD_EXTPROC_MODE": "gateway", "PD_EXTPROC_DECODE_QUEUE_LIMIT": "8"}, "decode_queue_limit: not in gateway mode"),
    ({"PD_EXTPROC_MODE": "gateway", "PD_EXTPROC_ADAPTER": "sglang"}, "not supported in gateway mode"),
], ids=["unknown", "decode-queue", "concurrent-adapter"])
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
    guard, ext_proc = parts["http_filters"]
    assert guard["name"] == "envoy.filters.http.lua", "the client guard first, for requests we never see"
    assert "not_matcher" not in guard["typed_config"]["xds_matcher"]["matcher_list"]["matchers"][0]["predicate"]
    wrapper = ext_proc["typed_config"]
    skip = wrapper["xds_matcher"]["matcher_list"]["matchers"]
    assert len(skip) == 1 and skip[0]["on_match"]["action"]["typed_config"]["@type"].endswith("SkipFilter")
    assert skip[0]["predicate"]["not_matcher"]["single_predicate"]["input"]["typed_config"]["header_name"] == \
        "x-prefiller-host-port", "skipped only when the picker set no prefill target"
    config = wrapper["extension_config"]["typed_config"]
    assert config["allow_mode_override"] is True and config["failure_mode_allow"] is False
    assert config["allowed_override_modes"] == [{"request_header_mode": "SEND", "request_trailer_mode": "SKIP",
                                                 "response_header_mode": "SKIP", "response_trailer_mode": "SKIP"}]
    assert "disabled" not in ext_proc
    assert all("xds.route_name == 'httproute/llm/r/rule/0/match/0/*'" in m["filter"]["extension_filter"]
               ["typed_config"]["expression"] for m in parts["local_reply_mappers"])
