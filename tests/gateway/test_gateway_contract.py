"""pd-extproc in gateway mode, behind a real Envoy in the gateway shape (tests/gateway/bootstrap.py):
the fake endpoint picker picks the decode endpoint and, for P/D, the prefill worker; our servers (two
replicas) run the prefill leg; Envoy sends the request to the decode endpoint the picker chose."""

from __future__ import annotations

import asyncio
import base64
import json
import os
import signal
from typing import Any

import httpx
import pytest

from tests.gateway.cases import (
    JSON,
    assert_nothing_reached_an_engine,
    assert_picker_down_is_gateway_error,
    post,
    served,
)
from tests.gateway.stack import DECODES, GatewayStack, gateway_stack
from tests.helpers import (
    CHAT,
    COMPLETIONS,
    assert_error,
    chat_body,
    closed_port,
    completion_body,
    eventually,
    only,
    sse_text,
)

pytestmark = pytest.mark.dataplane


# --- P/D through the gateway ---------------------------------------------------------------------------


@pytest.mark.parametrize("decode", DECODES)
@pytest.mark.parametrize("path,body", [(CHAT, chat_body(max_tokens=4)), (COMPLETIONS, completion_body(max_tokens=4))],
                         ids=["chat", "completions"])
def test_a_pd_request_reaches_exactly_the_picked_decode_with_the_handoff(
        gw: GatewayStack, decode: str, path: str, body: dict[str, Any]) -> None:
    gw.pick(decode)
    response = post(gw, path, body)
    assert response.status_code == 200, response.text
    assert response.headers["x-emulator-worker"] == decode
    assert served(gw) == {name: int(name == decode) for name in DECODES}, "only the picked decode"
    prefill, decoded = only(gw.prefill.requests()), only(gw.decode(decode).requests())
    assert prefill["json"]["stream"] is False and prefill["json"]["max_tokens"] == 1
    assert decoded["json"] == {**body, "kv_transfer_params": prefill["notes"]["kv_transfer_params"]}
    assert decoded["notes"]["load"] == "ok", "decode pulled the prefill's KV"
    for leg in (prefill, decoded):
        assert "x-prefiller-host-port" not in dict(leg["headers"]), "the picker's header reaches no engine"


def test_a_pd_stream_is_relayed_from_the_picked_decode(gw: GatewayStack) -> None:
    gw.pick("decode-c")
    body = chat_body(stream=True, max_tokens=6)
    with gw.client() as client, client.stream("POST", CHAT, content=json.dumps(body), headers=JSON) as response:
        raw = response.read()
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/event-stream")
    text, chunks = sse_text(raw.decode(), chat=True)
    assert text and chunks
    assert served(gw) == {"decode-a": 0, "decode-b": 0, "decode-c": 1}
    assert only(gw.decode("decode-c").requests())["json"]["kv_transfer_params"]
    assert len(gw.prefill.requests()) == 1


def test_a_client_dropping_a_pd_stream_ends_the_decode_request(gw: GatewayStack) -> None:
    """Through both ext_proc filters (the picker still processes the response body, full duplex), a
    client that leaves mid-stream makes Envoy end the decode request."""
    gw.pick("decode-b")
    gw.decode("decode-b").script({"token_interval": 0.05})
    body = chat_body(stream=True, max_tokens=400)
    with gw.client() as client, client.stream("POST", CHAT, content=json.dumps(body), headers=JSON) as response:
        lines = response.iter_lines()
        first = [next(lines) for _ in range(3)]
    assert first[0].startswith("data: ")
    assert gw.decode("decode-b").wait("disconnected"), "decode must see the stream end"


def test_a_large_pd_request_crosses_the_gateways_32_kib_connection_buffer_intact(gw: GatewayStack) -> None:
    """Envoy Gateway's listeners buffer 32 KiB per connection; the inference route's buffer limit lets
    our filter take a whole 1 MiB body, and both legs get it intact."""
    gw.pick("decode-a")
    image = "data:image/png;base64," + base64.b64encode(os.urandom(3 << 18)).decode()  # 1 MiB of base64
    body = chat_body(max_tokens=2, messages=[{"role": "user", "content": [
        {"type": "text", "text": "Describe this image."}, {"type": "image_url", "image_url": {"url": image}}]}])
    response = post(gw, CHAT, body)
    assert response.status_code == 200, response.text
    assert only(gw.decode("decode-a").requests())["json"]["messages"] == body["messages"]
    assert only(gw.prefill.requests())["json"]["messages"] == body["messages"]


