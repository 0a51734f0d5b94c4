"""One frozen Settings object, read from PD_EXTPROC_* variables and matching CLI flags.

Every bad value fails here, before anything binds a port, and all problems are reported at once.
"""

from __future__ import annotations

import argparse
import dataclasses
import ipaddress
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from extproc.adapters import ENGINES, KILL_SWITCH, protocol_problem
from extproc.prefill_policy import Rule, describe, parse_allow_list
from extproc.settings_spec import (
    ENV_PREFIX,
    SettingSpec,
    choice,
    existing_file,
    non_negative_int,
    parse_bool,
    positive_duration,
    positive_int,
    positive_size,
    text_value,
)
from extproc.units import Address, format_duration, parse_address, parse_duration

ADAPTERS = (*ENGINES, KILL_SWITCH)
LOG_LEVELS = ("debug", "info", "warning", "error")
# Every engine's own settings, declared in its Engine (extproc/adapters/).
ENGINE_SPECS: tuple[SettingSpec, ...] = tuple(spec for engine in ENGINES.values() for spec in engine.settings)


def _engine_defaults() -> dict[str, Any]:
    return {spec.name: spec.default for spec in ENGINE_SPECS}


class ConfigError(ValueError):
    """One or more settings are invalid; the message lists every problem."""


@dataclass(frozen=True, slots=True)
class Settings:
    adapter: str = "vllm_nixl"
    protocol: str = ""
    grpc_listen: Address = Address("127.0.0.1", 50051)
    listen: Address = Address("0.0.0.0", 8000)
    decode: Address = Address("127.0.0.1", 8200)
    envoy_admin: Address = Address("127.0.0.1", 9901)
    envoy_stats_listen: Address | None = None  # None = no stats listener
    envoy_bin: str = "envoy"
    max_request_bytes: int = 32 << 20
    max_prefill_response_bytes: int = 1 << 20
    prefill_connect_timeout: float = 5.0
    prefill_read_timeout: float = 30.0
    prefill_deadline: float = 60.0
    envoy_message_timeout: float = 0.0  # 0 = derived: prefill_deadline + ENVOY_MESSAGE_MARGIN
    client_body_timeout: float = 30.0
    decode_idle_timeout: float = 300.0
    drain_timeout: float = 30.0
    max_inflight: int = 1024
    metrics_listen: Address = Address("0.0.0.0", 9190)
    prefill_allow: tuple[Rule, ...] = ()
    prefill_tls: bool = False
    prefill_ca_file: str = ""
    prefill_cert_file: str = ""
    prefill_key_file: str = ""
    prefill_server_name: str = ""
    trusted_sources: tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, ...] = ()
    tracing: str = "off"
    otlp_endpoint: str = "http://127.0.0.1:4318/v1/traces"
    log_level: str = "info"
    demo: bool = False
    prefill_fallback: str = "off"
    trust_client_steering: bool = False
    unsupported_variants: str = "refuse"
    decode_queue_limit: int = 0  # 0 = off
    decode_queue_interval: float = 1.0
    # The engines' own settings by name (defaults where unset); the adapter gets them at build time.
    engine_options: Mapping[str, Any] = field(default_factory=_engine_defaults)

    def value(self, name: str) -> Any:
        """A core setting or an engine's own setting, by name."""
        if name in self.engine_options:
            return self.engine_options[name]
        return getattr(self, name)

    @property
    def message_timeout(self) -> float:
        """Envoy's per-message ext_proc timeout: always above our own prefill deadline."""
        if self.envoy_message_timeout:
            return self.envoy_message_timeout
        return self.prefill_deadline + ENVOY_MESSAGE_MARGIN

    @property
    def grpc_max_message_bytes(self) -> int:
        """gRPC message limit on both sides: a body plus its mutation must fit, and never below 64 MiB."""
        return max(64 << 20, 2 * self.max_request_bytes + (1 << 20))

    def describe(self) -> dict[str, str]:
        """The effective settings for the startup log line. Secrets are never settings values: a key
        setting holds the path of its file, which is read only when the adapter is built."""
        return {spec.name: spec.show(self.value(spec.name)) for spec in SPECS}


# Envoy must not time out before we answer our own deadline with a JSON error.
ENVOY_MESSAGE_MARGIN = 5.0


def _networks(text: str) -> tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, ...]:
    return tuple(ipaddress.ip_network(part.strip(), strict=True) for part in text.split(",") if part.strip())


def _show_networks(value: Any) -> str:
    return ",".join(str(network) for network in value)


def _optional_address(text: str) -> Address | None:
    return parse_address(text) if text.strip() else None


def _show_optional(value: Any) -> str:
    return "" if value is None else str(value)


def _http_url(text: str) -> str:
    url = text.strip()
    if not re.fullmatch(r"https?://[^\s/]+(/\S*)?", url):
        raise ValueError("expected an http:// or https:// URL")
    return url


