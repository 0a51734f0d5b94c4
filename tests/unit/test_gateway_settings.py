"""PD_EXTPROC_MODE and the sidecar settings gateway mode refuses (config._gateway_problems)."""

from __future__ import annotations

import pytest

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
