"""``pd-extproc envoy-config --parts``: only what must be added to an Envoy you already run.

Sidecar mode (the default): the pd route, the http filters (body limit, client guard, ext_proc, and with
trusted sources an RBAC filter the pd route enables), the ext_proc cluster, local-reply mappers, the
timing loggers, the steering headers' removal on every route and what the user's other routes need for the
guard, taken from the full bootstrap (envoy.bootstrap.render) so that both stay one source of truth.
Gateway mode (``--mode gateway``): the guard and the ext_proc http filter to put right after the endpoint
picker's, enabled on the whole inference route, plus what that route needs (docs/gateway.md).

The parts cannot add a filter chain to the user's listener, so the bootstrap's trusted-sources split (a
chain without the pd route for other peers) becomes an RBAC check on the pd route: a peer outside
PD_EXTPROC_TRUSTED_SOURCES that names a prefill target is refused 403 prefill_target_forbidden, as the
bootstrap's other chain refuses it.

Every local-reply mapper is scoped to our route by name (CEL ``xds.route_name``), so it never rewrites
the errors of the Envoy's other routes; put them before the Envoy's own mappers (the first match wins,
and ours match nothing outside our route).
"""

from __future__ import annotations

import copy
import re
from collections.abc import Iterator
from typing import Any

import yaml
from google.protobuf import json_format

from extproc.adapters import served
from extproc.config import Settings
from extproc.envoy.bootstrap import (
    _EXT_PROC_PER_ROUTE,
    _FILTER_CONFIG,
    _LOCAL_REPLY_RULES,
    _TYPE,
    DECODE_CLUSTER,
    EXT_PROC_CLUSTER,
    EXT_PROC_FAILED,
    EXT_PROC_FILTER,
    FALLBACK_HEADER,
    UNTRUSTED_REFUSAL_RULE,
    LocalReplyRule,
    _local_reply_config,
    body_limit_filter,
    render,
    stats_config,
    timing_logs,
    untrusted_picker_log,
)
from extproc.envoy.gateway import PASSTHROUGH_MODE
from extproc.envoy.guard import guard_filter, stripped_headers
from extproc.envoy.messages import METADATA_NAMESPACE
from extproc.protocol.errors import Code
from extproc.protocol.headers import PICKER_HEADERS
from extproc.protocol.pd_request import PD_METHOD, full_path_regex
from extproc.protocol.prefill_target import HEADER as PREFILL_TARGET_HEADER
from extproc.protocol.units import Address

SIDECAR_ROUTE = "pd"  # the bootstrap's P/D route; the parts keep its name (the timing loggers' CEL uses it)
_EARLY_MUTATION = "type.googleapis.com/envoy.extensions.http.early_header_mutation.header_mutation.v3.HeaderMutation"


def _walk(node: Any) -> Iterator[dict[str, Any]]:
    if isinstance(node, dict):
        yield node
        for value in node.values():
            yield from _walk(value)
    elif isinstance(node, list):
        for item in node:
            yield from _walk(item)


def _named(bootstrap: dict[str, Any], name: str, having: str) -> dict[str, Any]:
    """The first object of the bootstrap named ``name`` that has the key ``having``."""
    for node in _walk(bootstrap):
        if node.get("name") == name and having in node:
            return copy.deepcopy(node)
    raise LookupError(f"the rendered bootstrap has no {having} named {name}")


# Our filter's status_on_error in gateway mode. The gateway runs two ext_proc filters (the endpoint picker's
# first), and Envoy's details for either one's failure start with ext_proc_error, so only the status tells
# ours apart: 510 is answered locally by nothing else on the inference route (Envoy's own replies there are
# 4xx, 500, 502, 503, 504; the picker's status_on_error is Envoy's default 500 and its own immediate replies
# 400-503; our server's errors carry pd_* details), and the mappers turn it back into our JSON 503.
# k8s/gateway-mode's Envoy Gateway (statusOnError + responseOverride) and Istio shapes use the same value.
GATEWAY_STATUS_ON_ERROR = 510


