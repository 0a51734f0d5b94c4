"""Renders the Envoy bootstrap from Settings: one source of truth for ports, timeouts and limits.

Route "pd" (POST to a path the adapter serves P/D, adapters.served, carrying x-prefiller-host-port) runs
ext_proc; every other request takes route "passthrough", where our server is never called. The ext_proc
filter is disabled by default in the connection manager and enabled by the pd route alone, so Envoy does
not even build the filter for a passthrough request (a route that disables it with ExtProcPerRoute would
still build it, and pay for it, on every request).
PROTOCOL.md §2 ("Envoy contract") says why each value is set.
"""

from __future__ import annotations

from typing import Any

import yaml

from extproc.adapters import adapter_flow, engines, served
from extproc.adapters.base import Flow
from extproc.config import Settings
from extproc.envoy.guard import LUA_RESPONSE_DETAILS, disabled_on_route, guard_filter, stripped_headers
from extproc.envoy.messages import METADATA_NAMESPACE
from extproc.protocol.errors import SPEC, Code
from extproc.protocol.headers import PICKER_HEADERS
from extproc.protocol.pd_request import PD_METHOD, path_regex
from extproc.protocol.prefill_target import HEADER as PREFILL_TARGET_HEADER
from extproc.protocol.units import Address, format_duration
from extproc.workers import worker_listens

EXT_PROC_CLUSTER = "pd_extproc"
ENVOY_ADMIN_CLUSTER = "envoy_admin"
STATS_PATH = "/stats/prometheus"
FALLBACK_HEADER = "x-pd-fallback"
DECODE_CLUSTER = "decode"
# On PD_EXTPROC_ENVOY_STATS_LISTEN: the decode engine's own metrics page (engine_metrics_path).
ENGINE_METRICS_PATH = "/engine/metrics"
EXT_PROC_FILTER = "envoy.filters.http.ext_proc"
BODY_LIMIT_FILTER = "envoy.filters.http.body_size_limit"

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
_STATS_LOG = "type.googleapis.com/envoy.extensions.access_loggers.stats.v3.Config"

# P/D timing as Envoy histograms (its stats access logger, Prometheus on the admin port), so our server
# does no work for them. Only P/D-served requests: route "pd", answered by decode ("via_upstream":
# not our ImmediateResponses or Envoy's local replies), and not an aggregated fallback.
TIMING_STAT_PREFIX = "pd"
TTFT_STAT = "time_to_first_token_ms"
DECODE_STAT = "decode_ms"
# The untrusted chain's routes for a request that carries the picker's header from a peer outside
# trusted_sources. A P/D request (what the pd route would match) is refused 403 prefill_target_forbidden, as
# the --parts' RBAC refuses it: no implicit fallback to a decode-only answer (a wrong PD_EXTPROC_TRUSTED_SOURCES
# shows at the first request, not as a silent loss of disaggregation); any other path with the header is a
# passthrough without it. Both are logged under these route names and counted
# (envoy_pd_untrusted_picker_header_rq).
UNTRUSTED_PICKER_ROUTE = "untrusted_picker_header"
UNTRUSTED_PICKER_PASSTHROUGH_ROUTE = "untrusted_picker_header_passthrough"
UNTRUSTED_PICKER_STAT = "untrusted_picker_header_rq"
# response.flags == 0: a stream the client abandoned keeps "via_upstream" but has no US_RX_END.
def _pd_served(route_name: str) -> str:
    return (f"xds.route_name == '{route_name}' && response.code_details == 'via_upstream' && response.flags == 0u"
            f" && !('{METADATA_NAMESPACE}' in metadata.filter_metadata"
            f" && 'fallback' in metadata.filter_metadata['{METADATA_NAMESPACE}'])")


# A stream's first body byte from decode: vLLM, SGLang and TensorRT-LLM send the response head as
# soon as the request is accepted and the first SSE event once the first token exists.
_STREAMED = "'content-type' in response.headers && response.headers['content-type'].startsWith('text/event-stream')"
# Milliseconds, finer than Envoy's default buckets where P/D TTFT and decode times fall.
TIMING_BUCKETS_MS = (5, 10, 25, 50, 100, 200, 300, 500, 750, 1000, 1500, 2000, 3000, 5000, 7500, 10000,
                     15000, 20000, 30000, 60000, 120000, 300000, 600000)

# Envoy's own local replies -> our error codes. Order matters: the first match wins. Each filter
# excludes our ImmediateResponses (details "pd_*"), which already carry their JSON body.
LocalReplyRule = tuple[str, Code, bool]  # (CEL condition, code, keep Envoy's status)
EXT_PROC_FAILED = "response.code_details.startsWith('ext_proc')"  # Envoy's details for an ext_proc filter's error

