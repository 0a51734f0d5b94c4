"""Renders the Envoy bootstrap from Settings: one source of truth for ports, timeouts and limits.

Route "pd" (POST /v1/chat/completions or /v1/completions carrying x-prefiller-host-port) runs
ext_proc; every other request takes route "passthrough", where our server is never called. The ext_proc
filter is disabled by default in the connection manager and enabled by the pd route alone, so Envoy does
not even build the filter for a passthrough request (a route that disables it with ExtProcPerRoute would
still build it, and pay for it, on every request).
See research notes in PROTOCOL.md ("Envoy contract") for why each value is set.
"""

from __future__ import annotations

from typing import Any

import yaml

from extproc.adapters import ENGINES, adapter_flow
from extproc.adapters.base import Flow
from extproc.config import Settings
from extproc.errors import SPEC, Code
from extproc.headers import PICKER_HEADERS
from extproc.prefill_target import HEADER as PREFILL_TARGET_HEADER
from extproc.units import Address, format_duration

EXT_PROC_CLUSTER = "pd_extproc"
DECODE_CLUSTER = "decode"
EXT_PROC_FILTER = "envoy.filters.http.ext_proc"
PD_PATH_REGEX = "/v1/(chat/)?completions"

_TYPE = "@type"
_HCM = "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager"
_EXT_PROC = "type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor"
_FILTER_CONFIG = "type.googleapis.com/envoy.config.route.v3.FilterConfig"
_EXT_PROC_PER_ROUTE = "type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExtProcPerRoute"
_BODY_LIMIT = "type.googleapis.com/envoy.extensions.filters.http.body_size_limit.v3.BodySizeLimit"
_ROUTER = "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"
_HTTP_OPTIONS = "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions"
_CEL_FILTER = "type.googleapis.com/envoy.extensions.access_loggers.filters.cel.v3.ExpressionFilter"
_STDOUT_LOG = "type.googleapis.com/envoy.extensions.access_loggers.stream.v3.StdoutAccessLog"

# Envoy's own local replies -> our error codes. Order matters: the first match wins. Each filter
# excludes our ImmediateResponses (details "pd_*"), which already carry their JSON body.
_LOCAL_REPLY_RULES: tuple[tuple[str, Code, bool], ...] = (
    # (CEL condition, code, keep Envoy's status)
    ("response.code == 413", Code.REQUEST_TOO_LARGE, False),
    ("response.code == 408", Code.REQUEST_TIMEOUT, False),
    ("response.code_details.startsWith('ext_proc_error_per-message_timeout')", Code.PD_EXTPROC_TIMEOUT, False),
    ("response.code_details.startsWith('ext_proc')", Code.PD_EXTPROC_UNAVAILABLE, False),
    ("response.code == 504", Code.DECODE_UPSTREAM_TIMEOUT, False),
    ("response.code == 503", Code.DECODE_UPSTREAM_UNAVAILABLE, False),
    ("true", Code.GATEWAY_ERROR, True),
)


# Envoy's idle timeouts stay this far above the longest silence a decode request may legitimately have.
DECODE_WAIT_MARGIN = 30.0


def decode_idle_timeout(settings: Settings) -> float:
    """The silence Envoy tolerates on a decode stream: the setting, raised above the engine's own wait
    for the KV when decode starts before the prefill (SGLang), so the engines time out first."""
    engine = ENGINES.get(settings.adapter)
    wait = engine.decode_wait(settings.engine_options) if engine is not None else 0.0
    return max(settings.decode_idle_timeout, wait + DECODE_WAIT_MARGIN) if wait else settings.decode_idle_timeout


def _socket_address(address: Address) -> dict[str, Any]:
    if address.unix_path is not None:
        return {"pipe": {"path": address.unix_path}}
    return {"socket_address": {"address": address.host, "port_value": address.port}}


def _connect_address(address: Address) -> Address:
    """Where Envoy reaches a server listening on ``address`` (a wildcard means this host)."""
    if address.host in ("0.0.0.0", ""):
        return Address("127.0.0.1", address.port, address.unix_path)
    if address.host == "::":
        return Address("::1", address.port, address.unix_path)
    return address


