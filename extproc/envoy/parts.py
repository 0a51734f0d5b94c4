"""``pd-extproc envoy-config --parts``: only what must be added to an Envoy you already run.

Sidecar mode (the default): the pd route, the ext_proc http filter it enables, the ext_proc cluster and
local-reply mappers, taken from the full bootstrap (envoy.bootstrap.render) so that both stay one source
of truth. Gateway mode (``--mode gateway``): the ext_proc http filter to put right after the endpoint
picker's, enabled on the whole inference route, plus what that route needs (docs/gateway.md).

Every local-reply mapper is scoped to our route by name (CEL ``xds.route_name``), so it never rewrites
the errors of the Envoy's other routes; put them before the Envoy's own mappers (the first match wins,
and ours match nothing outside our route).
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from typing import Any

import yaml
from google.protobuf import json_format

from extproc.config import Settings
from extproc.core.headers import PICKER_HEADERS
from extproc.core.prefill_target import HEADER as PREFILL_TARGET_HEADER
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
    LocalReplyRule,
    _local_reply_config,
    render,
)
from extproc.envoy.gateway import PASSTHROUGH_MODE
from extproc.envoy.guard import guard_filter, stripped_headers
from extproc.envoy.messages import METADATA_NAMESPACE
from extproc.errors import Code

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


def local_reply_mappers(route_name: str) -> list[dict[str, Any]]:
    """The bootstrap's local-reply mappers (Envoy's own errors -> our JSON errors; our and the guard's
    replies left alone), each also conditioned on ``route_name``: nothing on any other route."""
    return _scoped(_local_reply_config()["mappers"], route_name)  # a fresh copy each call


def gateway_local_reply_mappers(route_name: str) -> list[dict[str, Any]]:
    """The gateway's mappers (gateway_local_reply_rules), each conditioned on ``route_name``."""
    return _scoped(_local_reply_config(gateway_local_reply_rules())["mappers"], route_name)


def sidecar_parts(settings: Settings, decode_cluster: str = DECODE_CLUSTER) -> dict[str, Any]:
    """The pd route (its cluster set to ``decode_cluster``), the disabled-by-default ext_proc filter it
    enables, the ext_proc cluster, and the route-scoped local-reply mappers."""
    bootstrap = render(settings)
    route = _named(bootstrap, SIDECAR_ROUTE, "route")
    route["route"]["cluster"] = decode_cluster
    return {
        "http_filters": [_named(bootstrap, EXT_PROC_FILTER, "typed_config")],
        "routes": [route],
        "clusters": [_named(bootstrap, EXT_PROC_CLUSTER, "load_assignment")],
        "local_reply_mappers": local_reply_mappers(SIDECAR_ROUTE),
    }


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


def gateway_guard_filter() -> dict[str, Any]:
    """The client guard (envoy/guard.py: no body member that steers an engine reaches one) for the
    requests our server does not see: put right after the picker, it runs only when the picker set no
    x-prefiller-host-port (a P/D request's body is checked by our server)."""
    guard = guard_filter()
    return {"name": guard["name"], "typed_config": _skipped_when(_PREFILL_HEADER_PRESENT, guard["name"],
                                                                 guard["typed_config"])}


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


def gateway_parts(settings: Settings, route_name: str) -> dict[str, Any]:
    bootstrap = render(settings)
    return {
        "http_filters": [gateway_guard_filter(), gateway_filter(settings)],
        "route_additions": gateway_route_additions(settings),
        "clusters": [_named(bootstrap, EXT_PROC_CLUSTER, "load_assignment")],
        "local_reply_mappers": gateway_local_reply_mappers(route_name),
        "early_header_mutation_extensions": [early_header_mutation()],
    }


_SIDECAR_NOTE = """\
# pd-extproc drop-in parts (sidecar mode), rendered from PD_EXTPROC_* settings. Add them to your Envoy:
#   http_filters:        before your router filter, in the connection manager that serves the decode worker
#   routes:              before your own routes in that virtual host (set route.cluster to your decode cluster)
#   clusters:            as is (the ext_proc gRPC service)
#   local_reply_mappers: first in your connection manager's local_reply_config.mappers; each matches only
#                        on route "pd", so your other routes' errors are untouched
# Do not change status_on_error, failure_mode_allow, message_timeout or processing_mode (README).
"""
_GATEWAY_NOTE = """\
# pd-extproc drop-in parts (gateway mode), rendered from PD_EXTPROC_* settings:
#   http_filters:        immediately after the endpoint picker's ext_proc filter, in this order, before the router
#   route_additions:     merged into the inference route (the HTTPRoute rule to the InferencePool)
#   clusters:            the ext_proc gRPC service (point it at the pd-extproc Service)
#   local_reply_mappers: first in the connection manager's local_reply_config.mappers (scoped to that route)
#   early_header_mutation_extensions: in the connection manager: only the picker may set these headers
# Run the server with PD_EXTPROC_MODE=gateway. Do not change status_on_error (510: the mappers tell our filter's
# failures from the picker's by it), failure_mode_allow, message_timeout, processing_mode or
# allowed_override_modes (README, docs/gateway.md).
"""


def render_parts_yaml(settings: Settings, decode_cluster: str = DECODE_CLUSTER, route_name: str = "") -> str:
    if settings.mode == "gateway":
        parts = gateway_parts(settings, route_name or SIDECAR_ROUTE)
        return _GATEWAY_NOTE + yaml.safe_dump(parts, sort_keys=False, width=120)
    return _SIDECAR_NOTE + yaml.safe_dump(sidecar_parts(settings, decode_cluster), sort_keys=False, width=120)
