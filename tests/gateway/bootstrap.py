"""An Envoy bootstrap in the shape Envoy Gateway + Envoy AI Gateway render for an HTTPRoute to an
InferencePool, with pd-extproc's ext_proc filter right after the endpoint picker's.

Followed (envoyproxy/ai-gateway @ c217da8a, 2026-08-21; envoyproxy/gateway golden outputs):
- the picker's filter: ai-gateway internal/extensionserver/inferencepool.go:288-316
  ``buildHTTPFilterForInferencePool`` (request/response headers and trailers SEND, both bodies
  FULL_DUPLEX_STREAMED, message_timeout 300s, failure_mode_allow false, no status_on_error (Envoy's
  default, 500), no metadata_options: the picker's ``envoy.lb`` metadata is dropped and the cluster reads
  the header); its name
  ``envoy.filters.http.ext_proc/endpointpicker/<pool>_<ns>_ext_proc`` (inferencepool.go:421-423); its
  cluster is HTTP/2 (inferencepool.go:204-272; TLS there, plaintext here: the fake picker has no
  certificate);
- the picker's filter is inserted immediately before the router, after every filter Envoy Gateway
  rendered (post_translate_modify.go:640-688 ``patchListenerWithInferencePoolFilters``), and disabled
  per route on routes to no pool (post_translate_modify.go:690-728);
- the pool's cluster: ORIGINAL_DST, CLUSTER_PROVIDED, connect_timeout 10s, ``original_dst_lb_config``
  ``use_http_header: true`` on ``x-gateway-destination-endpoint`` (post_cluster_modify.go:67-96); the
  route keeps the host (``auto_host_rewrite: false``, post_route_modify.go:40-48);
- an EnvoyExtensionPolicy ext_proc filter is rendered ``disabled: true`` in the connection manager and
  enabled per route with an empty FilterConfig (envoyproxy/gateway internal/xds/translator/testdata/
  out/xds-ir/ext-proc.listeners.yaml @ 0fa0c9f9; per-route ``config: {}`` as in the aibrix and
  ai-gateway charts that patch EG routes); the listener's per-connection buffer is EG's default 32 KiB
  (same file, ``perConnectionBufferLimitBytes: 32768``).
Where pd-extproc's filter sits: after the picker, before the router, as `envoy-config --parts` renders
it (in its matcher). Envoy AI Gateway itself cannot put a filter there (docs/gateway-chains.md); this
order is what Istio's EnvoyFilter or an Envoy of your own gives. What ships for Envoy Gateway is run
by test_shipped_shape.py. Our filter is enabled on the whole inference route, never per route on the
picker's header (the filter chain is fixed before the picker runs: such a route would never enable
it; test_frozen_filter_chain.py).
"""

from __future__ import annotations

import copy
from typing import Any

from extproc.config import Settings
from extproc.envoy.bootstrap import EXT_PROC_FILTER
from extproc.envoy.parts import (
    DESTINATION_HEADER,
    early_header_mutation,
    gateway_filter,
    gateway_guard_filter,
    gateway_local_reply_mappers,
    gateway_route_additions,
)
from extproc.envoy.parts import gateway_parts as parts_of

POOL, NAMESPACE = "vllm-decode", "llm"
PICKER_FILTER = f"envoy.filters.http.ext_proc/endpointpicker/{POOL}_{NAMESPACE}_ext_proc"
PICKER_CLUSTER = f"envoy.clusters.endpointpicker_{POOL}_{NAMESPACE}_ext_proc"
PD_FILTER = f"envoy.filters.http.ext_proc/envoyextensionpolicy/{NAMESPACE}/pd-extproc/extproc/0"
POOL_CLUSTER = f"httproute/{NAMESPACE}/llm-generate/rule/0"
ROUTE = f"httproute/{NAMESPACE}/llm-generate/rule/0/match/0/*"
OTHER_ROUTE = f"httproute/{NAMESPACE}/status/rule/0/match/0/*"
PICKER_STAT, PD_STAT = "epp", "pd_extproc"

_TYPE = "@type"
_HCM = "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager"
_EXT_PROC = "type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor"
_EXT_PROC_PER_ROUTE = "type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExtProcPerRoute"
_ROUTER = "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"
_HTTP_OPTIONS = "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions"
_STDOUT_LOG = "type.googleapis.com/envoy.extensions.access_loggers.stream.v3.StdoutAccessLog"


def _address(host_port: str) -> dict[str, Any]:
    host, _, port = host_port.rpartition(":")
    return {"socket_address": {"address": host.strip("[]"), "port_value": int(port)}}


def picker_filter() -> dict[str, Any]:
    duplex = "FULL_DUPLEX_STREAMED"
    return {"name": PICKER_FILTER, "typed_config": {
        _TYPE: _EXT_PROC,
        "grpc_service": {"envoy_grpc": {"cluster_name": PICKER_CLUSTER}},
        "processing_mode": {
            "request_header_mode": "SEND", "request_body_mode": duplex, "request_trailer_mode": "SEND",
            "response_header_mode": "SEND", "response_body_mode": duplex, "response_trailer_mode": "SEND",
        },
        "message_timeout": "300s",
        "failure_mode_allow": False,
        "stat_prefix": PICKER_STAT,
    }}