def gateway_local_reply_rules() -> tuple[LocalReplyRule, ...]:
    """The sidecar's rules, except that an ext_proc failure is ours (pd_extproc_unavailable) only at our
    filter's GATEWAY_STATUS_ON_ERROR; any other ext_proc failure (the picker's) is gateway_error with its
    own status. Envoy's fixed 504 for a message timeout carries no filter mark: pd_extproc_timeout stays
    for both filters (docs/gateway.md)."""
    rules: list[LocalReplyRule] = []
    for condition, code, keep_status in _LOCAL_REPLY_RULES:
        if code is Code.PD_EXTPROC_UNAVAILABLE:
            # Every fail-closed error of our filter answers status_on_error (Envoy's ext_proc.cc: onGrpcError,
            # onError, handleErrorResponse); the last one's details lack the ext_proc prefix.
            rules.append((f"response.code == {GATEWAY_STATUS_ON_ERROR}", code, False))
            rules.append((EXT_PROC_FAILED, Code.GATEWAY_ERROR, True))
        else:
            rules.append((condition, code, keep_status))
    return tuple(rules)


def _scoped(mappers: list[dict[str, Any]], route_name: str) -> list[dict[str, Any]]:
    for mapper in mappers:
        config = mapper["filter"]["extension_filter"]["typed_config"]
        config["expression"] = f"xds.route_name == '{route_name}' && ({config['expression']})"
    return mappers


# The parts' trusted-sources check (RBAC on the pd route): its refusal is a prefill target this peer may not name.
RBAC_FILTER = "envoy.filters.http.rbac"
_RBAC = "type.googleapis.com/envoy.extensions.filters.http.rbac.v3.RBAC"
_RBAC_PER_ROUTE = "type.googleapis.com/envoy.extensions.filters.http.rbac.v3.RBACPerRoute"


def local_reply_mappers(route_name: str, trusted: bool = False) -> list[dict[str, Any]]:
    """The bootstrap's local-reply mappers (Envoy's own errors -> our JSON errors; our and the guard's
    replies left alone), each also conditioned on ``route_name``: nothing on any other route. ``trusted``:
    the RBAC refusal of an untrusted peer first."""
    rules = (UNTRUSTED_REFUSAL_RULE, *_LOCAL_REPLY_RULES) if trusted else _LOCAL_REPLY_RULES
    return _scoped(_local_reply_config(rules)["mappers"], route_name)  # a fresh copy each call


def gateway_local_reply_mappers(route_name: str) -> list[dict[str, Any]]:
    """The gateway's mappers (gateway_local_reply_rules), each conditioned on ``route_name``."""
    return _scoped(_local_reply_config(gateway_local_reply_rules())["mappers"], route_name)


def _trusted_only(settings: Settings) -> dict[str, Any]:
    """RBACPerRoute for the pd route: only a direct peer in trusted_sources (the address Envoy's own filter
    chain match reads, never X-Forwarded-For) may reach our server."""
    principals = [{"direct_remote_ip": {"address_prefix": str(network.network_address),
                                        "prefix_len": network.prefixlen}} for network in settings.trusted_sources]
    return {_TYPE: _RBAC_PER_ROUTE, "rbac": {"rules": {"action": "ALLOW", "policies": {"trusted_sources": {
        "permissions": [{"any": True}], "principals": principals}}}}}


def _other_routes(settings: Settings) -> dict[str, Any]:
    """What the virtual host that holds the pd route needs on every route (the bootstrap's passthrough
    route): the picker's headers removed (read by us, for no engine), and the guard's body buffer."""
    additions: dict[str, Any] = {"request_headers_to_remove": sorted(PICKER_HEADERS)}
    if not settings.trust_client_steering:
        additions["request_body_buffer_limit"] = settings.max_request_bytes
    return additions


def steering_header_removal() -> dict[str, Any]:
    """For the connection manager (``early_header_mutation_extensions``): a client's steering headers are
    removed before any filter runs, on every route (our server adds its own signature later, on the pd
    route only)."""
    return {"name": "envoy.http.early_header_mutation.header_mutation",
            "typed_config": {_TYPE: _EARLY_MUTATION, "mutations": [{"remove": name} for name in stripped_headers()]}}