# --- a request that is not P/D passes through ----------------------------------------------------------


def test_a_decode_only_pick_reaches_the_picked_decode_untouched_without_calling_us(gw: GatewayStack) -> None:
    """The matcher around our filter skips it when the picker set no x-prefiller-host-port."""
    gw.pick("decode-b", pd=False)
    raw = b'{"model": "emulated",  "prompt": "hi", "max_tokens": 3}'
    streams = gw.pd_streams()
    response = post(gw, COMPLETIONS, raw)
    assert response.status_code == 200 and response.headers["x-emulator-worker"] == "decode-b"
    assert gw.decode("decode-b").raw_body(only(gw.decode("decode-b").requests())["seq"]) == raw, "the client's bytes"
    assert gw.prefill.requests() == [], "the prefill leg must not run"
    assert served(gw) == {"decode-a": 0, "decode-b": 1, "decode-c": 0}
    assert gw.pd_streams() == streams, "no stream to our server"


@pytest.mark.parametrize("field", ["kv_transfer_params", "bootstrap_host", "disaggregated_params"])
def test_a_decode_only_request_that_steers_the_engine_is_refused_by_the_guard(gw: GatewayStack, field: str) -> None:
    """Our server never sees a decode-only request, so the client guard (the sidecar's passthrough
    guard, in a matcher that runs it only without x-prefiller-host-port) refuses a body member that
    would steer the decode engine, e.g. make vLLM pull KV from an address the client chose."""
    gw.pick("decode-b", pd=False)
    steering = {"remote_host": "10.0.0.9", "remote_port": 5600, "do_remote_prefill": True}
    body = chat_body(max_tokens=2, **{field: steering if field != "bootstrap_host" else "10.0.0.9"})
    streams = gw.pd_streams()
    error = assert_error(post(gw, CHAT, body), 400, "reserved_request_field")
    assert error["param"] == field
    assert_nothing_reached_an_engine(gw)
    assert gw.pd_streams() == streams, "refused by Envoy, not by a call to us"


def test_a_clients_steering_headers_are_removed_before_the_picker(gw: GatewayStack) -> None:
    gw.pick("decode-a", pd=False)
    spoofed = {"x-override-bootstrap-host": "10.0.0.9", "x-trtllm-disagg-auth": "forged"}
    assert post(gw, CHAT, chat_body(max_tokens=2), **spoofed).status_code == 200
    assert not set(spoofed) & set(gw.picker.seen()[-1])
    assert not set(spoofed) & set(dict(only(gw.decode("decode-a").requests())["headers"]))


def test_a_request_with_the_header_that_is_not_pd_passes_through_after_one_headers_message(gw: GatewayStack) -> None:
    """The server's own passthrough: the picker set x-prefiller-host-port on a request that is not a P/D
    POST; our server answers its headers message and Envoy sends it nothing more."""
    gw.pick("decode-c")
    streams, sent = gw.pd_streams(), gw.pd_messages_sent()
    passthroughs = gw.metric("pd_extproc_gateway_passthroughs_total")
    with gw.client() as client:
        response = client.get("/v1/models")
    assert response.status_code == 200
    assert served(gw) == {"decode-a": 0, "decode-b": 0, "decode-c": 1}, "the picked decode"
    assert gw.pd_streams() == streams + 1 and gw.pd_messages_sent() == sent + 1, "one headers message"
    assert gw.metric("pd_extproc_gateway_passthroughs_total") == passthroughs + 1
    assert gw.prefill.requests() == []
    assert "x-prefiller-host-port" not in dict(only(gw.decode("decode-c").requests())["headers"])


RESPONSES = "/v1/responses"


@pytest.mark.parametrize("field", ["kv_transfer_params", "bootstrap_host"])
def test_a_tagged_request_that_is_not_pd_and_steers_the_engine_is_refused(gw: GatewayStack, field: str) -> None:
    """The picker tagged a POST /v1/responses (an engine reads kv_transfer_params there too). The guard used
    to be skipped for every tagged request, and our server let a request that is not P/D through unseen:
    decode received the client's KV source. Now the guard is skipped only for what our server reads as P/D."""
    gw.pick("decode-a")
    body = {"model": "emulated", "input": "hi",
            field: {"remote_host": "10.0.0.9", "remote_port": 5600, "do_remote_prefill": True}
            if field == "kv_transfer_params" else "10.0.0.9"}
    error = assert_error(post(gw, RESPONSES, body), 400, "reserved_request_field")
    assert error["param"] == field
    assert_nothing_reached_an_engine(gw)