_LOCAL_REPLY_RULES: tuple[LocalReplyRule, ...] = (
    ("response.code == 413", Code.REQUEST_TOO_LARGE, False),
    ("response.code == 408", Code.REQUEST_TIMEOUT, False),
    ("response.code_details.startsWith('ext_proc_error_per-message_timeout')", Code.PD_EXTPROC_TIMEOUT, False),
    (EXT_PROC_FAILED, Code.PD_EXTPROC_UNAVAILABLE, False),
    ("response.code == 504", Code.DECODE_UPSTREAM_TIMEOUT, False),
    ("response.code == 503", Code.DECODE_UPSTREAM_UNAVAILABLE, False),
    ("true", Code.GATEWAY_ERROR, True),
)


# Envoy's idle timeouts stay this far above the longest silence a decode request may legitimately have.
DECODE_WAIT_MARGIN = 30.0


def decode_idle_timeout(settings: Settings) -> float:
    """The silence Envoy tolerates on a decode stream: the setting, raised above the engine's own wait
    for the KV when decode starts before the prefill (SGLang), so the engines time out first."""
    engine = engines().get(settings.adapter)
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


def _cel_filter(expression: str) -> dict[str, Any]:
    return {"extension_filter": {"name": "envoy.access_loggers.extension_filters.cel",
                                 "typed_config": {_TYPE: _CEL_FILTER, "expression": expression}}}


# An untrusted peer that names a prefill target: the untrusted chain's direct 403 (and the parts' RBAC denial).
UNTRUSTED_REFUSAL_RULE: LocalReplyRule = (
    f"xds.route_name == '{UNTRUSTED_PICKER_ROUTE}' || response.code_details.startsWith('rbac_access_denied')",
    Code.PREFILL_TARGET_FORBIDDEN, False)


