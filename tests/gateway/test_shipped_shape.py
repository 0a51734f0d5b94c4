"""k8s/gateway-mode as Envoy Gateway v1.9 renders it (tests/deploy/test_gateway_mode.py
``envoy_gateway_shape``, built from the kustomize output after Envoy Gateway's translator), run on a
real Envoy 1.40 with the fake picker, our servers and three decode workers: what ships, end to end.
The filter order is Envoy Gateway's (httpfilters.go:131-134 @ v1.9.0): the client guard (the policy's
Lua, 13 + index), then the picker (ext_proc 100), then pd-extproc (ext_proc 101), then the router.

The only changes to that shape here are the addresses (loopback ports of this test's processes), an
admin endpoint, and a stat prefix on each ext_proc filter to tell their counters apart."""

from __future__ import annotations

import copy
import json
import signal
from collections.abc import Iterator
from typing import Any

import pytest

from extproc.config import Settings
from tests.deploy.test_gateway_mode import (
    CUSTOM_RESPONSE_FILTER,
    EXT_PROC_FILTER,
    GATEWAY_MODE,
    LUA_FILTER,
    envoy_gateway_shape,
    rendered,
)
from tests.gateway.bootstrap import PD_STAT, PICKER_STAT
from tests.gateway.cases import (
    STEERING_FIELDS,
    UNREADABLE_BODIES,
    assert_steering_refused_before_the_picker,
    assert_unreadable_body_refused_before_the_picker,
)
from tests.gateway.stack import DECODES, GatewayStack, gateway_stack
from tests.gateway.test_gateway_contract import JSON, assert_error, assert_nothing_reached_an_engine, post, served
from tests.helpers import CHAT, COMPLETIONS, chat_body, only

pytestmark = pytest.mark.dataplane


def _endpoints(host_ports: list[str]) -> list[dict[str, Any]]:
    endpoints = []
    for host_port in host_ports:
        host, _, port = host_port.rpartition(":")
        endpoints.append({"endpoint": {"address": {"socket_address": {"address": host, "port_value": int(port)}}}})
    return [{"lb_endpoints": endpoints}]


def shipped_shape(settings: Settings, picker: str, replicas: list[str], decodes: list[str]) -> dict[str, Any]:
    bootstrap = copy.deepcopy(envoy_gateway_shape(rendered(GATEWAY_MODE)))
    listener = bootstrap["static_resources"]["listeners"][0]
    hcm = listener["default_filter_chain"]["filters"][0]["typed_config"]
    hcm["stat_prefix"] = "http-10080"
    ext_procs = [f for f in hcm["http_filters"] if f["name"].startswith(EXT_PROC_FILTER)]
    assert [f["name"].rsplit("/", 1)[-1] for f in ext_procs] == ["0", "1"]
    picker_filter, pd_filter = ext_procs
    picker_filter["typed_config"]["stat_prefix"] = PICKER_STAT
    pd_filter["typed_config"]["stat_prefix"] = PD_STAT
    by_name = {c["name"]: c for c in bootstrap["static_resources"]["clusters"]}
    clusters = [picker_filter, pd_filter]
    for ext_proc, hosts in zip(clusters, ([picker], replicas), strict=True):
        cluster = by_name[ext_proc["typed_config"]["grpc_service"]["envoy_grpc"]["cluster_name"]]
        cluster["load_assignment"]["endpoints"] = _endpoints(hosts)
    route = hcm["route_config"]["virtual_hosts"][0]["routes"][0]
    by_name[route["route"]["cluster"]]["load_assignment"]["endpoints"] = _endpoints(decodes)
    bootstrap["admin"] = {"address": {"socket_address": {"address": "127.0.0.1", "port_value": 0}}}
    return dict(bootstrap)


@pytest.fixture(scope="module")
def shipped_running() -> Iterator[GatewayStack]:
    with gateway_stack(shape=shipped_shape) as stack:
        yield stack


@pytest.fixture
def shipped(shipped_running: GatewayStack) -> GatewayStack:
    return shipped_running.reset()


def test_the_running_envoy_has_the_guard_first_then_the_picker_then_pd_extproc(shipped: GatewayStack) -> None:
    """Envoy Gateway's order (httpfilters.go:101-102,131-134): the responseOverride's custom_response (it
    acts on the way out only), the guard, the picker, pd-extproc, the router."""
    assert shipped.envoy is not None
    dump = json.loads(shipped.envoy.admin_get("/config_dump?resource=static_listeners"))
    (listener,) = dump["configs"]
    hcm = listener["listener"]["default_filter_chain"]["filters"][0]["typed_config"]
    names = [f["name"] for f in hcm["http_filters"]]
    assert names[0].startswith(CUSTOM_RESPONSE_FILTER + "/") and names[-1] == "envoy.filters.http.router"
    assert [n.rsplit("/", 2)[-2:] for n in names[1:-1]] == [["lua", "0"], ["extproc", "0"], ["extproc", "1"]]
    assert names[1].startswith(LUA_FILTER + "/")


