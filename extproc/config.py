"""One frozen Settings object, read from PD_EXTPROC_* variables and matching CLI flags.

Every bad value fails here, before anything binds a port, and all problems are reported at once.
"""

from __future__ import annotations

import argparse
import dataclasses
import ipaddress
import os
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from extproc.adapters import REGISTRY, protocol_problem
from extproc.prefill_policy import Rule, describe, parse_allow_list
from extproc.units import Address, format_duration, parse_address, parse_duration, parse_size

ENV_PREFIX = "PD_EXTPROC_"
ADAPTERS = (*REGISTRY, "none")
LOG_LEVELS = ("debug", "info", "warning", "error")


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
    sglang_bootstrap_port: int | Literal["discover"] = 8998

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
        """The effective settings for the startup log line (nothing here is secret yet)."""
        out: dict[str, str] = {}
        for spec in SPECS:
            value = getattr(self, spec.name)
            out[spec.name] = spec.show(value)
        return out


# Envoy must not time out before we answer our own deadline with a JSON error.
ENVOY_MESSAGE_MARGIN = 5.0


def _parse_bool(text: str) -> bool:
    lowered = text.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise ValueError("expected true or false")


def _choice(options: Sequence[str]) -> Callable[[str], str]:
    def parse(text: str) -> str:
        value = text.strip()
        if value not in options:
            raise ValueError("expected one of " + ", ".join(options))
        return value

    return parse


def _positive_int(text: str) -> int:
    value = int(text.strip())
    if value < 1:
        raise ValueError("expected a positive integer")
    return value


def _positive_duration(text: str) -> float:
    value = parse_duration(text)
    if value <= 0:
        raise ValueError("expected a duration above zero")
    return value


def _positive_size(text: str) -> int:
    value = parse_size(text)
    if value < 1:
        raise ValueError("expected a size above zero")
    return value


def _text(text: str) -> str:
    return text.strip()


def _bootstrap_port(text: str) -> int | Literal["discover"]:
    value = text.strip()
    if value == "discover":
        return "discover"
    if not (value.isascii() and value.isdigit()) or not 1 <= int(value) <= 65535:
        raise ValueError("expected a port 1-65535 or discover")
    return int(value)


def _networks(text: str) -> tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, ...]:
    return tuple(ipaddress.ip_network(part.strip(), strict=True) for part in text.split(",") if part.strip())


def _show_networks(value: Any) -> str:
    return ",".join(str(network) for network in value)


def _http_url(text: str) -> str:
    url = text.strip()
    if not re.fullmatch(r"https?://[^\s/]+(/\S*)?", url):
        raise ValueError("expected an http:// or https:// URL")
    return url


def _file(text: str) -> str:
    path = text.strip()
    if path and not os.path.isfile(path):
        raise ValueError(f"no such file: {path}")
    return path


