"""The "Envoy alone" baseline: the smallest bootstrap a user would write to proxy to the decode worker.

One listener, the HTTP connection manager with only the router filter, one static cluster, and
Envoy's defaults everywhere else (its circuit breakers allow 1,024 requests, enough for the
1,000-in-flight test). It also answers ``/_bench/ceiling`` itself (direct_response), which
measures how fast the load generator can go when the upstream costs nothing.
"""

from __future__ import annotations

from typing import Any

import yaml

CEILING_PATH = "/_bench/ceiling"
_HCM = "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager"
_ROUTER = "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"


def _loopback(port: int) -> dict[str, Any]:
    return {"socket_address": {"address": "127.0.0.1", "port_value": port}}


def render(decode_port: int) -> dict[str, Any]:
    routes = [
        {"match": {"path": CEILING_PATH}, "direct_response": {"status": 200, "body": {"inline_string": "{}"}}},
        {"match": {"prefix": "/"}, "route": {"cluster": "decode", "timeout": "0s"}},
    ]
    hcm = {
        "@type": _HCM,
        "stat_prefix": "plain",
        "route_config": {"virtual_hosts": [{"name": "decode", "domains": ["*"], "routes": routes}]},
        "http_filters": [{"name": "envoy.filters.http.router", "typed_config": {"@type": _ROUTER}}],
    }
    return {
        "admin": {"address": _loopback(0)},
        "static_resources": {
            "listeners": [{
                "name": "plain",
                "address": _loopback(0),
                "filter_chains": [{"filters": [
                    {"name": "envoy.filters.network.http_connection_manager", "typed_config": hcm},
                ]}],
            }],
            "clusters": [{
                "name": "decode",
                "type": "STATIC",
                "connect_timeout": "2s",
                "load_assignment": {"cluster_name": "decode", "endpoints": [
                    {"lb_endpoints": [{"endpoint": {"address": _loopback(decode_port)}}]},
                ]},
            }],
        },
    }


def render_yaml(decode_port: int) -> str:
    return yaml.safe_dump(render(decode_port), sort_keys=False)
