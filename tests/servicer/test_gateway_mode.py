"""Gateway mode at the message level: what the server answers a request that is not P/D, and that a
P/D request is handled exactly as in sidecar mode (extproc/envoy/gateway.py)."""

from __future__ import annotations

import json

import pytest
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2

from extproc.envoy.gateway import PASSTHROUGH_MODE
from extproc.protocol.headers import PICKER_HEADERS
from tests.ext_proc_messages import body_message, error_of, headers_message
from tests.helpers import closed_port
from tests.servicer.test_servicer import CHAT, Harness, run

Mode = processing_mode_pb2.ProcessingMode
GATEWAY = {"PD_EXTPROC_MODE": "gateway"}


def passthroughs(h: Harness) -> float:
    return h.server.metrics.passthroughs._value.get()  # type: ignore[no-any-return]


def test_an_untagged_request_gets_one_reply_that_turns_the_stream_off() -> None:
    """Where a gateway runs our filter without its matcher: a request the picker did not tag (the client
    guard in front reads its body) is let through after its headers."""
    async def test(h: Harness) -> None:
        extra = {":method": "POST", "x-encoder-hosts-ports": "10.0.0.2:8000"}
        responses = await h.exchange(headers_message(CHAT, extra), body_message({"messages": []}))
        assert len(responses) == 1, "the server ends the stream after the headers reply"
        reply = responses[0]
        assert reply.WhichOneof("response") == "request_headers"
        assert reply.mode_override == PASSTHROUGH_MODE
        assert reply.mode_override.request_body_mode == Mode.NONE
        assert reply.mode_override.response_header_mode == Mode.SKIP
        mutation = reply.request_headers.response.header_mutation
        assert list(mutation.set_headers) == [] and not reply.request_headers.response.HasField("body_mutation")
        assert set(mutation.remove_headers) == PICKER_HEADERS
        assert not reply.request_headers.response.clear_route_cache, "never re-route: the picker chose"
        assert passthroughs(h) == 1
        assert h.prefill.control.records == []

    run(test, **GATEWAY)


_NOT_PD = pytest.mark.parametrize("method,path", [
    ("POST", "/cohere/v2/chat"),         # not a P/D path (vLLM reads kv_transfer_params there)
    ("POST", "/v1/embeddings"),
    ("GET", CHAT),                       # not a POST
    ("POST", "/v1/chat/completionsX"),   # the path must match whole
], ids=["cohere", "embeddings", "get", "path-suffix"])


@_NOT_PD
def test_a_tagged_request_that_is_not_pd_is_let_through_only_after_its_body_is_read(method: str, path: str) -> None:
    """The picker tagged it, so the client guard in front was skipped only if it is P/D: our server reads
    its body before it goes on, without the picker's headers and without a prefill."""
    async def test(h: Harness) -> None:
        extra = {":method": method, "x-prefiller-host-port": h.prefill_address}
        responses = await h.exchange(headers_message(path, extra), body_message({"model": "m", "input": "hi"}))
        assert [r.WhichOneof("response") for r in responses] == ["request_headers", "request_body"]
        assert not responses[0].HasField("mode_override"), "the body is wanted"
        common = responses[1].request_body.response
        assert set(common.header_mutation.remove_headers) == PICKER_HEADERS
        assert not common.HasField("body_mutation") and not common.clear_route_cache
        assert passthroughs(h) == 1
        assert h.prefill.control.records == []

    run(test, **GATEWAY)


@_NOT_PD
@pytest.mark.parametrize("field", ["kv_transfer_params", "bootstrap_host", "vllm_xargs.kv_transfer_params"])
def test_a_tagged_request_that_is_not_pd_with_a_steering_member_is_refused(method: str, path: str, field: str) -> None:
    """Even where no guard runs in front (a gateway shape without it), a tagged request never reaches
    decode unseen with a member that steers the engine: the P/D route's documented 400."""
    async def test(h: Harness) -> None:
        head, _, tail = field.partition(".")
        value: object = {"remote_host": "10.0.0.9", "remote_port": 5600}
        body = {"model": "m", "input": "hi", head: {tail: value} if tail else value}
        extra = {":method": method, "x-prefiller-host-port": h.prefill_address}
        responses = await h.exchange(headers_message(path, extra), body_message(body))
        assert len(responses) == 2 and error_of(responses[1]) == (400, "reserved_request_field")
        assert passthroughs(h) == 0
        assert h.prefill.control.records == []

    run(test, **GATEWAY)