def _is_ip(host: str) -> bool:
    import ipaddress

    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def _local_reply_config() -> dict[str, Any]:
    mappers = []
    for condition, code, keep_status in _LOCAL_REPLY_RULES:
        spec = SPEC[code]
        mapper: dict[str, Any] = {
            "filter": {"extension_filter": {
                "name": "envoy.access_loggers.extension_filters.cel",
                "typed_config": {_TYPE: _CEL_FILTER,
                                 "expression": f"!response.code_details.startsWith('pd_') && ({condition})"},
            }},
            "body_format_override": {
                "json_format": {"error": {
                    "message": spec.message,
                    "type": spec.type,
                    "param": None,
                    "code": code.value,
                }},
                "content_type": "application/json",
            },
        }
        if not keep_status:
            mapper["status_code"] = spec.status
        mappers.append(mapper)
    return {"mappers": mappers}


def _ext_proc_filter(settings: Settings) -> dict[str, Any]:
    config: dict[str, Any] = {
        _TYPE: _EXT_PROC,
        "grpc_service": {"envoy_grpc": {"cluster_name": EXT_PROC_CLUSTER}},
        "failure_mode_allow": False,  # no prefill, no decode: a P/D request never silently recomputes
        "status_on_error": {"code": 503},
        "message_timeout": format_duration(settings.message_timeout),
        "processing_mode": {
            # SEND, not SKIP + CEL attributes: with the headers phase skipped, Envoy never calls us for a
            # body-less POST, which then reaches decode without a handoff (README, "Design notes").
            "request_header_mode": "SEND",
            "request_body_mode": "BUFFERED",
            "request_trailer_mode": "SKIP",
            # Concurrent engines (SGLang): the stream stays open until decode answers, so a client that
            # leaves before that still cancels the background prefill request.
            "response_header_mode": "SEND" if adapter_flow(settings.adapter) is Flow.CONCURRENT else "SKIP",
            "response_body_mode": "NONE",
            "response_trailer_mode": "SKIP",
        },
    }
    return config


def _route_common(settings: Settings) -> dict[str, Any]:
    return {
        "cluster": DECODE_CLUSTER,
        "timeout": "0s",  # a decode stream may run for minutes; idle_timeout catches a stalled one
        "idle_timeout": format_duration(decode_idle_timeout(settings)),
    }


def _routes(settings: Settings, pd_enabled: bool) -> list[dict[str, Any]]:
    passthrough = {
        "name": "passthrough",
        "match": {"prefix": "/"},
        "route": _route_common(settings),
        "request_headers_to_remove": sorted(PICKER_HEADERS),
    }
    if not pd_enabled:
        return [passthrough]
    pd_route = {
        "name": "pd",
        "match": {
            "safe_regex": {"regex": PD_PATH_REGEX},
            "headers": [
                {"name": ":method", "string_match": {"exact": "POST"}},
                {"name": PREFILL_TARGET_HEADER, "present_match": True},
            ],
        },
        "route": _route_common(settings),
        "request_body_buffer_limit": settings.max_request_bytes,
        "request_headers_to_remove": sorted(PICKER_HEADERS),
        # Enables the ext_proc filter, disabled by default in the connection manager (see the module docstring).
        # Envoy wants a config inside: an ExtProcPerRoute with nothing overridden.
        "typed_per_filter_config": {EXT_PROC_FILTER: {_TYPE: _FILTER_CONFIG, "config": {
            _TYPE: _EXT_PROC_PER_ROUTE, "overrides": {}}}},
    }
    return [pd_route, passthrough]


def _connection_manager(settings: Settings, pd_enabled: bool) -> dict[str, Any]:
    filters: list[dict[str, Any]] = [
        {"name": "envoy.filters.http.body_size_limit",
         "typed_config": {_TYPE: _BODY_LIMIT, "max_request_bytes": settings.max_request_bytes}},
    ]
    if pd_enabled:
        filters.append({"name": EXT_PROC_FILTER, "disabled": True, "typed_config": _ext_proc_filter(settings)})
    filters.append({"name": "envoy.filters.http.router", "typed_config": {_TYPE: _ROUTER}})
    return {
        _TYPE: _HCM,
        "stat_prefix": "pd_ingress" if pd_enabled else "untrusted_ingress",
        "codec_type": "AUTO",
        # Runs while ext_proc holds the request: it must outlast the prefill leg (checked in config.py).
        "stream_idle_timeout": format_duration(decode_idle_timeout(settings)),
        "request_timeout": format_duration(settings.client_body_timeout),
        "request_headers_timeout": "10s",
        "access_log": [{
            "name": "envoy.access_loggers.stdout",
            "typed_config": {_TYPE: _STDOUT_LOG, "log_format": {"json_format": {
                "request_id": "%REQ(X-REQUEST-ID)%",
                "route": "%ROUTE_NAME%",
                "method": "%REQ(:METHOD)%",
                "code": "%RESPONSE_CODE%",
                "details": "%RESPONSE_CODE_DETAILS%",
                "flags": "%RESPONSE_FLAGS%",
                "duration_ms": "%DURATION%",
                "bytes_received": "%BYTES_RECEIVED%",
                "bytes_sent": "%BYTES_SENT%",
                "upstream": "%UPSTREAM_HOST%",
            }}},
        }],
        "local_reply_config": _local_reply_config(),
        "route_config": {"name": "pd" if pd_enabled else "passthrough_only", "virtual_hosts": [
            {"name": "decode", "domains": ["*"], "routes": _routes(settings, pd_enabled)}]},
        "http_filters": filters,
    }