def test_a_tagged_request_that_is_not_pd_reaches_decode_once_its_body_is_read(gw: GatewayStack) -> None:
    """Without a steering member it goes on to the picked decode, unchanged but for the picker's headers;
    our server read its body (one stream, counted as a passthrough) and ran no prefill."""
    gw.pick("decode-b")
    body = {"model": "emulated", "input": "hi"}
    streams = gw.pd_streams()
    passthroughs = gw.metric("pd_extproc_gateway_passthroughs_total")
    post(gw, RESPONSES, body)
    decoded = only(gw.decode("decode-b").requests())
    assert decoded["json"] == body and "x-prefiller-host-port" not in dict(decoded["headers"])
    assert gw.prefill.requests() == []
    assert gw.pd_streams() == streams + 1
    assert gw.metric("pd_extproc_gateway_passthroughs_total") == passthroughs + 1


def test_a_clients_own_routing_headers_never_reach_the_picker_or_us(gw: GatewayStack) -> None:
    """The connection manager drops the client's x-prefiller-host-port and decode destination before
    any filter (early header mutation): with a decode-only pick the request passes through to the
    picked decode and no prefill leg runs."""
    gw.pick("decode-a", pd=False)
    spoofed = {"x-prefiller-host-port": gw.prefill.address,
               "x-gateway-destination-endpoint": gw.decode("decode-c").address}
    response = post(gw, CHAT, chat_body(max_tokens=2), **spoofed)
    assert response.status_code == 200 and response.headers["x-emulator-worker"] == "decode-a"
    assert not set(spoofed) & set(gw.picker.seen()[-1])
    assert gw.prefill.requests() == []
    assert "kv_transfer_params" not in only(gw.decode("decode-a").requests())["json"]


# --- refused before any leg --------------------------------------------------------------------------


@pytest.mark.parametrize("kind,body,prefill,status,code", [
    ("n", chat_body(n=2), None, 400, "unsupported_pd_variant"),
    ("not-json", b'{"model": ', None, 400, "invalid_request_body"),
    ("reserved", chat_body(kv_transfer_params={"do_remote_decode": True}), None, 400, "reserved_request_field"),
    ("bad-target", chat_body(), "10.0.0.1:8000,10.0.0.2:8000", 400, "invalid_prefill_target"),
    ("link-local", chat_body(), "169.254.169.254:80", 403, "prefill_target_forbidden"),
], ids=["n", "not-json", "reserved", "bad-target", "link-local"])
def test_refusals_have_their_documented_code_and_no_leg_runs(
        gw: GatewayStack, kind: str, body: Any, prefill: str | None, status: int, code: str) -> None:
    gw.pick("decode-b", prefill=prefill)
    assert_error(post(gw, CHAT, body), status, code)
    assert_nothing_reached_an_engine(gw)


# --- the prefill leg fails -----------------------------------------------------------------------------


def test_an_unreachable_prefill_worker_is_502_and_no_decode(gw: GatewayStack) -> None:
    gw.pick("decode-b", prefill=f"127.0.0.1:{closed_port()}")
    assert_error(post(gw, CHAT, chat_body(max_tokens=3)), 502, "prefill_upstream_unavailable")
    assert_nothing_reached_an_engine(gw)


def test_a_prefill_error_status_keeps_its_status_and_no_decode(gw: GatewayStack) -> None:
    gw.pick("decode-c")
    gw.prefill.script({"status": 503})
    assert_error(post(gw, COMPLETIONS, completion_body(max_tokens=3)), 503, "prefill_upstream_error")
    assert only(gw.prefill.requests())["status"] == 503
    assert served(gw) == dict.fromkeys(DECODES, 0)