def _local_reply_config(rules: tuple[LocalReplyRule, ...] = _LOCAL_REPLY_RULES) -> dict[str, Any]:
    mappers = []
    for condition, code, keep_status in rules:
        spec = SPEC[code]
        mapper: dict[str, Any] = {
            "filter": _cel_filter(f"!response.code_details.startsWith('pd_')"
                                  f" && response.code_details != '{LUA_RESPONSE_DETAILS}' && ({condition})"),
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
        # Our one dynamic-metadata namespace (a fallback's mark): Envoy drops any other the server sends.
        "metadata_options": {"receiving_namespaces": {"untyped": [METADATA_NAMESPACE]}},
        "status_on_error": {"code": 503},
        "message_timeout": format_duration(settings.message_timeout),
        "processing_mode": {
            # SEND, not SKIP + CEL attributes: with the headers phase skipped, Envoy never calls us for a
            # body-less POST, which then reaches decode without a handoff (docs/decisions.md).
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


def _guard_passthrough(settings: Settings, route: dict[str, Any]) -> dict[str, Any]:
    """The passthrough guard's share of a route (extproc/envoy/guard.py): the whole body is buffered for
    inspection, and the headers that steer an engine are removed."""
    if settings.trust_client_steering:
        return route
    return {**route, "request_body_buffer_limit": settings.max_request_bytes,
            "request_headers_to_remove": sorted({*route["request_headers_to_remove"], *stripped_headers()})}


def _routes(settings: Settings, pd_enabled: bool) -> list[dict[str, Any]]:
    passthrough = _guard_passthrough(settings, {
        "name": "passthrough",
        "match": {"prefix": "/"},
        "route": _route_common(settings),
        "request_headers_to_remove": sorted(PICKER_HEADERS),
    })
    pd_match = {
        "safe_regex": {"regex": path_regex(served(settings.adapter))},
        "headers": [
            {"name": ":method", "string_match": {"exact": PD_METHOD}},
            {"name": PREFILL_TARGET_HEADER, "present_match": True},
        ],
    }
    if not pd_enabled:
        refused = {"name": UNTRUSTED_PICKER_ROUTE, "match": pd_match, "direct_response": {"status": 403}}
        counted = {**passthrough, "name": UNTRUSTED_PICKER_PASSTHROUGH_ROUTE,
                   "match": {"prefix": "/", "headers": [{"name": PREFILL_TARGET_HEADER, "present_match": True}]}}
        return [refused, counted, passthrough]
    pd_route = {
        "name": "pd",
        "match": pd_match,
        "route": _route_common(settings),
        "request_body_buffer_limit": settings.max_request_bytes,
        "request_headers_to_remove": sorted(PICKER_HEADERS),
        # Only on a fallback (PD_EXTPROC_PREFILL_FALLBACK): an empty value adds no header.
        "response_headers_to_add": [{
            "header": {"key": FALLBACK_HEADER, "value": f"%DYNAMIC_METADATA({METADATA_NAMESPACE}:fallback)%"},
            "append_action": "OVERWRITE_IF_EXISTS_OR_ADD", "keep_empty_value": False,
        }],
        # Enables the ext_proc filter, disabled by default in the connection manager (see the module docstring).
        # Envoy wants a config inside: an ExtProcPerRoute with nothing overridden.
        "typed_per_filter_config": {EXT_PROC_FILTER: {_TYPE: _FILTER_CONFIG, "config": {
            _TYPE: _EXT_PROC_PER_ROUTE, "overrides": {}}},
            **({} if settings.trust_client_steering else disabled_on_route())},
    }
    return [pd_route, passthrough]


def timing_logs(route_name: str = "pd") -> list[dict[str, Any]]:
    """TTFT from the client's first byte to decode's first body byte (streams only: a whole JSON answer
    has no first token to time); decode time from the first byte Envoy sends decode to its last. Only
    requests P/D served on ``route_name``."""
    def histogram(name: str, start: str, end: str, tags: list[dict[str, str]]) -> dict[str, Any]:
        return {"stat": {"name": name, "tags": tags}, "unit": "Milliseconds",
                "value_format": f"%COMMON_DURATION({start}:{end}:ms)%"}

    def stats_log(expression: str, histograms: list[dict[str, Any]]) -> dict[str, Any]:
        return {"name": "envoy.access_loggers.stats", "filter": _cel_filter(expression),
                "typed_config": {_TYPE: _STATS_LOG, "stats_scope": {"prefix": TIMING_STAT_PREFIX},
                                 "histograms": histograms}}

    return [
        stats_log(f"{_pd_served(route_name)} && {_STREAMED}",
                  [histogram(TTFT_STAT, "DS_RX_BEG", "US_RX_BODY_BEG", [])]),
        stats_log(_pd_served(route_name), [histogram(DECODE_STAT, "US_TX_BEG", "US_RX_END",
                                         [{"name": "code", "value_format": "%RESPONSE_CODE%"}])]),
    ]


def untrusted_picker_log(expression: str = f"xds.route_name.startsWith('{UNTRUSTED_PICKER_ROUTE}')") -> dict[str, Any]:
    """One count per request the untrusted chain refused or served on the UNTRUSTED_PICKER_* routes (the
    parts: per RBAC refusal on the pd route, ``expression``)."""
    return {"name": "envoy.access_loggers.stats",
            "filter": _cel_filter(expression),
            "typed_config": {_TYPE: _STATS_LOG, "stats_scope": {"prefix": TIMING_STAT_PREFIX},
                             "counters": [{"stat": {"name": UNTRUSTED_PICKER_STAT}, "value_fixed": 1}]}}


def body_limit_filter(settings: Settings) -> dict[str, Any]:
    return {"name": BODY_LIMIT_FILTER,
            "typed_config": {_TYPE: _BODY_LIMIT, "max_request_bytes": settings.max_request_bytes}}


def stats_config() -> dict[str, Any]:
    """The timing histograms' buckets (bootstrap level)."""
    return {"histogram_bucket_settings": [{
        "match": {"prefix": f"{TIMING_STAT_PREFIX}."}, "buckets": list(TIMING_BUCKETS_MS)}]}


def _connection_manager(settings: Settings, pd_enabled: bool) -> dict[str, Any]:
    filters: list[dict[str, Any]] = [body_limit_filter(settings)]
    if not settings.trust_client_steering:
        filters.append(guard_filter(allow_compressed=settings.guard_allow_compressed_bodies,
                                    allow_form_json=settings.guard_allow_form_json_fields))
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
                "pd_fallback": f"%DYNAMIC_METADATA({METADATA_NAMESPACE}:fallback)%",
            }}},
        }, *(timing_logs() if pd_enabled else [untrusted_picker_log()])],
        "local_reply_config": _local_reply_config(
            _LOCAL_REPLY_RULES if pd_enabled else (UNTRUSTED_REFUSAL_RULE, *_LOCAL_REPLY_RULES)),
        "route_config": {"name": "pd" if pd_enabled else "passthrough_only", "virtual_hosts": [
            {"name": "decode", "domains": ["*"], "routes": _routes(settings, pd_enabled)}]},
        "http_filters": filters,
    }


def _filter_chains(settings: Settings) -> list[dict[str, Any]]:
    """With trusted_sources, only those peers may use the P/D route; everyone else gets a chain without it,
    where a P/D request naming a prefill target is refused 403 and x-prefiller-host-port is dropped from any
    other request, which is a plain passthrough."""
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


def engine_metrics_path(settings: Settings) -> str:
    """Where the decode engine serves its Prometheus page (the adapter's, vLLM's and SGLang's /metrics)."""
    engine = engines().get(settings.adapter)
    queue = engine.decode_queue if engine is not None else None
    return queue.path if queue is not None else "/metrics"