def _filter_chains(settings: Settings) -> list[dict[str, Any]]:
    """With trusted_sources, only those peers may use the P/D route; everyone else gets a chain
    without it, where x-prefiller-host-port is dropped and the request is a plain passthrough."""
    hcm_filter = "envoy.filters.network.http_connection_manager"
    trusted: dict[str, Any] = {"filters": [
        {"name": hcm_filter, "typed_config": _connection_manager(settings, True)}]}
    if not settings.trusted_sources:
        return [trusted]
    trusted["filter_chain_match"] = {"source_prefix_ranges": [
        {"address_prefix": str(network.network_address), "prefix_len": network.prefixlen}
        for network in settings.trusted_sources
    ]}
    untrusted = {"filters": [{"name": hcm_filter, "typed_config": _connection_manager(settings, False)}]}
    return [trusted, untrusted]


def render(settings: Settings) -> dict[str, Any]:
    """The Envoy bootstrap as a dict (dump it as YAML or JSON)."""
    ext_proc_at = _connect_address(settings.grpc_listen)
    decode_host_is_ip = _is_ip(settings.decode.host)
    high = max(4096, settings.max_inflight * 4)
    clusters = [
        {
            "name": EXT_PROC_CLUSTER,
            "type": "STATIC",
            "connect_timeout": "1s",
            "typed_extension_protocol_options": {"envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                _TYPE: _HTTP_OPTIONS,
                "explicit_http_config": {"http2_protocol_options": {
                    "connection_keepalive": {"interval": "30s", "timeout": "5s"},
                    "max_concurrent_streams": 2147483647,
                }},
            }},
            # One gRPC stream per in-flight P/D request for the whole prefill: Envoy's default cap of
            # 1024 would turn load into 503s long before our own admission limit.
            "circuit_breakers": {"thresholds": [
                {"max_connections": high, "max_pending_requests": high, "max_requests": high},
            ]},
            # gRPC health: a draining or stopped server is taken out within two checks and P/D
            # requests fail fast with a JSON 503 (panic threshold 0: never "route to all hosts
            # anyway"). Two failures, not one: a single slow answer under load must not eject the
            # only server (measured: one ejection turned 65 in-flight requests into 503s).
            "health_checks": [{
                "timeout": "1s", "interval": "1s", "no_traffic_interval": "1s",
                "unhealthy_threshold": 2, "healthy_threshold": 1,
                "grpc_health_check": {"service_name": "envoy.service.ext_proc.v3.ExternalProcessor"},
            }],
            "common_lb_config": {"healthy_panic_threshold": {"value": 0}},
            "load_assignment": {"cluster_name": EXT_PROC_CLUSTER, "endpoints": [
                {"lb_endpoints": [{"endpoint": {"address": _socket_address(ext_proc_at)}}]},
            ]},
        },
        {
            "name": DECODE_CLUSTER,
            "type": "STATIC" if decode_host_is_ip else "STRICT_DNS",
            "connect_timeout": "2s",
            "circuit_breakers": {"thresholds": [
                {"max_connections": high, "max_pending_requests": high, "max_requests": high},
            ]},
            "load_assignment": {"cluster_name": DECODE_CLUSTER, "endpoints": [
                {"lb_endpoints": [{"endpoint": {"address": _socket_address(settings.decode)}}]},
            ]},
        },
    ]
    return {
        "admin": {"address": _socket_address(settings.envoy_admin)},
        "static_resources": {
            "listeners": [{
                "name": "pd_ingress",
                "address": _socket_address(settings.listen),
                "filter_chains": _filter_chains(settings),
            }],
            "clusters": clusters,
        },
    }


def render_yaml(settings: Settings) -> str:
    header = ("# Rendered by `pd-extproc envoy-config` from PD_EXTPROC_* settings; edit the settings, not this file.\n")
    return header + yaml.safe_dump(render(settings), sort_keys=False, width=120)