def sidecar_parts(settings: Settings, decode_cluster: str = DECODE_CLUSTER) -> dict[str, Any]:
    """Everything the full bootstrap's trusted chain protects P/D with, as parts (module docstring)."""
    bootstrap = render(settings)
    route = _named(bootstrap, SIDECAR_ROUTE, "route")
    route["route"]["cluster"] = decode_cluster
    filters = [body_limit_filter(settings)]
    if not settings.trust_client_steering:
        filters.append(guard_filter(allow_compressed=settings.guard_allow_compressed_bodies,
                                    allow_form_json=settings.guard_allow_form_json_fields))
    if settings.trusted_sources:
        filters.append({"name": RBAC_FILTER, "disabled": True, "typed_config": {_TYPE: _RBAC}})
        route["typed_per_filter_config"][RBAC_FILTER] = {_TYPE: _FILTER_CONFIG, "config": _trusted_only(settings)}
    filters.append(_named(bootstrap, EXT_PROC_FILTER, "typed_config"))
    parts: dict[str, Any] = {
        "http_filters": filters,
        "routes": [route],
        "virtual_host_additions": _other_routes(settings),
        "clusters": [_named(bootstrap, EXT_PROC_CLUSTER, "load_assignment")],
        "local_reply_mappers": local_reply_mappers(SIDECAR_ROUTE, trusted=bool(settings.trusted_sources)),
        "access_log": [*timing_logs(SIDECAR_ROUTE), *([untrusted_picker_log(
            f"xds.route_name == '{SIDECAR_ROUTE}' && response.code_details.startsWith('rbac_access_denied')")]
            if settings.trusted_sources else [])],
        "stats_config": stats_config(),
    }
    if not settings.trust_client_steering:
        parts["early_header_mutation_extensions"] = [steering_header_removal()]
    return parts


_MATCHER = "type.googleapis.com/envoy.extensions.common.matching.v3.ExtensionWithMatcher"
_HEADER_INPUT = "type.googleapis.com/envoy.type.matcher.v3.HttpRequestHeaderMatchInput"
_SKIP_FILTER = "type.googleapis.com/envoy.extensions.filters.common.matcher.action.v3.SkipFilter"


def gateway_ext_proc(settings: Settings) -> dict[str, Any]:
    """Our ext_proc filter's config for the gateway: the sidecar's, plus the one mode override the server
    sends for a request that is not P/D (extproc/envoy/gateway.py)."""
    config = _named(render(settings), EXT_PROC_FILTER, "typed_config")["typed_config"]
    config["status_on_error"] = {"code": GATEWAY_STATUS_ON_ERROR}  # the picker's failures are not ours
    config["allow_mode_override"] = True
    config["allowed_override_modes"] = [json_format.MessageToDict(PASSTHROUGH_MODE, preserving_proto_field_name=True)]
    return dict(config)


def gateway_filter(settings: Settings) -> dict[str, Any]:
    """Our filter for the gateway's chain, right after the picker's, enabled on the whole inference route
    (never per route on the picker's header: the route is chosen before the picker runs).

    It is wrapped in a matcher (ExtensionWithMatcher) that skips it when the request has no
    x-prefiller-host-port. The matcher runs when our filter's turn comes, after the picker set the header,
    so a decode-only request never reaches our server (no stream; served even while pd-extproc is down)
    and a P/D request always does. Measured on Envoy 1.40 (tests/gateway). The server's own passthrough
    still answers a request that carries the header but is not P/D (another method or path)."""
    return {"name": EXT_PROC_FILTER, "typed_config": _skipped_when(
        {"not_matcher": _PREFILL_HEADER_PRESENT}, EXT_PROC_FILTER, gateway_ext_proc(settings))}


_PREFILL_HEADER_PRESENT = {"single_predicate": {
    "input": {"name": PREFILL_TARGET_HEADER, "typed_config": {_TYPE: _HEADER_INPUT,
                                                              "header_name": PREFILL_TARGET_HEADER}},
    "value_match": {"safe_regex": {"google_re2": {}, "regex": ".+"}}}}


