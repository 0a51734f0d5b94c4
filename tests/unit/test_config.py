"""Settings: every value from env or flag, every bad value refused at once, timeouts nested."""

from __future__ import annotations

import pytest

from extproc.config import ENV_PREFIX, ConfigError, Settings, load_settings, specs
from extproc.protocol.errors import Code, PdError
from extproc.protocol.prefill_json import upstream_status_error
from extproc.protocol.units import format_duration, parse_address, parse_duration, parse_size


def test_defaults() -> None:
    settings = load_settings({}, {})
    assert settings == Settings()
    assert settings.message_timeout == 65.0
    assert settings.grpc_max_message_bytes == (64 << 20) + (1 << 20)


def test_flags_override_environment() -> None:
    settings = load_settings({"PD_EXTPROC_PREFILL_DEADLINE": "10s"}, {"prefill_deadline": "20s"})
    assert settings.prefill_deadline == 20.0


def test_every_setting_has_an_env_var_and_a_flag() -> None:
    for spec in specs():
        assert spec.env == ENV_PREFIX + spec.name.upper()
        assert spec.flag == "--" + spec.name.replace("_", "-")
        Settings().value(spec.name)  # every setting has a value (its default)


def test_all_problems_are_reported_together() -> None:
    with pytest.raises(ConfigError) as caught:
        load_settings({"PD_EXTPROC_PREFILL_DEADLINE": "soon", "PD_EXTPROC_MAX_INFLIGHT": "0",
                       "PD_EXTPROC_ADAPTR": "vllm_nixl"}, {"decode": "nohost"})
    message = str(caught.value)
    for expected in ("PD_EXTPROC_PREFILL_DEADLINE", "PD_EXTPROC_MAX_INFLIGHT", "PD_EXTPROC_ADAPTR: unknown setting",
                     "--decode"):
        assert expected in message


@pytest.mark.parametrize("env,problem", [
    ({"PD_EXTPROC_ADAPTER": "tgi"}, "expected one of"),
    ({"PD_EXTPROC_PROTOCOL": "vllm-0.10-nixl-pull"}, "does not implement protocol"),
    ({"PD_EXTPROC_ENVOY_MESSAGE_TIMEOUT": "60s"}, "must exceed prefill_deadline"),
    ({"PD_EXTPROC_DECODE_IDLE_TIMEOUT": "30s"}, "decode_idle_timeout must exceed"),
    ({"PD_EXTPROC_PREFILL_CONNECT_TIMEOUT": "2m"}, "must not exceed prefill_deadline"),
    ({"PD_EXTPROC_PREFILL_CERT_FILE": "/etc/hostname", "PD_EXTPROC_PREFILL_TLS": "true"}, "needs prefill_key_file"),
    ({"PD_EXTPROC_PREFILL_SERVER_NAME": "x"}, "prefill_tls is false"),
    ({"PD_EXTPROC_PREFILL_CA_FILE": "/no/such/file"}, "no such file"),
    ({"PD_EXTPROC_PREFILL_ALLOW": "10.0.0.0/8"}, "bad rule"),
    ({"PD_EXTPROC_TRUSTED_SOURCES": "10.0.0.1/8"}, "PD_EXTPROC_TRUSTED_SOURCES"),
    ({"PD_EXTPROC_DEMO": "maybe"}, "expected true or false"),
], ids=lambda v: v if isinstance(v, str) else "")
def test_invalid_settings_refuse_to_start(env: dict[str, str], problem: str) -> None:
    with pytest.raises(ConfigError, match=problem):
        load_settings(env, {})


def test_the_envoy_message_timeout_always_exceeds_the_prefill_deadline() -> None:
    for deadline in ("1s", "30s", "600s"):
        env = {"PD_EXTPROC_PREFILL_DEADLINE": deadline, "PD_EXTPROC_PREFILL_CONNECT_TIMEOUT": "500ms",
               "PD_EXTPROC_DECODE_IDLE_TIMEOUT": "1h"}
        settings = load_settings(env, {})
        assert settings.message_timeout > settings.prefill_deadline + 1


def test_values_round_trip_through_their_display_form() -> None:
    settings = load_settings({"PD_EXTPROC_PREFILL_ALLOW": "10.0.0.0/8:80,[fd00::]/8:*",
                              "PD_EXTPROC_TRUSTED_SOURCES": "10.1.0.0/16", "PD_EXTPROC_GRPC_LISTEN": "unix:/tmp/s",
                              "PD_EXTPROC_PREFILL_READ_TIMEOUT": "250ms"}, {})
    shown = {spec.env: spec.show(settings.value(spec.name)) for spec in specs()}
    assert load_settings(shown, {}) == settings


@pytest.mark.parametrize("text,seconds", [("250ms", 0.25), ("5s", 5.0), ("1.5m", 90.0), ("1h", 3600.0)])
def test_durations(text: str, seconds: float) -> None:
    assert parse_duration(text) == seconds


def test_duration_requires_a_unit_and_formats_for_envoy() -> None:
    with pytest.raises(ValueError):
        parse_duration("5")
    assert format_duration(0.25) == "0.250s" and format_duration(65) == "65s"


@pytest.mark.parametrize("text,size", [("1048576", 1 << 20), ("512KiB", 512 << 10), ("32MiB", 32 << 20)])
def test_sizes(text: str, size: int) -> None:
    assert parse_size(text) == size


def test_addresses() -> None:
    assert parse_address("[::1]:80").grpc_target() == "[::1]:80"
    assert parse_address("unix:/run/x.sock", allow_unix=True).unix_path == "/run/x.sock"
    for bad in ("unix:/x", "localhost", "1.2.3.4:0", "1.2.3.4:70000", "unix:relative"):
        with pytest.raises(ValueError):
            parse_address(bad, allow_unix=bad == "unix:relative")


def test_fallback_is_refused_where_the_decode_worker_cannot_serve_a_request_whole() -> None:
    with pytest.raises(ConfigError, match="sglang cannot fall back"):
        load_settings({"PD_EXTPROC_ADAPTER": "sglang", "PD_EXTPROC_PREFILL_FALLBACK": "aggregated"}, {})
    assert load_settings({"PD_EXTPROC_PREFILL_FALLBACK": "aggregated"}, {}).prefill_fallback == "aggregated"


@pytest.mark.parametrize("code,falls_back", [
    (Code.PREFILL_UPSTREAM_UNAVAILABLE, True), (Code.PREFILL_UPSTREAM_TIMEOUT, True),
    (Code.INVALID_PREFILL_HANDOFF, False), (Code.PREFILL_RESPONSE_NOT_JSON, False),
    (Code.PREFILL_TARGET_FORBIDDEN, False), (Code.RESERVED_REQUEST_FIELD, False), (Code.PD_OVERLOADED, False),
])
def test_only_failures_of_the_prefill_worker_fall_back(code: Code, falls_back: bool) -> None:
    assert PdError(code).allows_fallback is falls_back


@pytest.mark.parametrize("answered,client_status,falls_back", [
    (503, 503, True), (500, 500, True), (599, 599, True), (429, 429, False), (400, 400, False),
    # Not an outage, though the client gets a 502: a redirecting ingress must be seen, not hidden.
    (302, 502, False), (204, 502, False), (101, 502, False),
])
def test_only_a_5xx_answer_falls_back(answered: int, client_status: int, falls_back: bool) -> None:
    error = upstream_status_error(answered)
    assert (error.code, error.status, error.allows_fallback) == (Code.PREFILL_UPSTREAM_ERROR, client_status, falls_back)