SPECS: tuple[SettingSpec, ...] = (
    SettingSpec("adapter", choice(ADAPTERS), "P/D protocol adapter: " + ", ".join(ADAPTERS)
                + " (none answers P/D requests with 501)"),
    SettingSpec("protocol", text_value, "protocol pin of the adapter; empty = the adapter's default pin"),
    SettingSpec("grpc_listen", lambda t: parse_address(t, allow_unix=True, allow_port_zero=True),
                "ext_proc gRPC listen address: host:port or unix:/path"),
    SettingSpec("listen", lambda t: parse_address(t, allow_port_zero=True), "Envoy listener host:port"),
    SettingSpec("decode", parse_address, "local decode worker host:port (the only decode destination)"),
    SettingSpec("envoy_admin", lambda t: parse_address(t, allow_port_zero=True), "Envoy admin host:port"),
    SettingSpec("envoy_stats_listen", _optional_address,
                "host:port where Envoy serves only its /stats/prometheus (P/D timing histograms) for a "
                "scraper; empty = none (the admin port stays private)", show=_show_optional),
    SettingSpec("envoy_bin", text_value, "Envoy binary to run (a path or a name on PATH)"),
    SettingSpec("max_request_bytes", positive_size, "largest client request body (Envoy 413 above it)"),
    SettingSpec("max_prefill_response_bytes", positive_size, "largest prefill response body read"),
    SettingSpec("prefill_connect_timeout", positive_duration, "connect timeout to a prefill worker"),
    SettingSpec("prefill_read_timeout", positive_duration, "longest silence while reading the prefill response"),
    SettingSpec("prefill_deadline", positive_duration, "total deadline for the whole prefill leg"),
    SettingSpec("envoy_message_timeout", parse_duration,
                "Envoy ext_proc message_timeout; 0s = prefill_deadline + 5s"),
    SettingSpec("client_body_timeout", positive_duration, "time a client has to send the whole request"),
    SettingSpec("decode_idle_timeout", positive_duration, "longest silence on a decode stream"),
    SettingSpec("drain_timeout", positive_duration, "grace period for in-flight requests on shutdown"),
    SettingSpec("max_inflight", positive_int, "in-flight P/D requests before 503 pd_overloaded"),
    SettingSpec("metrics_listen", lambda t: parse_address(t, allow_port_zero=True),
                "HTTP host:port for /metrics, /healthz and /readyz"),
    SettingSpec("prefill_allow", parse_allow_list,
                "prefill targets allowed: CIDR:ports, [v6-CIDR]:ports or host:ports, comma-separated "
                "(ports *, N or N-M); empty = default policy (no loopback, link-local, multicast)",
                show=describe),
    SettingSpec("prefill_tls", parse_bool, "use TLS to prefill workers"),
    SettingSpec("prefill_ca_file", existing_file, "CA bundle for prefill TLS; empty = the system CAs"),
    SettingSpec("prefill_cert_file", existing_file, "client certificate for prefill mTLS"),
    SettingSpec("prefill_key_file", existing_file, "client key for prefill mTLS"),
    SettingSpec("prefill_server_name", text_value, "TLS server name to verify; empty = the target's host"),
    SettingSpec("trusted_sources", _networks,
                "CIDRs allowed to set x-prefiller-host-port (Envoy drops it from other peers); empty = all",
                show=_show_networks),
    SettingSpec("tracing", choice(("off", "otlp")), "OpenTelemetry spans: off, or otlp (OTLP/HTTP JSON export)"),
    SettingSpec("otlp_endpoint", _http_url, "OTLP/HTTP traces endpoint for tracing=otlp"),
    SettingSpec("log_level", choice(LOG_LEVELS), "log level: debug, info, warning, error"),
    SettingSpec("demo", parse_bool, "demo mode (pd-extproc up): start emulated workers"),
    SettingSpec("prefill_fallback", choice(("off", "aggregated")),
                "off, or aggregated: when the prefill worker is unreachable, too slow or answers 5xx, the local "
                "decode worker serves the request whole (marked x-pd-fallback: aggregated); never for request errors"),
    SettingSpec("unsupported_variants", choice(("refuse", "aggregated")),
                "refuse (400 unsupported_pd_variant), or aggregated: a P/D request that disaggregation cannot serve as "
                "sent (n other than 1, a batch of prompts) goes to the local decode worker exactly as sent, marked "
                "x-pd-fallback: aggregated; reason=unsupported_pd_variant; not offered for sglang"),
    SettingSpec("trust_client_steering", parse_bool,
                "true turns the client guard off: a client may then send the fields and headers that make an "
                "engine pull KV from a host of its choosing or hold KV (README, Security); only where every "
                "client is trusted"),
    SettingSpec("decode_queue_limit", non_negative_int,
                "refuse P/D requests (503 pd_overloaded, before any prefill) while the local decode worker has "
                "more than this many requests waiting; 0 = off"),
    SettingSpec("decode_queue_interval", positive_duration, "how often the decode worker's queue is read"),
    *ENGINE_SPECS,
)
_SPEC_BY_NAME = {spec.name: spec for spec in SPECS}
_ENGINE_SPEC_NAMES = frozenset(spec.name for spec in ENGINE_SPECS)


