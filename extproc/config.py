"""One frozen Settings object, read from PD_EXTPROC_* variables and matching CLI flags.

Every bad value fails here, before anything binds a port, and all problems are reported at once.
"""

from __future__ import annotations

import argparse
import dataclasses
import ipaddress
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from functools import cache
from types import MappingProxyType
from typing import Any

from extproc.adapters import KILL_SWITCH, engines, protocol_problem
from extproc.adapters.base import Flow
from extproc.cpus import auto_workers
from extproc.protocol.prefill_policy import Rule, describe, parse_allow_list
from extproc.protocol.settings_spec import (
    ENV_PREFIX,
    SettingSpec,
    choice,
    existing_file,
    non_negative_int,
    parse_bool,
    positive_duration,
    positive_int,
    positive_size,
    show_plain,
    text_value,
)
from extproc.protocol.units import Address, format_duration, parse_address, parse_duration
from extproc.upstream.client import KEEPALIVE_SECONDS

LOG_LEVELS = ("debug", "info", "warning", "error")
# sidecar: our own Envoy in front of one decode worker; gateway: an ext_proc of the gateway's Envoy,
# after the endpoint picker (docs/gateway.md).
MODES = ("sidecar", "gateway")


def setting(default: Any, parse: Callable[[str], Any], help: str, show: Callable[[Any], str] = show_plain) -> Any:
    """A Settings field that is also a setting: PD_EXTPROC_<NAME>, --<name>, its parser and help."""
    return field(default=default, metadata={"parse": parse, "help": help, "show": show})


def _adapter_name(text: str) -> str:
    # The registry is read when a value is parsed, not at import: a broken plugin is reported by the CLI.
    return choice((*engines(), KILL_SWITCH))(text)


def _engine_defaults() -> dict[str, Any]:
    return {spec.name: spec.default for spec in engine_specs()}


def _networks(text: str) -> tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, ...]:
    return tuple(ipaddress.ip_network(part.strip(), strict=True) for part in text.split(",") if part.strip())


def _workers(text: str) -> int:
    """A positive count, or ``auto``: resolved here, so everything after (supervisor, Envoy's cluster) sees N."""
    if text.strip().lower() == "auto":
        return auto_workers()
    try:
        return positive_int(text)
    except ValueError:
        raise ValueError("expected a positive integer or auto") from None


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


class ConfigError(ValueError):
    """One or more settings are invalid; the message lists every problem."""


