"""k8s/gateway-mode/istio as Istio 1.28 renders pd-gateway's listener with its EnvoyFilters applied
(tests/deploy/test_gateway_mode.py ``istio_gateway_shape``: Istio's filters and route read in its source,
the EnvoyFilters applied as listener_patch.go applies them), run on a real Envoy 1.40 with the fake
picker, our servers and three decode workers. Filter order: the client guard (inserted before the picker),
Istio's picker (enabled on the route by ExtProcPerRoute overrides), grpc_stats, fault, cors, pd-extproc
(inserted before the router), the router; local-reply mappers scoped to the route pd-inference.

The only changes to that shape here are the addresses (loopback ports of this test's processes), an
admin endpoint, and stat prefixes (the connection manager's, each ext_proc's) to read Envoy's counters."""

from __future__ import annotations

import copy
import json
import signal
from collections.abc import Iterator
from typing import Any

import pytest

from deploy import render_manifests as rm
from extproc.config import Settings
from tests.deploy.test_gateway_mode import ISTIO, ISTIO_PICKER_FILTER, ISTIO_ROUTER, istio_gateway_shape, rendered
from tests.gateway.bootstrap import PD_STAT, PICKER_STAT
from tests.gateway.cases import (
    STEERING_FIELDS,
    UNREADABLE_BODIES,
    assert_picker_down_is_gateway_error,
    assert_steering_refused_before_the_picker,
    assert_unreadable_body_refused_before_the_picker,
)
from tests.gateway.stack import DECODES, GatewayStack, gateway_stack
from tests.gateway.test_gateway_contract import assert_error, assert_nothing_reached_an_engine, post, served
from tests.gateway.test_shipped_shape import _endpoints
from tests.helpers import CHAT, COMPLETIONS, chat_body, only

pytestmark = pytest.mark.dataplane

PD_FILTER = "envoy.filters.http.ext_proc/pd-extproc"  # k8s/gateway-mode/istio/envoyfilter.yaml


def _hcm(bootstrap: dict[str, Any]) -> dict[str, Any]:
    hcm: dict[str, Any] = bootstrap["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0][
        "typed_config"]
    return hcm


def istio_shape(settings: Settings, picker: str, replicas: list[str], decodes: list[str]) -> dict[str, Any]:
    bootstrap = copy.deepcopy(istio_gateway_shape(rendered(ISTIO)))
    hcm = _hcm(bootstrap)
    hcm["stat_prefix"] = "http-10080"
    filters = {f["name"]: f for f in hcm["http_filters"]}
    filters[ISTIO_PICKER_FILTER]["typed_config"]["stat_prefix"] = PICKER_STAT
    filters[PD_FILTER]["typed_config"]["stat_prefix"] = PD_STAT
    (route,) = hcm["route_config"]["virtual_hosts"][0]["routes"]
    picker_cluster = route["typed_per_filter_config"][ISTIO_PICKER_FILTER]["overrides"]["grpc_service"][
        "envoy_grpc"]["cluster_name"]
    hosts = {picker_cluster: [picker], route["route"]["cluster"]: decodes,
             filters[PD_FILTER]["typed_config"]["grpc_service"]["envoy_grpc"]["cluster_name"]: replicas}
    for cluster in bootstrap["static_resources"]["clusters"]:
        cluster["load_assignment"]["endpoints"] = _endpoints(hosts.pop(cluster["name"]))
    assert hosts == {}
    bootstrap["admin"] = {"address": {"socket_address": {"address": "127.0.0.1", "port_value": 0}}}
    return dict(bootstrap)


@pytest.fixture(scope="module")
def istio_running() -> Iterator[GatewayStack]:
    with gateway_stack(shape=istio_shape) as stack:
        yield stack


@pytest.fixture
def istio(istio_running: GatewayStack) -> GatewayStack:
    return istio_running.reset()


def test_the_running_envoy_has_the_guard_before_the_picker_and_pd_extproc_before_the_router(
        istio: GatewayStack) -> None:
    assert istio.envoy is not None
    dump = json.loads(istio.envoy.admin_get("/config_dump?resource=static_listeners"))
    (listener,) = dump["configs"]
    names = [f["name"] for f in listener["listener"]["filter_chains"][0]["filters"][0]["typed_config"]["http_filters"]]
    assert names[:2] == [rm.ISTIO_GUARD_FILTER, ISTIO_PICKER_FILTER] and names[-2:] == [PD_FILTER, ISTIO_ROUTER]


@pytest.mark.parametrize("field", STEERING_FIELDS)
def test_a_decode_only_request_that_steers_the_engine_is_refused_before_any_engine(
        istio: GatewayStack, field: str) -> None:
    """The gap the Istio variant had: pd-extproc answers a decode-only request at its headers and never sees
    its body. The guard, inserted before Istio's picker, refuses it on the client's own body."""
    assert_steering_refused_before_the_picker(istio, field)