def _skipped_when(predicate: dict[str, Any], name: str, config: dict[str, Any]) -> dict[str, Any]:
    return {_TYPE: _MATCHER, "extension_config": {"name": name, "typed_config": config},
            "xds_matcher": {"matcher_list": {"matchers": [{
                "predicate": predicate,
                "on_match": {"action": {"name": "skip", "typed_config": {_TYPE: _SKIP_FILTER}}}}]}}}


def _header_matches(name: str, regex: str) -> dict[str, Any]:
    return {"single_predicate": {
        "input": {"name": name, "typed_config": {_TYPE: _HEADER_INPUT, "header_name": name}},
        "value_match": {"safe_regex": {"google_re2": {}, "regex": regex}}}}


# What our server reads as P/D (protocol/pd_request.py, the one rule), as a matcher. The header rule is ".+":
# an empty x-prefiller-host-port is P/D to the server (refused invalid_prefill_target) and not here, so the
# guard reads such a body too: skipping less than the server reads is safe, skipping more never is.
def _pd_request(adapter: str) -> dict[str, Any]:
    return {"and_matcher": {"predicate": [
        _header_matches(":method", re.escape(PD_METHOD)),
        _header_matches(":path", full_path_regex(served(adapter))),
        _PREFILL_HEADER_PRESENT,
    ]}}


def gateway_guard_filter(adapter: str, *, allow_compressed: bool = False,
                         allow_form_json: bool = False) -> dict[str, Any]:
    """The client guard (envoy/guard.py: no body member that steers an engine reaches one) for the
    requests our server does not read as P/D: put right after the picker, it is skipped only for a request
    our server, running ``adapter``, will read as P/D (protocol/pd_request.py), whose body our server checks.
    A tagged request of another method or path is read by both (gateway.steering_refusal)."""
    guard = guard_filter(allow_compressed=allow_compressed, allow_form_json=allow_form_json)
    skip = _pd_request(adapter)
    return {"name": guard["name"], "typed_config": _skipped_when(skip, guard["name"], guard["typed_config"])}


def gateway_route_additions(settings: Settings) -> dict[str, Any]:
    """What the inference route (the HTTPRoute rule to the InferencePool) needs for P/D: our filter
    enabled there, a request buffer as large as the largest request, the fallback mark."""
    return {
        "request_body_buffer_limit": settings.max_request_bytes,
        "request_headers_to_remove": sorted(PICKER_HEADERS),  # read by us, for no engine (headers.py)
        "response_headers_to_add": [{
            "header": {"key": FALLBACK_HEADER, "value": f"%DYNAMIC_METADATA({METADATA_NAMESPACE}:fallback)%"},
            "append_action": "OVERWRITE_IF_EXISTS_OR_ADD", "keep_empty_value": False,
        }],
        "typed_per_filter_config": {EXT_PROC_FILTER: {_TYPE: _FILTER_CONFIG, "config": {
            _TYPE: _EXT_PROC_PER_ROUTE, "overrides": {}}}},
    }


# The picker's decode choice (GIE endpoint-picker protocol). Envoy AI Gateway's pool cluster routes on
# this header (ORIGINAL_DST, use_http_header): a client's own copy must never survive to the router.
DESTINATION_HEADER = "x-gateway-destination-endpoint"


def early_header_mutation() -> dict[str, Any]:
    """For the gateway's connection manager (``early_header_mutation_extensions``): drop a client's own
    picker headers before any filter runs, so only the picker sets x-prefiller-host-port and the decode
    destination."""
    # The steering headers too: only our server may send one (a TensorRT-LLM signature) to an engine.
    names = sorted(PICKER_HEADERS | {DESTINATION_HEADER, *stripped_headers()})
    return {"name": "envoy.http.early_header_mutation.header_mutation",
            "typed_config": {_TYPE: _EARLY_MUTATION, "mutations": [{"remove": name} for name in names]}}