def test_a_client_gone_while_prefill_pending_cancels_prefill_and_never_decodes(gw: GatewayStack) -> None:
    gw.pick("decode-a")
    gw.prefill.script({"hang": True})

    async def start_then_abandon() -> None:
        async with httpx.AsyncClient(base_url=gw.url, timeout=60) as client:
            request = asyncio.ensure_future(client.post(CHAT, content=json.dumps(chat_body()), headers=JSON))
            assert await asyncio.to_thread(lambda: gw.prefill.wait("pending")), "the prefill leg never started"
            request.cancel()
            with pytest.raises(asyncio.CancelledError):
                await request

    asyncio.run(start_then_abandon())
    assert gw.prefill.wait("disconnected"), "the prefill request must be cancelled"
    assert served(gw) == dict.fromkeys(DECODES, 0), "the decode leg must not run"
    assert eventually(lambda: gw.metric('pd_extproc_requests_total{adapter="vllm_nixl",outcome="cancelled"}') >= 1)


# --- the pd-extproc Deployment: two replicas, then none ----------------------------------------------------


def test_two_replicas_share_the_pd_requests_and_one_leaving_loses_none(gw: GatewayStack) -> None:
    gw.pick("decode-b")

    def ok_on(replica: int) -> float:
        return gw.replicas[replica].scrape().get('pd_extproc_requests_total{adapter="vllm_nixl",outcome="ok"}', 0.0)

    before = [ok_on(0), ok_on(1)]
    for _ in range(20):
        assert post(gw, CHAT, chat_body(max_tokens=2)).status_code == 200
        if ok_on(0) > before[0] and ok_on(1) > before[1]:
            break
    assert ok_on(0) > before[0] and ok_on(1) > before[1], "Envoy spreads P/D streams over both replicas"
    leaving = gw.replicas[0]
    leaving.child.stop(sig=signal.SIGTERM)  # drains: health NOT_SERVING, then the listener closes
    assert eventually(lambda: gw.healthy_replicas() == 1, within=20), "Envoy's health check ejects it"
    try:
        for _ in range(4):
            assert post(gw, CHAT, chat_body(max_tokens=2)).status_code == 200
    finally:
        gw.restart(leaving)
        assert eventually(lambda: gw.healthy_replicas() == 2, within=20)


def test_pd_extproc_down_is_a_json_503_never_a_silent_decode(gw: GatewayStack) -> None:
    """Every replica gone: a P/D request gets our JSON 503 and reaches no engine; a decode-only request
    (our filter skipped) is still served by the picked decode; the gateway's other routes keep their
    own answers. P/D recovers once the replicas are back."""
    for replica in gw.replicas:
        replica.child.stop(sig=signal.SIGKILL)
    try:
        gw.pick("decode-a")
        assert_error(post(gw, CHAT, chat_body()), 503, "pd_extproc_unavailable")
        assert_nothing_reached_an_engine(gw)
        gw.pick("decode-c", pd=False)
        plain = post(gw, CHAT, chat_body(max_tokens=2))
        assert plain.status_code == 200 and plain.headers["x-emulator-worker"] == "decode-c"
        assert "kv_transfer_params" not in only(gw.decode("decode-c").requests())["json"]
        assert gw.prefill.requests() == []
        with gw.client() as client:
            other = client.get("/status")
        assert other.status_code == 404 and other.text == "user's own 404", "another route's reply is its own"
    finally:
        for replica in gw.replicas:
            gw.restart(replica)
    gw.pick("decode-a")
    assert eventually(lambda: post(gw, CHAT, chat_body(max_tokens=2)).status_code == 200, within=20)


def test_the_picker_down_is_a_gateway_error_with_its_status_never_pd_extproc_unavailable() -> None:
    """Two ext_procs on the route, and Envoy's details for either one's failure start with ext_proc_error:
    only ours answers status_on_error 510 (parts.GATEWAY_STATUS_ON_ERROR), so the picker's failure (Envoy's
    default 500, as Envoy AI Gateway renders its filter) is gateway_error with that status, not our
    pd_extproc_unavailable. Fail closed: no engine reached, our filter never called. A stack of its own:
    the picker is not restarted."""
    with gateway_stack(replicas=1) as stack:
        assert_picker_down_is_gateway_error(stack)
        # The same Envoy with the picker down and our server down: still the picker's failure (it runs first).
        stack.replicas[0].child.stop(sig=signal.SIGKILL)
        assert_error(post(stack, CHAT, chat_body(max_tokens=2)), 500, "gateway_error")
        assert_nothing_reached_an_engine(stack)