def _pd_filter(settings: Settings) -> dict[str, Any]:
    """Our gateway filter (extproc/envoy/parts.py gateway_filter) under an EnvoyExtensionPolicy's name, disabled in
    the connection manager and enabled by the inference route, as Envoy Gateway renders a policy."""
    wrapped = gateway_filter(settings)
    wrapped["name"] = PD_FILTER
    wrapped["disabled"] = True
    wrapped["typed_config"]["extension_config"]["name"] = PD_FILTER
    wrapped["typed_config"]["extension_config"]["typed_config"]["stat_prefix"] = PD_STAT
    return wrapped


def _inference_route(settings: Settings) -> dict[str, Any]:
    additions = gateway_route_additions(settings)
    per_filter = additions.pop("typed_per_filter_config")
    return {
        "name": ROUTE,
        "match": {"path_separated_prefix": "/v1"},
        "route": {"cluster": POOL_CLUSTER, "timeout": "0s", "auto_host_rewrite": False,
                  "idle_timeout": "300s"},
        **additions,
        "typed_per_filter_config": {PD_FILTER: per_filter[EXT_PROC_FILTER]},
    }


def _other_route() -> dict[str, Any]:
    """A route of the same gateway to no pool: the picker is disabled there (as the extension server
    does), our filter is never enabled, and its errors stay Envoy's own."""
    return {
        "name": OTHER_ROUTE,
        "match": {"prefix": "/status"},
        "direct_response": {"status": 404, "body": {"inline_string": "user's own 404"}},
        "typed_per_filter_config": {PICKER_FILTER: {_TYPE: _EXT_PROC_PER_ROUTE, "disabled": True}},
    }


def gateway_bootstrap(settings: Settings, picker: str, replicas: list[str]) -> dict[str, Any]:
    """The bootstrap: ``picker`` and each of ``replicas`` (pd-extproc servers) as host:port."""
    pd_cluster = copy.deepcopy(parts_of(settings, ROUTE)["clusters"][0])
    pd_cluster["type"] = "STATIC"
    pd_cluster["load_assignment"] = {"cluster_name": pd_cluster["name"], "endpoints": [
        {"lb_endpoints": [{"endpoint": {"address": _address(replica)}} for replica in replicas]}]}
    hcm = {
        _TYPE: _HCM,
        "stat_prefix": "http-10080",
        "codec_type": "AUTO",
        "use_remote_address": True,
        "early_header_mutation_extensions": [early_header_mutation()],
        "access_log": [{"name": "envoy.access_loggers.stdout", "typed_config": {
            _TYPE: _STDOUT_LOG, "log_format": {"json_format": {
                "request_id": "%REQ(X-REQUEST-ID)%", "route": "%ROUTE_NAME%", "code": "%RESPONSE_CODE%",
                "details": "%RESPONSE_CODE_DETAILS%", "upstream": "%UPSTREAM_HOST%"}}}}],
        "local_reply_config": {"mappers": gateway_local_reply_mappers(ROUTE)},
        "route_config": {"name": "envoy-gateway/gateway-1/http", "virtual_hosts": [{
            "name": "envoy-gateway/gateway-1/http/*", "domains": ["*"],
            "routes": [_other_route(), _inference_route(settings)]}]},
        "http_filters": [
            picker_filter(),
            gateway_guard_filter(settings.adapter),
            _pd_filter(settings),
            {"name": "envoy.filters.http.router", "typed_config": {_TYPE: _ROUTER, "suppress_envoy_headers": True}},
        ],
    }
    http2 = {"envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
        _TYPE: _HTTP_OPTIONS, "explicit_http_config": {"http2_protocol_options": {}}}}
    return {
        "admin": {"address": _address("127.0.0.1:0")},
        "static_resources": {
            "listeners": [{
                "name": "envoy-gateway/gateway-1/http",
                "address": _address("127.0.0.1:0"),
                "per_connection_buffer_limit_bytes": 32768,
                "filter_chains": [{"filters": [
                    {"name": "envoy.filters.network.http_connection_manager", "typed_config": hcm}]}],
            }],
            "clusters": [
                {"name": PICKER_CLUSTER, "type": "STATIC", "connect_timeout": "10s", "lb_policy": "LEAST_REQUEST",
                 "typed_extension_protocol_options": http2,
                 "load_assignment": {"cluster_name": PICKER_CLUSTER, "endpoints": [
                     {"lb_endpoints": [{"endpoint": {"address": _address(picker)}}]}]}},
                {"name": POOL_CLUSTER, "type": "ORIGINAL_DST", "lb_policy": "CLUSTER_PROVIDED",
                 "connect_timeout": "10s",
                 "original_dst_lb_config": {"use_http_header": True, "http_header_name": DESTINATION_HEADER}},
                pd_cluster,
            ],
        },
    }