def _stats_listener(settings: Settings, address: Address) -> dict[str, Any]:
    """GET /stats/prometheus, proxied to the admin port, and GET ENGINE_METRICS_PATH, the decode engine's own
    metrics page (it listens on loopback in the pod, so a scraper reaches it only here); anything else 404.
    The admin port itself (which can also stop Envoy) stays on loopback."""
    def get(path: str) -> dict[str, Any]:  # :path, not path: a query (filter=..., usedonly) is not passed on
        return {"prefix": "/", "headers": [{"name": ":method", "string_match": {"exact": "GET"}},
                                           {"name": ":path", "string_match": {"exact": path}}]}

    routes = [
        {"name": "stats", "match": get(STATS_PATH), "route": {"cluster": ENVOY_ADMIN_CLUSTER, "timeout": "10s"}},
        {"name": "engine_metrics", "match": get(ENGINE_METRICS_PATH),
         "route": {"cluster": DECODE_CLUSTER, "timeout": "10s", "regex_rewrite": {
             "pattern": {"regex": ".*"}, "substitution": engine_metrics_path(settings)}}},
        {"name": "not_found", "match": {"prefix": "/"}, "direct_response": {"status": 404}},
    ]
    return {"name": "envoy_stats", "address": _socket_address(address), "filter_chains": [{"filters": [{
        "name": "envoy.filters.network.http_connection_manager",
        "typed_config": {
            _TYPE: _HCM, "stat_prefix": "envoy_stats", "codec_type": "AUTO",
            "request_headers_timeout": "10s", "stream_idle_timeout": "30s",
            "route_config": {"name": "envoy_stats", "virtual_hosts": [
                {"name": "stats", "domains": ["*"], "routes": routes}]},
            "http_filters": [{"name": "envoy.filters.http.router", "typed_config": {_TYPE: _ROUTER}}],
        },
    }]}]}


def render(settings: Settings) -> dict[str, Any]:
    """The Envoy bootstrap as a dict (dump it as YAML or JSON)."""
    # Several worker processes (serve --workers N): one endpoint each, health-checked each.
    ext_proc_at = [_connect_address(address) for address in worker_listens(settings.grpc_listen, settings.workers)] \
        if settings.workers > 1 else [_connect_address(settings.grpc_listen)]
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
            # gRPC health: a draining or stopped server is taken out within three checks and P/D
            # requests fail fast with a JSON 503 (panic threshold 0: never "route to all hosts
            # anyway"). A stopped server refuses the check at once; only a timeout waits. Three
            # failures of 3 s, not two of 1 s: on a saturated machine the only server's answer was
            # late twice in a row and every P/D request got 503 (docs/decisions.md, "Fail closed").
            "health_checks": [{
                "timeout": "3s", "interval": "1s", "no_traffic_interval": "1s",
                "unhealthy_threshold": 3, "healthy_threshold": 1,
                "grpc_health_check": {"service_name": "envoy.service.ext_proc.v3.ExternalProcessor"},
            }],
            "common_lb_config": {"healthy_panic_threshold": {"value": 0}},
            # Several workers: streams in flight, not streams started, are what to even out (a P/D
            # stream lives as long as its prefill leg).
            **({"lb_policy": "LEAST_REQUEST"} if len(ext_proc_at) > 1 else {}),
            "load_assignment": {"cluster_name": EXT_PROC_CLUSTER, "endpoints": [
                {"lb_endpoints": [{"endpoint": {"address": _socket_address(address)}} for address in ext_proc_at]},
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
    listeners = [{
        "name": "pd_ingress",
        "address": _socket_address(settings.listen),
        "filter_chains": _filter_chains(settings),
    }]
    if settings.envoy_stats_listen is not None:
        listeners.append(_stats_listener(settings, settings.envoy_stats_listen))
        clusters.append({
            "name": ENVOY_ADMIN_CLUSTER, "type": "STATIC", "connect_timeout": "1s",
            "load_assignment": {"cluster_name": ENVOY_ADMIN_CLUSTER, "endpoints": [
                {"lb_endpoints": [{"endpoint": {"address": _socket_address(settings.envoy_admin)}}]},
            ]},
        })
    return {
        "admin": {"address": _socket_address(settings.envoy_admin)},
        # Histograms are merged for /stats/prometheus at each flush: every second, not Envoy's 5 s
        # (measured on this machine: idle Envoy 2.7 -> 4.0 ms of CPU per second).
        "stats_flush_interval": "1s",
        "stats_config": stats_config(),
        "static_resources": {
            "listeners": listeners,
            "clusters": clusters,
        },
    }


def render_yaml(settings: Settings) -> str:
    header = ("# Rendered by `pd-extproc envoy-config` from PD_EXTPROC_* settings; edit the settings, not this file.\n")
    return header + yaml.safe_dump(render(settings), sort_keys=False, width=120)