@pytest.mark.parametrize("case", sorted(UNREADABLE_BODIES))
def test_a_body_the_engine_would_read_otherwise_is_refused_before_any_engine(istio: GatewayStack, case: str) -> None:
    assert_unreadable_body_refused_before_the_picker(istio, case)


def test_a_pd_request_whose_client_body_steers_the_engine_gets_the_same_refusal(istio: GatewayStack) -> None:
    istio.pick("decode-a")
    body = chat_body(max_tokens=2, kv_transfer_params={"remote_host": "10.0.0.9", "remote_port": 5600})
    assert assert_error(post(istio, CHAT, body), 400, "reserved_request_field")["param"] == "kv_transfer_params"
    assert_nothing_reached_an_engine(istio)


@pytest.mark.parametrize("decode", DECODES)
def test_a_pd_request_reaches_exactly_the_picked_decode_with_the_handoff(istio: GatewayStack, decode: str) -> None:
    """Istio's pool cluster follows the picker's envoy.lb metadata (override_host); the guard ran on the
    client's body, never on our rewritten one (which carries kv_transfer_params)."""
    istio.pick(decode)
    body = chat_body(max_tokens=3)
    response = post(istio, CHAT, body)
    assert response.status_code == 200, response.text
    assert served(istio) == {name: int(name == decode) for name in DECODES}
    prefill, decoded = only(istio.prefill.requests()), only(istio.decode(decode).requests())
    assert decoded["json"] == {**body, "kv_transfer_params": prefill["notes"]["kv_transfer_params"]}
    assert "x-prefiller-host-port" not in dict(decoded["headers"])


def test_a_decode_only_pick_passes_untouched_after_one_headers_message(istio: GatewayStack) -> None:
    istio.pick("decode-c", pd=False)
    raw = b'{"model": "emulated", "prompt": "hi", "max_tokens": 2, "kv_transfer_params": null}'
    streams, sent = istio.pd_streams(), istio.pd_messages_sent()
    response = post(istio, COMPLETIONS, raw)
    assert response.status_code == 200, response.text
    assert istio.decode("decode-c").raw_body(only(istio.decode("decode-c").requests())["seq"]) == raw
    assert istio.pd_streams() == streams + 1 and istio.pd_messages_sent() == sent + 1
    assert istio.prefill.requests() == []


def test_pd_extproc_down_is_our_json_503_and_reaches_no_engine(istio: GatewayStack) -> None:
    """status_on_error 510 (envoyfilter.yaml, parts.GATEWAY_STATUS_ON_ERROR) and the merged local-reply mappers
    (scoped to pd-inference): with every replica down a P/D request and a decode-only one (our filter makes
    a headers exchange for it) get pd-extproc's documented JSON 503, never a decode without its handoff."""
    for replica in istio.replicas:
        replica.child.stop(sig=signal.SIGKILL)
    try:
        for pd in (True, False):
            istio.pick("decode-b", pd=pd)
            response = post(istio, CHAT, chat_body(max_tokens=2))
            assert_error(response, 503, "pd_extproc_unavailable")
            assert response.headers["content-type"] == "application/json"
        assert istio.prefill.requests() == [] and served(istio) == dict.fromkeys(DECODES, 0)
    finally:
        for replica in istio.replicas:
            istio.restart(replica)


def test_a_decode_engines_own_503_is_never_rewritten(istio: GatewayStack) -> None:
    """Local-reply mappers act on Envoy's own replies only: an engine's answer reaches the client as sent."""
    istio.pick("decode-a", pd=False)
    istio.decode("decode-a").script({"status": 503})
    response = post(istio, COMPLETIONS, b'{"model": "emulated", "prompt": "hi", "max_tokens": 2}')
    assert response.status_code == 503
    assert "pd_extproc_unavailable" not in response.text and "emulated failure" in response.text


def test_pd_extprocs_own_json_errors_are_not_rewritten(istio: GatewayStack) -> None:
    istio.pick("decode-c")
    istio.prefill.script({"status": 503})
    assert_error(post(istio, CHAT, chat_body(max_tokens=2)), 503, "prefill_upstream_error")
    assert_error(post(istio, CHAT, chat_body(n=2)), 400, "unsupported_pd_variant")
    assert served(istio) == dict.fromkeys(DECODES, 0)


def test_the_picker_down_fails_closed_as_a_gateway_error_not_pd_extproc_unavailable() -> None:
    """The pool's failureMode FailClose becomes the picker route override's failure_mode_allow false: no
    decode without a pick. Istio's picker filter sets no status_on_error (Envoy's default, 500) and ours
    answers 510, so the mappers, which see ext_proc_error_* details from both, label only ours
    pd_extproc_unavailable: the picker's failure is gateway_error with its 500. A stack of its own: the
    picker is not restarted."""
    with gateway_stack(shape=istio_shape, replicas=1) as stack:
        assert_picker_down_is_gateway_error(stack)