def _show_plain(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return format_duration(value)
    return str(value)


@dataclass(frozen=True, slots=True)
class SettingSpec:
    name: str
    parse: Callable[[str], Any]
    help: str
    show: Callable[[Any], str] = _show_plain

    @property
    def env(self) -> str:
        return ENV_PREFIX + self.name.upper()

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")


SPECS: tuple[SettingSpec, ...] = (
    SettingSpec("adapter", _choice(ADAPTERS), "P/D protocol adapter: " + ", ".join(ADAPTERS)
                + " (none answers P/D requests with 501)"),
    SettingSpec("protocol", _text, "protocol pin of the adapter; empty = the adapter's default pin"),
    SettingSpec("grpc_listen", lambda t: parse_address(t, allow_unix=True, allow_port_zero=True),
                "ext_proc gRPC listen address: host:port or unix:/path"),
    SettingSpec("listen", lambda t: parse_address(t, allow_port_zero=True), "Envoy listener host:port"),
    SettingSpec("decode", parse_address, "local decode worker host:port (the only decode destination)"),
    SettingSpec("envoy_admin", lambda t: parse_address(t, allow_port_zero=True), "Envoy admin host:port"),
    SettingSpec("envoy_bin", _text, "Envoy binary to run (a path or a name on PATH)"),
    SettingSpec("max_request_bytes", _positive_size, "largest client request body (Envoy 413 above it)"),
    SettingSpec("max_prefill_response_bytes", _positive_size, "largest prefill response body read"),
    SettingSpec("prefill_connect_timeout", _positive_duration, "connect timeout to a prefill worker"),
    SettingSpec("prefill_read_timeout", _positive_duration, "longest silence while reading the prefill response"),
    SettingSpec("prefill_deadline", _positive_duration, "total deadline for the whole prefill leg"),
    SettingSpec("envoy_message_timeout", parse_duration,
                "Envoy ext_proc message_timeout; 0s = prefill_deadline + 5s"),
    SettingSpec("client_body_timeout", _positive_duration, "time a client has to send the whole request"),
    SettingSpec("decode_idle_timeout", _positive_duration, "longest silence on a decode stream"),
    SettingSpec("drain_timeout", _positive_duration, "grace period for in-flight requests on shutdown"),
    SettingSpec("max_inflight", _positive_int, "in-flight P/D requests before 503 pd_overloaded"),
    SettingSpec("metrics_listen", lambda t: parse_address(t, allow_port_zero=True),
                "HTTP host:port for /metrics, /healthz and /readyz"),
    SettingSpec("prefill_allow", parse_allow_list,
                "prefill targets allowed: CIDR:ports, [v6-CIDR]:ports or host:ports, comma-separated "
                "(ports *, N or N-M); empty = default policy (no loopback, link-local, multicast)",
                show=describe),
    SettingSpec("prefill_tls", _parse_bool, "use TLS to prefill workers"),
    SettingSpec("prefill_ca_file", _file, "CA bundle for prefill TLS; empty = the system CAs"),
    SettingSpec("prefill_cert_file", _file, "client certificate for prefill mTLS"),
    SettingSpec("prefill_key_file", _file, "client key for prefill mTLS"),
    SettingSpec("prefill_server_name", _text, "TLS server name to verify; empty = the target's host"),
    SettingSpec("trusted_sources", _networks,
                "CIDRs allowed to set x-prefiller-host-port (Envoy drops it from other peers); empty = all",
                show=_show_networks),
    SettingSpec("tracing", _choice(("off", "otlp")), "OpenTelemetry spans: off, or otlp (OTLP/HTTP JSON export)"),
    SettingSpec("otlp_endpoint", _http_url, "OTLP/HTTP traces endpoint for tracing=otlp"),
    SettingSpec("log_level", _choice(LOG_LEVELS), "log level: debug, info, warning, error"),
    SettingSpec("demo", _parse_bool, "demo mode (pd-extproc up): start emulated workers"),
    SettingSpec("sglang_bootstrap_port", _bootstrap_port,
                "sglang adapter: the prefill workers' bootstrap port (1-65535), or discover (read "
                "disaggregation_bootstrap_port from each prefill worker's /server_info, cached)"),
)
_SPEC_BY_NAME = {spec.name: spec for spec in SPECS}


def add_arguments(parser: argparse.ArgumentParser, names: Sequence[str] | None = None) -> None:
    """Add one flag per setting; flags default to None so the environment applies when absent."""
    for spec in SPECS:
        if names is not None and spec.name not in names:
            continue
        default = getattr(Settings(), spec.name)
        boolean = isinstance(default, bool)
        parser.add_argument(
            spec.flag, dest=spec.name, default=None, metavar="true|false" if boolean else "VALUE",
            nargs="?" if boolean else None, const="true" if boolean else None,
            help=f"{spec.help} [{spec.env}, default {spec.show(default)}]",
        )


def load_settings(environ: Mapping[str, str], flags: Mapping[str, str | None] | None = None) -> Settings:
    """Build Settings from the environment overlaid with flags. Raises ConfigError listing every problem."""
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
    settings = dataclasses.replace(Settings(), **values)
    problems = check_consistency(settings)
    if problems:
        raise ConfigError("inconsistent settings:\n  " + "\n  ".join(problems))
    return settings


def check_consistency(settings: Settings) -> list[str]:
    """Cross-field rules: the timeouts must nest so that we, not Envoy, answer every expiry."""
    problems = []
    protocol = protocol_problem(settings.adapter, settings.protocol)
    if protocol:
        problems.append(protocol)
    if settings.prefill_connect_timeout > settings.prefill_deadline:
        problems.append("prefill_connect_timeout must not exceed prefill_deadline")
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