def gateway_cluster(settings: Settings, ext_proc_address: Address | None) -> dict[str, Any]:
    """The bootstrap's ext_proc cluster (health checks, HTTP/2, limits), resolving ``ext_proc_address``
    (the pd-extproc Service) by DNS. Without one, its address is empty: Envoy refuses the config until it
    is replaced (SocketAddress.address has a minimum length of 1)."""
    cluster = _named(render(settings), EXT_PROC_CLUSTER, "load_assignment")
    cluster["type"] = "STRICT_DNS"
    cluster.pop("lb_policy", None)
    host, port = (ext_proc_address.host, ext_proc_address.port) if ext_proc_address is not None else ("", 50051)
    cluster["load_assignment"] = {"cluster_name": EXT_PROC_CLUSTER, "endpoints": [{"lb_endpoints": [
        {"endpoint": {"address": {"socket_address": {"address": host, "port_value": port}}}}]}]}
    return cluster


def gateway_parts(settings: Settings, route_name: str, ext_proc_address: Address | None = None) -> dict[str, Any]:
    return {
        "http_filters": [body_limit_filter(settings),
                         gateway_guard_filter(settings.adapter,
                                              allow_compressed=settings.guard_allow_compressed_bodies,
                                              allow_form_json=settings.guard_allow_form_json_fields),
                         gateway_filter(settings)],
        "route_additions": gateway_route_additions(settings),
        "clusters": [gateway_cluster(settings, ext_proc_address)],
        "local_reply_mappers": gateway_local_reply_mappers(route_name),
        "early_header_mutation_extensions": [early_header_mutation()],
        "access_log": timing_logs(route_name),
        "stats_config": stats_config(),
    }


_SIDECAR_NOTE = """\
# pd-extproc drop-in parts (sidecar mode), rendered from PD_EXTPROC_* settings. Add them to your Envoy:
#   http_filters:        in this order, before your router filter, in the connection manager that serves the
#                        decode worker (the guard checks every route's bodies but the pd route's)
#   routes:              before your own routes in that virtual host (they send to the --decode-cluster cluster)
#   virtual_host_additions: merged into that virtual host: every route of it gets them
#   clusters:            as is (the ext_proc gRPC service)
#   local_reply_mappers: first in your connection manager's local_reply_config.mappers; each matches only
#                        on route "pd", so your other routes' errors are untouched
#   access_log:          appended to that connection manager's access_log (the P/D timing histograms)
#   stats_config:        merged into your bootstrap's stats_config (the histograms' buckets)
#                        and stats_flush_interval: 1s at your bootstrap's top level (Envoy's default, 5s, shows
#                        the histograms empty for up to 5s after a request)
#   early_header_mutation_extensions: in that connection manager: no client's steering header reaches an engine
# Every virtual host of that connection manager without the pd route still gets the guard; give it the
# virtual_host_additions too. Do not change status_on_error, failure_mode_allow, message_timeout or
# processing_mode (docs/deployment.md).
"""
_GATEWAY_NOTE = """\
# pd-extproc drop-in parts (gateway mode), rendered from PD_EXTPROC_* settings:
#   http_filters:        immediately after the endpoint picker's ext_proc filter, in this order, before the router
#   route_additions:     merged into the inference route (the HTTPRoute rule to the InferencePool)
#   clusters:            the ext_proc gRPC service, resolved by DNS: render with --ext-proc-address <Service>:<port>
#                        (left empty, Envoy refuses the config until you set it)
#   local_reply_mappers: first in the connection manager's local_reply_config.mappers (scoped to that route)
#   early_header_mutation_extensions: in the connection manager: only the picker may set these headers
#   access_log:          appended to the connection manager's access_log (the P/D timing histograms)
#   stats_config:        merged into the bootstrap's stats_config (the histograms' buckets)
# Run the server with PD_EXTPROC_MODE=gateway. Do not change status_on_error (510: the mappers tell our filter's
# failures from the picker's by it), failure_mode_allow, message_timeout, processing_mode or
# allowed_override_modes (docs/deployment.md, docs/gateway.md).
"""


def render_parts_yaml(settings: Settings, decode_cluster: str = DECODE_CLUSTER, route_name: str = "",
                      ext_proc_address: Address | None = None) -> str:
    if settings.mode == "gateway":
        parts = gateway_parts(settings, route_name or SIDECAR_ROUTE, ext_proc_address)
        return _GATEWAY_NOTE + yaml.safe_dump(parts, sort_keys=False, width=120)
    return _SIDECAR_NOTE + yaml.safe_dump(sidecar_parts(settings, decode_cluster), sort_keys=False, width=120)