def add_arguments(parser: argparse.ArgumentParser, names: Sequence[str] | None = None) -> None:
    """Add one flag per setting; flags default to None so the environment applies when absent."""
    for spec in SPECS:
        if names is not None and spec.name not in names:
            continue
        default = Settings().value(spec.name)
        boolean = isinstance(default, bool)
        parser.add_argument(
            spec.flag, dest=spec.name, default=None, metavar="true|false" if boolean else "VALUE",
            nargs="?" if boolean else None, const="true" if boolean else None,
            help=f"{spec.help} [{spec.env}, default {spec.show(default)}]",
        )


def load_settings(environ: Mapping[str, str], flags: Mapping[str, str | None] | None = None,
                  consistent: bool = True) -> Settings:
    """Build Settings from the environment overlaid with flags. Raises ConfigError listing every problem
    (with ``consistent=False`` only the values' own problems, not the cross-field rules)."""
    values: dict[str, Any] = {}
    problems: list[str] = []
    flags = flags or {}
    for spec in SPECS:
        raw = flags.get(spec.name)
        source = spec.flag
        if raw is None:
            raw = environ.get(spec.env)
            source = spec.env
        if raw is None:
            continue
        try:
            values[spec.name] = spec.parse(raw)
        except ValueError as exc:
            problems.append(f"{source}: {exc}")
    unknown = sorted(k for k in environ if k.startswith(ENV_PREFIX) and k[len(ENV_PREFIX):].lower()
                     not in _SPEC_BY_NAME)
    problems.extend(f"{name}: unknown setting" for name in unknown)
    if problems:
        raise ConfigError("invalid settings:\n  " + "\n  ".join(problems))
    options = {name: values.pop(name) for name in list(values) if name in _ENGINE_SPEC_NAMES}
    settings = dataclasses.replace(Settings(), **values, engine_options={**_engine_defaults(), **options})
    problems = check_consistency(settings) if consistent else []
    if problems:
        raise ConfigError("inconsistent settings:\n  " + "\n  ".join(problems))
    return settings


def check_consistency(settings: Settings) -> list[str]:
    """Cross-field rules: the timeouts must nest so that we, not Envoy, answer every expiry."""
    problems = []
    protocol = protocol_problem(settings.adapter, settings.protocol)
    if protocol:
        problems.append(protocol)
    elif settings.adapter in ENGINES:
        engine = ENGINES[settings.adapter]
        problems.extend(engine.option_problems(settings.protocol or engine.pins[0], settings.engine_options))
        if settings.prefill_fallback != "off" and engine.no_fallback:
            problems.append(f"prefill_fallback: adapter {settings.adapter} cannot fall back: {engine.no_fallback}")
        if settings.unsupported_variants != "refuse" and engine.no_fallback:
            problems.append(f"unsupported_variants: adapter {settings.adapter} cannot serve a request whole: "
                            f"{engine.no_fallback}")
        if settings.decode_queue_limit and engine.decode_queue is None:
            problems.append(f"decode_queue_limit: adapter {settings.adapter} names no decode queue gauge")
    if settings.prefill_connect_timeout > settings.prefill_deadline:
        problems.append("prefill_connect_timeout must not exceed prefill_deadline")
    if settings.envoy_stats_listen is not None and (settings.envoy_admin.is_unix or settings.envoy_admin.port == 0):
        problems.append("envoy_stats_listen needs envoy_admin on a fixed TCP port (Envoy proxies the scrape to it)")
    if settings.envoy_message_timeout and settings.envoy_message_timeout <= settings.prefill_deadline + 1.0:
        problems.append("envoy_message_timeout must exceed prefill_deadline by more than 1s")
    if settings.decode_idle_timeout <= settings.message_timeout:
        problems.append("decode_idle_timeout must exceed the ext_proc message timeout "
                        f"({format_duration(settings.message_timeout)})")
    if settings.message_timeout > 3600:
        problems.append("the ext_proc message timeout must not exceed 3600s (Envoy's limit)")
    if settings.prefill_cert_file and not settings.prefill_key_file:
        problems.append("prefill_cert_file needs prefill_key_file")
    if (settings.prefill_ca_file or settings.prefill_cert_file or settings.prefill_server_name) \
            and not settings.prefill_tls:
        problems.append("prefill TLS files or server name are set but prefill_tls is false")
    if settings.max_prefill_response_bytes > settings.max_request_bytes:
        problems.append("max_prefill_response_bytes must not exceed max_request_bytes")
    return problems