@pytest.mark.parametrize("field", STEERING_FIELDS)
def test_a_decode_only_request_that_steers_the_engine_is_refused_before_any_engine(
        shipped: GatewayStack, field: str) -> None:
    """The gap this shape had: pd-extproc answers a decode-only request at its headers and never sees its
    body. The policy's Lua guard (runs before the picker, Envoy Gateway's order) refuses a body member that
    would steer the decode engine, e.g. make vLLM pull KV from an address the client chose. (Envoy 1.40
    passes the guard's reply through the picker's filter, whose response headers are SEND: a picker
    stream for the reply only, no request seen.)"""
    assert_steering_refused_before_the_picker(shipped, field)


@pytest.mark.parametrize("case", sorted(UNREADABLE_BODIES))
def test_a_body_the_engine_would_read_otherwise_is_refused_before_any_engine(shipped: GatewayStack, case: str) -> None:
    assert_unreadable_body_refused_before_the_picker(shipped, case)


def test_a_pd_request_whose_client_body_steers_the_engine_gets_the_same_refusal(shipped: GatewayStack) -> None:
    """The guard runs before the picker, so it sees P/D requests too (the client's body, not ours): the
    same 400 pd-extproc gives on the P/D route, and no leg runs."""
    shipped.pick("decode-a")
    body = chat_body(max_tokens=2, kv_transfer_params={"remote_host": "10.0.0.9", "remote_port": 5600})
    error = assert_error(post(shipped, CHAT, body), 400, "reserved_request_field")
    assert error["param"] == "kv_transfer_params"
    assert_nothing_reached_an_engine(shipped)


def test_a_decode_only_request_with_a_null_steering_member_passes_untouched(shipped: GatewayStack) -> None:
    shipped.pick("decode-c", pd=False)
    raw = b'{"model": "emulated", "prompt": "hi", "max_tokens": 2, "kv_transfer_params": null}'
    response = post(shipped, COMPLETIONS, raw)
    assert response.status_code == 200, response.text
    assert shipped.decode("decode-c").raw_body(only(shipped.decode("decode-c").requests())["seq"]) == raw


@pytest.mark.parametrize("decode", DECODES)
def test_a_pd_request_reaches_exactly_the_picked_decode_through_override_host(
        shipped: GatewayStack, decode: str) -> None:
    shipped.pick(decode)
    body = chat_body(max_tokens=3)
    response = post(shipped, CHAT, body)
    assert response.status_code == 200, response.text
    assert served(shipped) == {name: int(name == decode) for name in DECODES}
    prefill, decoded = only(shipped.prefill.requests()), only(shipped.decode(decode).requests())
    # The handoff reaches decode: the guard ran before our rewrite, never after it.
    assert decoded["json"] == {**body, "kv_transfer_params": prefill["notes"]["kv_transfer_params"]}
    assert "x-prefiller-host-port" not in dict(decoded["headers"])


def test_a_decode_only_pick_costs_one_headers_message_without_the_matcher(shipped: GatewayStack) -> None:
    """An EnvoyExtensionPolicy cannot wrap our filter in the matcher: each decode-only request makes one
    headers exchange, answered by the server's passthrough."""
    shipped.pick("decode-a", pd=False)
    raw = b'{"model": "emulated", "prompt": "hi", "max_tokens": 2}'
    streams, sent = shipped.pd_streams(), shipped.pd_messages_sent()
    response = post(shipped, COMPLETIONS, raw)
    assert response.status_code == 200
    assert shipped.decode("decode-a").raw_body(only(shipped.decode("decode-a").requests())["seq"]) == raw
    assert shipped.pd_streams() == streams + 1 and shipped.pd_messages_sent() == sent + 1
    assert shipped.prefill.requests() == []


def test_a_prefill_leg_longer_than_envoy_gateways_10s_grpc_timeout_is_not_cut(shipped: GatewayStack) -> None:
    """Envoy Gateway always sets grpc_service.timeout: 10s on an ext_proc (extproc.go:105); the
    stream must outlive it while the prefill leg runs (the message timeout is what bounds it)."""
    shipped.pick("decode-b")
    shipped.prefill.script({"delay": 11.0})
    response = post(shipped, CHAT, chat_body(max_tokens=2))
    assert response.status_code == 200, response.text
    assert served(shipped)["decode-b"] == 1