@dataclass(frozen=True, slots=True)
class Settings:
    """Every core setting, declared once: its type, default, parser and help (``setting``)."""

    adapter: str = setting(
        "vllm_nixl", _adapter_name, "P/D protocol adapter: a registered engine's adapter (built in: vllm_nixl, "
        "sglang, trtllm) or none (answers P/D requests with 501)")
    protocol: str = setting("", text_value, "protocol pin of the adapter; empty = the adapter's default pin")
    mode: str = setting(
        "sidecar", choice(MODES), "sidecar (our Envoy in the decode pod, P/D route by header) or gateway (an "
        "ext_proc of the gateway's Envoy after the endpoint picker: a request that is not P/D passes through "
        "untouched)")
    grpc_listen: Address = setting(
        Address("127.0.0.1", 50051), lambda t: parse_address(t, allow_unix=True, allow_port_zero=True),
        "ext_proc gRPC listen address: host:port or unix:/path")
    listen: Address = setting(Address("0.0.0.0", 8000), lambda t: parse_address(t, allow_port_zero=True),
                              "Envoy listener host:port")
    decode: Address = setting(Address("127.0.0.1", 8200), parse_address,
                              "local decode worker host:port (the only decode destination)")
    envoy_admin: Address = setting(Address("127.0.0.1", 9901), lambda t: parse_address(t, allow_port_zero=True),
                                   "Envoy admin host:port")
    envoy_stats_listen: Address | None = setting(
        None, _optional_address, "host:port where Envoy serves only its /stats/prometheus (P/D timing histograms) "
        "for a scraper; empty = none (the admin port stays private)", show=_show_optional)
    envoy_bin: str = setting("envoy", text_value, "Envoy binary to run (a path or a name on PATH)")
    max_request_bytes: int = setting(32 << 20, positive_size, "largest client request body (Envoy 413 above it)")
    max_prefill_response_bytes: int = setting(1 << 20, positive_size, "largest prefill response body read")
    prefill_connect_timeout: float = setting(5.0, positive_duration, "connect timeout to a prefill worker")
    prefill_read_timeout: float = setting(30.0, positive_duration,
                                          "longest silence while reading the prefill response")
    prefill_deadline: float = setting(60.0, positive_duration, "total deadline for the whole prefill leg")
    prefill_keepalive: float = setting(
        KEEPALIVE_SECONDS, positive_duration, "idle time after which a pooled prefill connection is closed, not "
        "reused; keep it below the prefill workers' own keep-alive (uvicorn's default: 5s) and any proxy's idle "
        "timeout in front of them")
    envoy_message_timeout: float = setting(0.0, parse_duration,
                                           "Envoy ext_proc message_timeout; 0s = prefill_deadline + 5s")
    client_body_timeout: float = setting(30.0, positive_duration, "time a client has to send the whole request")
    decode_idle_timeout: float = setting(300.0, positive_duration, "longest silence on a decode stream")
    drain_timeout: float = setting(30.0, positive_duration, "grace period for in-flight requests on shutdown")
    max_inflight: int = setting(1024, positive_int, "in-flight P/D requests before 503 pd_overloaded (one limit "
                                "across every worker process: with N workers it may be passed by at most N-1)")
    workers: int = setting(
        1, _workers, "server processes: 1 = one process (today's); auto = the CPUs this process may use (the "
        "cgroup CPU quota rounded up, else the cores it may run on); N > 1 = a supervisor and N worker processes, "
        "worker i on <grpc_listen>-i (Unix) or port + i (TCP), all in Envoy's ext_proc cluster (docs/workers.md)")
    metrics_listen: Address = setting(Address("0.0.0.0", 9190), lambda t: parse_address(t, allow_port_zero=True),
                                      "HTTP host:port for /metrics, /healthz and /readyz")
    prefill_allow: tuple[Rule, ...] = setting(
        (), parse_allow_list, "prefill targets allowed: CIDR:ports, [v6-CIDR]:ports or host:ports, comma-separated "
        "(ports *, N or N-M); empty = default policy (no loopback, link-local, metadata), allowed outside demo mode "
        "only with trusted_sources", show=describe)
    prefill_tls: bool = setting(False, parse_bool, "use TLS to prefill workers")
    prefill_ca_file: str = setting("", existing_file, "CA bundle for prefill TLS; empty = the system CAs")
    prefill_cert_file: str = setting("", existing_file, "client certificate for prefill mTLS")
    prefill_key_file: str = setting("", existing_file, "client key for prefill mTLS")
    prefill_server_name: str = setting("", text_value, "TLS server name to verify; empty = the target's host")
    trusted_sources: tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, ...] = setting(
        (), _networks, "CIDRs allowed to set x-prefiller-host-port (Envoy drops it from other peers); empty = all",
        show=_show_networks)
    tracing: str = setting("off", choice(("off", "otlp")),
                           "OpenTelemetry spans: off, or otlp (OTLP/HTTP JSON export)")
    otlp_endpoint: str = setting("http://127.0.0.1:4318/v1/traces", _http_url,
                                 "OTLP/HTTP traces endpoint for tracing=otlp")
    log_level: str = setting("info", choice(LOG_LEVELS), "log level: debug, info, warning, error")
    demo: bool = setting(False, parse_bool, "demo mode (pd-extproc up): start emulated workers")
    prefill_fallback: str = setting(
        "off", choice(("off", "aggregated")), "off, or aggregated: when the prefill worker is unreachable, too "
        "slow or answers 5xx, the local decode worker serves the request whole (marked x-pd-fallback: "
        "aggregated); never for request errors")
    unsupported_variants: str = setting(
        "refuse", choice(("refuse", "aggregated")), "refuse (400 unsupported_pd_variant), or aggregated: a P/D "
        "request that disaggregation cannot serve as sent (n other than 1, a batch of prompts) goes to the local "
        "decode worker exactly as sent, marked x-pd-fallback: aggregated; reason=unsupported_pd_variant; not "
        "offered for sglang")
    trust_client_steering: bool = setting(
        False, parse_bool, "true turns the client guard off: a client may then send the fields and headers that "
        "make an engine pull KV from a host of its choosing or hold KV (docs/security.md); only where every "
        "client is trusted")
    guard_allow_compressed_bodies: bool = setting(
        False, parse_bool, "true lets a request with x-body-compressed pass the client guard unread: an SGLang engine "
        "started with SGLANG_ENABLE_REQUEST_DECOMPRESSION=1 then decompresses a body the guard never saw, steering "
        "fields included (docs/security.md)")
    guard_allow_form_json_fields: bool = setting(
        False, parse_bool, "true lets a form that may carry vllm_xargs pass the client guard unread: vLLM's "
        "transcription and translation endpoints decode it as JSON into extra_args, kv_transfer_params included "
        "(docs/security.md)")
    decode_queue_limit: int = setting(
        0, non_negative_int, "refuse P/D requests (503 pd_overloaded, before any prefill) while the local decode "
        "worker has more than this many requests waiting; 0 = off")
    decode_queue_interval: float = setting(1.0, positive_duration, "how often the decode worker's queue is read")
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
        return {spec.name: spec.show(self.value(spec.name)) for spec in specs()}