def test_a_pd_request_in_gateway_mode_is_handled_as_in_sidecar_mode_and_drops_the_picker_headers() -> None:
    async def test(h: Harness) -> None:
        responses = await h.exchange(headers_message(CHAT, {"x-prefiller-host-port": h.prefill_address}),
                                     body_message({"messages": [{"role": "user", "content": "x"}]}))
        assert [r.WhichOneof("response") for r in responses] == ["request_headers", "request_body"]
        assert not responses[0].HasField("mode_override")
        common = responses[1].request_body.response
        assert set(common.header_mutation.remove_headers) >= PICKER_HEADERS
        assert not common.clear_route_cache, "the request goes where the picker sent it"
        keys = {m.header.key for m in common.header_mutation.set_headers}
        assert not keys & {"x-gateway-destination-endpoint", ":authority", "host"}
        assert len(h.prefill.control.records) == 1
        assert passthroughs(h) == 0

    run(test, **GATEWAY)


def test_a_bad_prefill_header_is_refused_in_gateway_mode_too() -> None:
    async def test(h: Harness) -> None:
        responses = await h.exchange(headers_message(CHAT, {"x-prefiller-host-port": "10.0.0.1:80,10.0.0.2:80"}))
        assert error_of(responses[0]) == (400, "invalid_prefill_target")

    run(test, **GATEWAY)


def test_sidecar_mode_never_passes_through() -> None:
    """In sidecar mode Envoy's pd route calls us only for P/D requests: a request without the header
    that reaches us anyway (a hand-edited config) is refused, as before."""
    async def test(h: Harness) -> None:
        responses = await h.exchange(headers_message(CHAT, {}))
        assert error_of(responses[0]) == (400, "invalid_prefill_target")

    run(test)


def test_the_aggregated_fallback_sends_the_clients_request_to_the_picked_decode() -> None:
    """Gateway mode's fallback: the body reply carries the client's request without a handoff and no
    destination of ours; Envoy sends it where the picker already chose."""
    async def test(h: Harness) -> None:
        body = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 3}
        responses = await h.exchange(headers_message(CHAT, {"x-prefiller-host-port": f"127.0.0.1:{closed_port()}"}),
                                     body_message(body))
        assert [r.WhichOneof("response") for r in responses] == ["request_headers", "request_body"]
        common = responses[1].request_body.response
        assert json.loads(common.body_mutation.body) == body
        assert dict(responses[1].dynamic_metadata)["pd_extproc"]["fallback"].startswith("aggregated")
        assert not common.clear_route_cache
        assert not {m.header.key for m in common.header_mutation.set_headers} & {"x-gateway-destination-endpoint"}

    run(test, **GATEWAY, PD_EXTPROC_PREFILL_FALLBACK="aggregated")


@pytest.mark.parametrize("raw", [
    rb'{"model": "m", "kv_transfer_param\u0073": {"remote_host": "10.0.0.9"}}',
    rb'{"model": "m", "\u0062ootstrap_host": "10.0.0.9"}',
    rb'{"model": "m", "parameters": {"bootstrap_room": 7}, "kv_transfer_params": null, "bootstrap_room": 1}',
    '{"model": "m", "kv_transfer_params": {"remote_host": "10.0.0.9"}}'.encode("utf-16-le"),
    '{"model": "m", "kv_transfer_params": {"remote_host": "10.0.0.9"}}'.encode("utf-16"),
    '{"model": "m", "bootstrap_host": "10.0.0.9"}'.encode("utf-32-be"),
    b'{"model": "m", "temperature": NaN, "kv_transfer_params": {"remote_host": "10.0.0.9"}}',
    b'\xef\xbb\xbf{"model": "m", "kv_transfer_params": {"remote_host": "10.0.0.9"}}',
], ids=["escaped-last-letter", "escaped-first-letter", "plain", "utf-16-le", "utf-16-bom", "utf-32-be", "nan",
        "utf-8-bom"])
def test_a_steering_member_spelled_with_escapes_is_refused_too(raw: bytes) -> None:
    """The server parses a tagged body only when a steering name can appear in it: literally, through a
    \\u escape, or in UTF-16/32; it reads it as CPython's json.loads does for vLLM (NaN, a BOM, UTF-16/32:
    what orjson refuses) and as orjson does for SGLang."""
    async def test(h: Harness) -> None:
        extra = {":method": "POST", "x-prefiller-host-port": h.prefill_address}
        responses = await h.exchange(headers_message("/cohere/v2/chat", extra), body_message(raw))
        assert error_of(responses[1]) == (400, "reserved_request_field")

    run(test, **GATEWAY)