def test_refusals_and_prefill_failures_reach_no_decode(shipped: GatewayStack) -> None:
    shipped.pick("decode-c")
    assert_error(post(shipped, CHAT, chat_body(n=2)), 400, "unsupported_pd_variant")
    shipped.prefill.script({"status": 503})
    assert_error(post(shipped, CHAT, chat_body(max_tokens=2)), 503, "prefill_upstream_error")
    assert served(shipped) == dict.fromkeys(DECODES, 0)


def test_a_clients_own_picker_headers_are_removed_before_the_picker(shipped: GatewayStack) -> None:
    shipped.pick("decode-a", pd=False)
    spoofed = {"x-prefiller-host-port": shipped.prefill.address,
               "x-gateway-destination-endpoint": shipped.decode("decode-c").address}
    with shipped.client() as client:
        response = client.post(CHAT, content=json.dumps(chat_body(max_tokens=2)), headers={**JSON, **spoofed})
    assert response.status_code == 200 and served(shipped) == {"decode-a": 1, "decode-b": 0, "decode-c": 0}
    assert not set(spoofed) & set(shipped.picker.seen()[-1])


def test_a_clients_steering_headers_are_removed_before_the_picker(shipped: GatewayStack) -> None:
    shipped.pick("decode-a", pd=False)
    spoofed = {"x-override-bootstrap-host": "10.0.0.9", "x-trtllm-disagg-auth": "forged"}
    with shipped.client() as client:
        response = client.post(CHAT, content=json.dumps(chat_body(max_tokens=2)), headers={**JSON, **spoofed})
    assert response.status_code == 200
    assert not set(spoofed) & set(shipped.picker.seen()[-1])
    assert not set(spoofed) & set(dict(only(shipped.decode("decode-a").requests())["headers"]))


def test_pd_extproc_down_is_our_json_503_for_the_whole_route_and_reaches_no_engine(shipped: GatewayStack) -> None:
    """statusOnError 510 and the route's responseOverride (Envoy Gateway's custom_response filter, sorted
    first): with every replica down a P/D request gets pd-extproc's documented JSON 503, and so does a
    decode-only one (without the matcher it makes a headers exchange too). Never a decode without its
    handoff."""
    for replica in shipped.replicas:
        replica.child.stop(sig=signal.SIGKILL)
    try:
        for pd in (True, False):
            shipped.pick("decode-b", pd=pd)
            response = post(shipped, CHAT, chat_body(max_tokens=2))
            assert_error(response, 503, "pd_extproc_unavailable")
            assert response.headers["content-type"] == "application/json"
        assert shipped.prefill.requests() == [] and served(shipped) == dict.fromkeys(DECODES, 0)
    finally:
        for replica in shipped.replicas:
            shipped.restart(replica)


@pytest.mark.parametrize("status", [503, 510])
def test_a_decode_engines_own_error_is_never_rewritten(shipped: GatewayStack, status: int) -> None:
    """The override matches Envoy's own replies only (source: Local): an engine answering 503, or even the
    510 mark, reaches the client as the engine sent it."""
    shipped.pick("decode-a", pd=False)
    shipped.decode("decode-a").script({"status": status})
    response = post(shipped, COMPLETIONS, b'{"model": "emulated", "prompt": "hi", "max_tokens": 2}')
    assert response.status_code == status
    assert "pd_extproc_unavailable" not in response.text and "emulated failure" in response.text
    assert served(shipped)["decode-a"] == 1


def test_pd_extprocs_own_json_503_is_not_rewritten(shipped: GatewayStack) -> None:
    shipped.pick("decode-c")
    shipped.prefill.script({"status": 503})
    assert_error(post(shipped, CHAT, chat_body(max_tokens=2)), 503, "prefill_upstream_error")
    assert served(shipped) == dict.fromkeys(DECODES, 0)


def test_the_picker_down_is_envoys_500_never_pd_extproc_unavailable() -> None:
    """The picker's extProc[0] has no statusOnError (Envoy's default 500); the responseOverride matches only
    pd-extproc's 510, so the client gets Envoy's own 500, never our pd_extproc_unavailable. Fail closed: no
    engine reached. A stack of its own: the picker is not restarted."""
    with gateway_stack(shape=shipped_shape, replicas=1) as stack:
        stack.picker.stop()
        response = post(stack, CHAT, chat_body(max_tokens=2))
        assert response.status_code == 500
        assert "pd_extproc" not in response.text
        assert stack.pd_streams() == 0
        assert_nothing_reached_an_engine(stack)