# Envoy must not time out before we answer our own deadline with a JSON error.
ENVOY_MESSAGE_MARGIN = 5.0

CORE_SPECS: tuple[SettingSpec, ...] = tuple(
    SettingSpec(f.name, f.metadata["parse"], f.metadata["help"], f.metadata["show"])
    for f in fields(Settings) if "parse" in f.metadata)


@cache
def engine_specs() -> tuple[SettingSpec, ...]:
    """Every engine's own settings, declared in its Engine (extproc/adapters/, plugins included)."""
    return tuple(spec for engine in engines().values() for spec in engine.settings)


@cache
def specs() -> tuple[SettingSpec, ...]:
    """Every setting: the core ones, then the engines' own."""
    return CORE_SPECS + engine_specs()


@cache
def _spec_by_env() -> Mapping[str, SettingSpec]:
    return MappingProxyType({spec.env: spec for spec in specs()})


# Settings only Envoy's bootstrap (envoy/bootstrap.py) or `up` use: `serve` has no flags for them.
ENVOY_ONLY_SETTINGS = frozenset({"listen", "envoy_admin", "envoy_stats_listen", "envoy_bin", "envoy_message_timeout",
                                 "client_body_timeout", "decode_idle_timeout", "trusted_sources"})
# Settings Envoy's sidecar bootstrap (envoy/bootstrap.py) is rendered from, directly or through a derived value
# (message_timeout, an engine's decode wait): a change needs the bootstrap rendered again. Those not in
# ENVOY_ONLY_SETTINGS are read by the server too ("server, Envoy" in docs/configuration.md).
ENVOY_BOOTSTRAP_SETTINGS = frozenset({
    "adapter", "grpc_listen", "listen", "decode", "envoy_admin", "envoy_stats_listen", "max_request_bytes",
    "prefill_deadline", "envoy_message_timeout", "client_body_timeout", "decode_idle_timeout", "max_inflight",
    "workers", "trusted_sources", "trust_client_steering", "guard_allow_compressed_bodies",
    "guard_allow_form_json_fields", "sglang_prefill_deadline"})


def add_arguments(parser: argparse.ArgumentParser, names: Sequence[str] | None = None) -> None:
    """Add one flag per setting; flags default to None so the environment applies when absent."""
    for spec in specs():
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
    for spec in specs():
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
    # Names are exact: PD_EXTPROC_prefill_allow is refused like a misspelling, never silently ignored.
    unknown = sorted(k for k in environ if k.startswith(ENV_PREFIX) and k not in _spec_by_env())
    problems.extend(f"{name}: unknown setting{_did_you_mean(name)}" for name in unknown)
    if problems:
        raise ConfigError("invalid settings:\n  " + "\n  ".join(problems))
    options = {name: values.pop(name) for name in list(values) if name in {spec.name for spec in engine_specs()}}
    settings = dataclasses.replace(Settings(), **values, engine_options={**_engine_defaults(), **options})
    problems = check_consistency(settings) if consistent else []
    if problems:
        raise ConfigError("inconsistent settings:\n  " + "\n  ".join(problems))
    return settings


def open_prefill_policy(settings: Settings) -> str:
    """Why ``serve`` must not start with these settings, or "": outside demo mode, something must stop a
    client from choosing where the server sends its prompt and credentials. In sidecar mode an allow-list
    or trusted sources (only those peers may name a target); in gateway mode an allow-list (the picker
    names the target there, and trusted sources apply to our own Envoy bootstrap only)."""
    if settings.demo or settings.prefill_allow or settings.adapter == "none":
        return ""
    if settings.mode == "gateway":
        return ("refusing to start in gateway mode without PD_EXTPROC_PREFILL_ALLOW: set it to the prefill pods' "
                "CIDR and port (e.g. 10.0.0.0/8:8000) or their Service name (README, 'Security in brief')")
    if settings.trusted_sources:
        return ""
    return ("refusing to start with neither PD_EXTPROC_PREFILL_ALLOW nor PD_EXTPROC_TRUSTED_SOURCES: any client "
            "could choose where this server sends its prompt and credentials. Set PD_EXTPROC_PREFILL_ALLOW to the "
            "prefill workers (CIDR:ports or name:ports) and/or PD_EXTPROC_TRUSTED_SOURCES to the gateway's CIDRs "
            "(README, 'Security in brief'); PD_EXTPROC_DEMO=true is for the emulated demo only")


def _did_you_mean(name: str) -> str:
    return f" (did you mean {name.upper()}?)" if name.upper() in _spec_by_env() else ""


def check_consistency(settings: Settings) -> list[str]:
    """Cross-field rules: the timeouts must nest so that we, not Envoy, answer every expiry."""
    problems = []
    protocol = protocol_problem(settings.adapter, settings.protocol)
    if protocol:
        problems.append(protocol)
    elif settings.adapter in engines():
        engine = engines()[settings.adapter]
        problems.extend(engine.option_problems(settings.protocol or engine.pins[0], settings.engine_options))
        if settings.prefill_fallback != "off" and engine.no_fallback:
            problems.append(f"prefill_fallback: adapter {settings.adapter} cannot fall back: {engine.no_fallback}")
        if settings.unsupported_variants != "refuse" and engine.no_fallback:
            problems.append(f"unsupported_variants: adapter {settings.adapter} cannot serve a request whole: "
                            f"{engine.no_fallback}")
        if settings.decode_queue_limit and engine.decode_queue is None:
            problems.append(f"decode_queue_limit: adapter {settings.adapter} names no decode queue gauge")
    problems.extend(_gateway_problems(settings))
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
    problems.extend(_workers_problems(settings))
    if settings.max_prefill_response_bytes > settings.max_request_bytes:
        problems.append("max_prefill_response_bytes must not exceed max_request_bytes")
    return problems


# More processes than this is a typo (a decode node has tens of cores, not thousands).
MAX_WORKERS = 256


def _workers_problems(settings: Settings) -> list[str]:
    """Worker i listens on grpc_listen's port + i (TCP): the base port must be fixed and leave room."""
    if settings.workers == 1:
        return []
    problems = []
    if settings.workers > MAX_WORKERS:
        problems.append(f"workers must not exceed {MAX_WORKERS}")
    listen = settings.grpc_listen
    if not listen.is_unix and listen.port == 0:
        problems.append("workers > 1 needs grpc_listen on a fixed port or a Unix socket (worker i listens on "
                        "port + i, and Envoy must know each)")
    elif not listen.is_unix and listen.port + settings.workers - 1 > 65535:
        problems.append(f"workers: grpc_listen port {listen.port} + {settings.workers - 1} is past 65535")
    return problems


def _gateway_problems(settings: Settings) -> list[str]:
    """Sidecar settings that have no meaning in gateway mode, where the decode endpoint is the
    picker's pick, unknown to us until Envoy routes (docs/gateway.md, "Settings")."""
    if settings.mode != "gateway":
        return []
    problems = []
    if settings.decode_queue_limit:
        problems.append("decode_queue_limit: not in gateway mode (it reads the local decode worker's queue; "
                        "the endpoint picker already scores the decode pods' queues)")
    if settings.workers > 1:
        problems.append("workers: not in gateway mode (the gateway's Envoy reaches pd-extproc at one address, so "
                        "workers 1..N-1 would never get a request): run more replicas of pd-extproc instead")
    engine = engines().get(settings.adapter)
    if engine is not None and engine.flow is Flow.CONCURRENT:
        problems.append(f"mode: adapter {settings.adapter} is not supported in gateway mode yet (its failed prefill "
                        "aborts the decode request at the configured decode worker, which in gateway mode is the "
                        "picker's pick)")
    return problems
