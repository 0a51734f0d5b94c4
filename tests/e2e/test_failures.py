"""C16-C30: failure semantics, limits, cancellation, shutdown and addressing, through a real Envoy.

Every failure test asserts the next leg was not dispatched. Timeouts here are short settings on
dedicated stacks, so a misclassified failure cannot pass by waiting: each expiry has its own code. They
are short, not tight: a prefill worker that answers at once must never trip them on a loaded machine
(5 s to read, 6 s in all), so only a worker scripted to stall does.
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import signal
import socket
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from pd_extproc_lab.emulator import text
from tests.harness import Stack, WorkerSpec, running_stack
from tests.helpers import CHAT, COMPLETIONS, assert_error, chat_body, closed_port, eventually, only, post

pytestmark = pytest.mark.dataplane

SHORT = {
    "PD_EXTPROC_PREFILL_CONNECT_TIMEOUT": "1s",
    "PD_EXTPROC_PREFILL_READ_TIMEOUT": "5s",
    "PD_EXTPROC_PREFILL_DEADLINE": "6s",
    "PD_EXTPROC_ENVOY_MESSAGE_TIMEOUT": "7500ms",  # more than 1 s over the deadline (config.py's rule)
    "PD_EXTPROC_DECODE_IDLE_TIMEOUT": "8s",  # over the message timeout (the same rule)
    "PD_EXTPROC_CLIENT_BODY_TIMEOUT": "2s",
}


@pytest.fixture(scope="module")
def short_deadline() -> Iterator[Stack]:
    with running_stack(SHORT) as stack:
        yield stack


@pytest.fixture
def short(short_deadline: Stack) -> Stack:
    return short_deadline.reset()



@pytest.fixture
def unanswered_listener() -> Iterator[int]:
    """A listener whose accept queue is full, so a new connection attempt is never answered."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(0)
    fillers = []
    port = int(server.getsockname()[1])
    for _ in range(4):
        filler = socket.socket()
        filler.setblocking(False)
        filler.connect_ex(("127.0.0.1", port))
        fillers.append(filler)
    yield port
    for filler in fillers:
        filler.close()
    server.close()


# --- C16-C17: prefill answers badly ---------------------------------------------------------------


@pytest.mark.parametrize("status", [400, 401, 404, 413, 422, 429, 500, 503])
def test_c16_prefill_http_error_stops_before_decode(stack: Stack, status: int) -> None:
    """C16: a prefill 4xx/5xx keeps its status; decode never runs. The engine's own error about the
    request (400, 404, 413, 422 in its OpenAI shape) reaches the client as the engine said it, as it
    would without P/D (issue 23); any other answer's body is dropped for our generic error."""
    stack.prefill.script({"status": status, "echo_request": True})
    response = post(stack, CHAT, chat_body(marker="zq-c16-marker"))
    if status in (400, 404, 413, 422):
        assert response.status_code == status
        error = response.json()["error"]
        assert error["message"].startswith("emulated failure: ") and "zq-c16-marker" in error["message"]
        assert (error["type"], error["param"], error["code"]) == ("EmulatedError", None, status)
    else:
        assert_error(response, status, "prefill_upstream_error")
        assert "emulated failure" not in response.text and "zq-c16-marker" not in response.text
    assert len(stack.prefill.requests()) == 1
    assert stack.decode.requests() == [], "the decode leg must not run"


def test_c16_prefill_redirect_is_a_bad_gateway(stack: Stack) -> None:
    """C16: a 3xx is not followed (it could point anywhere) and becomes 502."""
    stack.prefill.script({"status": 302})
    assert_error(post(stack, CHAT, chat_body()), 502, "prefill_upstream_error")
    assert stack.decode.requests() == []


@pytest.mark.parametrize("behaviour,code", [
    ({"raw_body": "this is not json"}, "prefill_response_not_json"),
    ({"raw_body": '{"id": "cmpl-1", "kv_transfer_params": {"do_remote'}, "prefill_response_truncated"),
    ({"truncate": True}, "prefill_response_truncated"),
    ({"sse": True}, "prefill_response_streamed"),
    ({"raw_body": "data: {}\n\n", "content_type": "application/json"}, "prefill_response_streamed"),
    ({"pad_bytes": 2 << 20}, "prefill_response_too_large"),
], ids=["non-json", "truncated-json", "closed-mid-body", "sse", "sse-mislabelled", "too-large"])
def test_c17_bad_prefill_bodies_are_distinct_errors(stack: Stack, behaviour: dict[str, Any], code: str) -> None:
    """C17: each kind of unusable prefill body has its own documented 502; decode never runs."""
    stack.prefill.script(behaviour)
    assert_error(post(stack, CHAT, chat_body()), 502, code)
    assert stack.decode.requests() == [], "the decode leg must not run"


def test_prefill_response_over_the_cap_is_refused_while_reading(stack: Stack) -> None:
    """C18: a chunked body with no Content-Length is capped while reading: we stop and hang up long
    before the prefill worker finishes sending 64 MiB."""
    stack.prefill.script({"chunked_pad_bytes": 64 << 20})
    assert_error(post(stack, CHAT, chat_body()), 502, "prefill_response_too_large")
    assert stack.prefill.wait("disconnected"), "we must stop reading at the cap, not after the body"
    assert stack.decode.requests() == []


# --- C19: prefill transport -----------------------------------------------------------------------


def test_prefill_connection_refused_is_502(short: Stack) -> None:
    """C19: nothing listening at the target: 502 prefill_upstream_unavailable."""
    response = post(short, CHAT, chat_body(), **{"x-prefiller-host-port": f"127.0.0.1:{closed_port()}"})
    assert_error(response, 502, "prefill_upstream_unavailable")
    assert short.decode.requests() == []


def test_prefill_connect_timeout_is_504(short: Stack, unanswered_listener: int) -> None:
    """C19: a target that never answers the connection attempt: 504 at the connect timeout."""
    response = post(short, CHAT, chat_body(), **{"x-prefiller-host-port": f"127.0.0.1:{unanswered_listener}"})
    assert_error(response, 504, "prefill_upstream_timeout")
    assert short.decode.requests() == []


@pytest.mark.parametrize("behaviour", [{"delay": 30}, {"stall_after_headers": True}],
                         ids=["no-response-head", "head-then-stalled-body"])
def test_prefill_stall_is_a_timeout_not_a_protocol_error(short: Stack, behaviour: dict[str, Any]) -> None:
    """C19: a prefill worker that goes silent (before or after its response head) is a 504."""
    short.prefill.script(behaviour)
    assert_error(post(short, CHAT, chat_body()), 504, "prefill_upstream_timeout")
    assert short.prefill.wait("disconnected"), "the stalled prefill connection must be closed"
    assert short.decode.requests() == []


def test_prefill_deadline_bounds_a_dripping_peer(short: Stack) -> None:
    """C19: a byte every 400 ms never trips the 5 s read timeout, but the 6 s total deadline ends it."""
    short.prefill.script({"drip_interval": 0.4})
    assert_error(post(short, CHAT, chat_body()), 504, "prefill_upstream_timeout")
    assert short.decode.requests() == []


def test_malformed_prefill_body_that_ends_at_once_is_a_protocol_error(short: Stack) -> None:
    """C19: a broken body that ends immediately stays a 502 protocol error, not a timeout."""
    short.prefill.script({"raw_body": "{oops"})
    assert_error(post(short, CHAT, chat_body()), 502, "prefill_response_not_json")
    assert short.decode.requests() == []


# --- C18: request size ------------------------------------------------------------------------------


def image_request(size: int) -> tuple[dict[str, Any], str]:
    image = base64.b64encode(os.urandom(size * 3 // 4)).decode()
    url = "data:image/png;base64," + image
    body = {"model": "emulated", "max_tokens": 3, "messages": [{"role": "user", "content": [
        {"type": "text", "text": "Describe this image."},
        {"type": "image_url", "image_url": {"url": url}}]}]}
    return body, url


def test_20_mib_multimodal_request_reaches_both_legs_intact(stack: Stack) -> None:
    """C18: a 20 MiB chat request with a base64 image succeeds; both engines get the image byte for byte."""
    body, url = image_request(20 << 20)
    assert post(stack, CHAT, body).status_code == 200
    prefill = json.loads(stack.prefill.raw_body(only(stack.prefill.requests())["seq"]))
    decode = json.loads(stack.decode.raw_body(only(stack.decode.requests())["seq"]))
    assert prefill["messages"][0]["content"][1]["image_url"]["url"] == url
    assert decode["messages"] == body["messages"]
    assert decode["kv_transfer_params"]["do_remote_prefill"] is True


def test_request_too_large_gets_413(stack: Stack) -> None:
    """C18: above 32 MiB: 413 request_too_large in the JSON shape, before any leg."""
    body, _ = image_request(40 << 20)
    assert_error(post(stack, CHAT, body), 413, "request_too_large")
    assert stack.prefill.requests() == [] and stack.decode.requests() == []


def test_client_that_stalls_its_body_gets_a_json_408(short: Stack) -> None:
    """C18: headers, part of the body, then silence: Envoy's request timeout answers in our JSON shape."""
    host, port = short.url.removeprefix("http://").rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=15) as conn:
        conn.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                     b"x-prefiller-host-port: " + short.prefill.address.encode() +
                     b"\r\ncontent-length: 1000\r\n\r\n{\"messages\":")
        reply = b""
        while b"\r\n\r\n" not in reply or not reply.rstrip().endswith(b"}"):
            chunk = conn.recv(65536)
            if not chunk:
                break
            reply += chunk
    head, _, body = reply.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408")
    assert json.loads(body)["error"]["code"] == "request_timeout"
    assert short.prefill.requests() == [] and short.decode.requests() == []


# --- C20-C21, C26: the decode leg -------------------------------------------------------------------


@pytest.fixture(scope="module")
def no_decode() -> Iterator[Stack]:
    with running_stack({"PD_EXTPROC_DECODE": f"127.0.0.1:{closed_port()}"},
                       workers=(WorkerSpec("prefill", "prefill"),)) as s:
        yield s


def test_decode_unreachable_is_json_503(no_decode: Stack) -> None:
    """C20: decode down: the P/D request and a passthrough request both get a JSON 503 from Envoy."""
    no_decode.reset()
    assert_error(post(no_decode, CHAT, chat_body()), 503, "decode_upstream_unavailable")
    with no_decode.client() as client:
        passthrough = client.post(COMPLETIONS, json={"prompt": "x"})
    assert_error(passthrough, 503, "decode_upstream_unavailable")


def test_decode_error_status_reaches_the_client_as_decode_sent_it(stack: Stack) -> None:
    """C20: decode's own 5xx (vLLM's KV-load failure, for one) is decode's response, unchanged."""
    stack.decode.script({"status": 500})
    response = post(stack, CHAT, chat_body())
    assert response.status_code == 500
    assert response.json()["error"]["message"] == "emulated failure"
    assert len(stack.prefill.requests()) == 1 and len(stack.decode.requests()) == 1


def test_decode_idle_timeout_is_json_504(short: Stack) -> None:
    """C20: a decode worker that goes silent is cut at decode_idle_timeout with a JSON 504."""
    short.decode.script({"hang": True})
    assert_error(post(short, CHAT, chat_body()), 504, "decode_upstream_timeout")
    assert short.decode.wait("disconnected")


SSE_WITHOUT_DONE = "".join(
    f'data: {{"id":"chatcmpl-1","object":"chat.completion.chunk","choices":[{{"index":0,"delta":'
    f'{{"content":"{word}"}}}}]}}\n\n' for word in (" a", " b\\n", " c:d", " \\u00e9")
)


@pytest.mark.parametrize("chunking", ["event", "byte", "split", "whole"])
def test_c21_c26_decode_bytes_are_relayed_verbatim_whatever_the_chunking(stack: Stack, chunking: str) -> None:
    """C21/C26: the client gets decode's exact bytes (no fabricated [DONE]) however decode cut its writes."""
    stack.decode.script({"sse_raw": SSE_WITHOUT_DONE, "chunking": chunking})
    with stack.client() as client, client.stream("POST", CHAT, content=json.dumps(chat_body(stream=True)),
                                                  headers=stack.pd_headers()) as response:
        received = b"".join(response.iter_raw())
    assert received == SSE_WITHOUT_DONE.encode()


# --- C22-C25: cancellation -------------------------------------------------------------------------


async def start_then_abandon(stack: Stack, body: dict[str, Any], ready: Any) -> None:
    """Send a P/D request, wait until ``ready()`` holds, then drop the client connection."""
    async with httpx.AsyncClient(base_url=stack.url, timeout=60) as client:
        request = asyncio.ensure_future(client.post(CHAT, content=json.dumps(body), headers=stack.pd_headers()))
        assert await asyncio.to_thread(ready), "the request never reached the expected point"
        request.cancel()
        with pytest.raises(asyncio.CancelledError):
            await request


def test_c22_client_gone_while_prefill_pending_cancels_prefill_and_never_decodes(stack: Stack) -> None:
    """C22: the prefill worker sees its connection close; decode is never dispatched."""
    stack.prefill.script({"hang": True})
    asyncio.run(start_then_abandon(stack, chat_body(), lambda: stack.prefill.wait("pending")))
    assert stack.prefill.wait("disconnected"), "the prefill request must be cancelled"
    assert stack.decode.requests() == [], "the decode leg must not run"
    # The server logs after it cancelled the prefill call: the worker may see the close first.
    assert eventually(lambda: "cancelled" in stack.server_log()), "the cancellation is logged"


def test_c23_client_gone_while_handoff_read_is_parked_never_decodes(stack: Stack) -> None:
    """C23: prefill answered its head and part of the body; the client leaves; decode never runs."""
    stack.prefill.script({"stall_after_headers": True})
    asyncio.run(start_then_abandon(stack, chat_body(), lambda: stack.prefill.wait("pending")))
    assert stack.prefill.wait("disconnected")
    assert stack.decode.requests() == [], "the decode leg must not run"


def test_c25_client_dropping_a_decode_stream_ends_the_decode_request(stack: Stack) -> None:
    """C25: a client that leaves mid-stream makes Envoy end the decode upstream request."""
    stack.decode.script({"token_interval": 0.05})
    body = chat_body(stream=True, max_tokens=400)
    with stack.client() as client, client.stream("POST", CHAT, content=json.dumps(body),
                                                  headers=stack.pd_headers()) as response:
        lines = response.iter_lines()
        first = [next(lines) for _ in range(3)]
    assert first[0].startswith("data: ")
    assert stack.decode.wait("disconnected"), "decode must see the stream end"


# --- C27: concurrency ------------------------------------------------------------------------------


def test_c27_concurrent_requests_sharing_a_request_id_never_cross_handoffs(stack: Stack) -> None:
    """C27: 64 concurrent P/D requests, one x-request-id, distinct prompts: each decode gets its own handoff."""
    prompts = [f"prompt number {i} about caches" for i in range(64)]

    async def run() -> list[httpx.Response]:
        limits = httpx.Limits(max_connections=64)
        async with httpx.AsyncClient(base_url=stack.url, timeout=60, limits=limits) as client:
            return await asyncio.gather(*(client.post(COMPLETIONS, json={"prompt": p, "max_tokens": 4},
                                                      headers=stack.pd_headers(**{"x-request-id": "shared-id"}))
                                          for p in prompts))

    responses = asyncio.run(run())
    assert [r.status_code for r in responses] == [200] * 64
    for prompt, response in zip(prompts, responses, strict=True):
        assert response.json()["choices"][0]["text"] == "".join(text.generate(prompt, 4))
    issued = {r["json"]["prompt"]: r["notes"]["remote_request_id"] for r in stack.prefill.requests()}
    decoded = stack.decode.requests()
    assert len(decoded) == 64
    for record in decoded:
        assert record["json"]["kv_transfer_params"]["remote_request_id"] == issued[record["json"]["prompt"]]
        assert record["notes"]["load"] == "ok"


# --- C28-C29: addressing and headers --------------------------------------------------------------


@pytest.fixture(scope="module")
def ipv6_stack() -> Iterator[Stack]:
    workers = (WorkerSpec("prefill", "prefill", args=("--listen", "[::1]:0", "--side-channel", "[::1]:0")),
               WorkerSpec("decode", "decode"))
    with running_stack(workers=workers) as stack:
        yield stack


def test_c28_ipv6_prefill_authority_path_and_query_are_used(ipv6_stack: Stack) -> None:
    """C28: [::1]:port works, and the prefill leg uses the client's path and query string."""
    ipv6_stack.reset()
    assert ipv6_stack.prefill.address.startswith("[::1]:")
    assert post(ipv6_stack, CHAT + "?api-version=2026-01&x=%2F", chat_body(max_tokens=2)).status_code == 200
    prefill = only(ipv6_stack.prefill.requests())
    assert prefill["target"] == CHAT + "?api-version=2026-01&x=%2F"
    assert prefill["peer"].startswith("::1")
    assert dict(prefill["headers"])["host"] == ipv6_stack.prefill.address
    assert only(ipv6_stack.decode.requests())["notes"]["load"] == "ok"


def test_c29_hop_by_hop_headers_are_stripped_and_semantic_headers_kept(stack: Stack) -> None:
    """C29: the prefill leg keeps authorization, tracing and routing headers, drops hop-by-hop ones;
    neither engine sees x-prefiller-host-port. The data-parallel rank is the decode engine's: it
    reaches decode only (the prefill worker's rank is its port)."""
    headers = {"authorization": "Bearer sk-test", "traceparent": "00-0af7651916cd43dd8448eb211c80319c-"
               "b7ad6b7169203331-01", "x-data-parallel-rank": "0", "proxy-authorization": "Basic abc",
               "te": "trailers", "accept-encoding": "gzip", "x-custom": "kept"}
    assert post(stack, CHAT, chat_body(max_tokens=2), **headers).status_code == 200
    prefill = dict(only(stack.prefill.requests())["headers"])
    decode = dict(only(stack.decode.requests())["headers"])
    for kept in ("authorization", "traceparent", "x-custom", "x-request-id"):
        assert prefill[kept] == decode[kept], kept
    for dropped in ("proxy-authorization", "te", "x-prefiller-host-port", "x-data-parallel-rank"):
        assert dropped not in prefill, dropped
    assert decode["x-data-parallel-rank"] == "0"
    assert prefill["accept-encoding"] == "identity"
    assert "x-prefiller-host-port" not in decode


# --- C30: startup and the kill switch ---------------------------------------------------------------


@pytest.fixture(scope="module")
def adapter_none() -> Iterator[Stack]:
    with running_stack({"PD_EXTPROC_ADAPTER": "none"}) as stack:
        yield stack


def test_adapter_none_answers_501_and_keeps_passthrough(adapter_none: Stack) -> None:
    """C30: adapter none is a kill switch: P/D requests get 501, the passthrough still serves."""
    adapter_none.reset()
    assert_error(post(adapter_none, CHAT, chat_body()), 501, "pd_adapter_unavailable")
    assert adapter_none.prefill.requests() == [] and adapter_none.decode.requests() == []
    with adapter_none.client() as client:
        assert client.post(CHAT, json=chat_body()).status_code == 200


# --- shutdown and a missing server ------------------------------------------------------------------


@pytest.fixture
def unix_stack() -> Iterator[Stack]:
    with running_stack({"PD_EXTPROC_DRAIN_TIMEOUT": "2s"}, grpc_unix=True) as stack:
        yield stack


@pytest.fixture
def long_drain_stack() -> Iterator[Stack]:
    """A drain that ends when the held request does: its timeout only bounds a test that went wrong."""
    with running_stack({"PD_EXTPROC_DRAIN_TIMEOUT": "120s"}, grpc_unix=True) as stack:
        yield stack


def test_server_down_fails_closed_with_json_503_and_recovers(unix_stack: Stack) -> None:
    """Our server gone: P/D requests get a JSON 503 (never a decode without a handoff), passthrough
    keeps serving, and P/D recovers by itself once the server is back."""
    assert unix_stack.server is not None
    unix_stack.server.stop(sig=signal.SIGKILL)
    assert_error(post(unix_stack, CHAT, chat_body()), 503, "pd_extproc_unavailable")
    assert unix_stack.decode.requests() == [], "no decode without a handoff"
    with unix_stack.client() as client:
        assert client.post(COMPLETIONS, json={"prompt": "x"}).status_code == 200
    unix_stack.start_server()
    assert eventually(lambda: post(unix_stack, CHAT, chat_body(max_tokens=2)).status_code == 200)


def test_drain_finishes_in_flight_requests_and_refuses_new_ones(long_drain_stack: Stack) -> None:
    """SIGTERM: the in-flight request (held at prefill until the late one is refused) completes, a new
    P/D request is refused with a JSON 503, the server exits cleanly."""
    unix_stack = long_drain_stack
    assert unix_stack.server is not None and unix_stack.server.process is not None
    unix_stack.prefill.script({"hold": True})

    async def run() -> tuple[httpx.Response, httpx.Response]:
        async with httpx.AsyncClient(base_url=unix_stack.url, timeout=30) as client:
            inflight = asyncio.ensure_future(client.post(CHAT, json=chat_body(max_tokens=2),
                                                         headers=unix_stack.pd_headers()))
            assert await asyncio.to_thread(unix_stack.prefill.wait, "pending")
            assert unix_stack.server is not None and unix_stack.server.process is not None
            unix_stack.server.process.send_signal(signal.SIGTERM)
            assert await asyncio.to_thread(_server_logged, unix_stack, '"draining"')
            late = await client.post(CHAT, json=chat_body(), headers=unix_stack.pd_headers())
            assert await asyncio.to_thread(unix_stack.prefill.release) == 1
            return await inflight, late

    inflight, late = asyncio.run(run())
    assert inflight.status_code == 200
    assert late.status_code == 503
    assert late.json()["error"]["code"] in ("pd_extproc_unavailable", "pd_shutting_down")
    assert unix_stack.server.process.wait(timeout=60) == 0


def test_drain_cancels_what_outlives_the_grace_period(unix_stack: Stack) -> None:
    """SIGTERM with a request still pending after the 2 s grace: it is cancelled (prefill sees the
    connection close), the client gets a JSON error, decode never runs."""
    assert unix_stack.server is not None and unix_stack.server.process is not None
    unix_stack.prefill.script({"hang": True})

    async def run() -> httpx.Response:
        async with httpx.AsyncClient(base_url=unix_stack.url, timeout=30) as client:
            inflight = asyncio.ensure_future(client.post(CHAT, json=chat_body(), headers=unix_stack.pd_headers()))
            assert await asyncio.to_thread(unix_stack.prefill.wait, "pending")
            assert unix_stack.server is not None and unix_stack.server.process is not None
            unix_stack.server.process.send_signal(signal.SIGTERM)
            return await inflight

    response = asyncio.run(run())
    assert response.status_code in (502, 503, 504)
    assert response.headers["content-type"] == "application/json"
    assert unix_stack.prefill.wait("disconnected")
    assert unix_stack.decode.requests() == []


def _server_logged(stack: Stack, needle: str) -> bool:
    return eventually(lambda: needle in stack.server_log())


def test_a_large_body_does_not_take_the_server_out_of_rotation(stack: Stack) -> None:
    """Regression: scanning a 20 MiB body once stalled the event loop for seconds, Envoy's health check
    ejected the only ext_proc server, and concurrent small P/D requests got 503s. Small requests sent
    by 8 clients while a large one is processed must all succeed."""
    body, _ = image_request(20 << 20)

    async def run() -> tuple[httpx.Response, list[int]]:
        limits = httpx.Limits(max_connections=16)
        async with httpx.AsyncClient(base_url=stack.url, timeout=60, limits=limits) as client:
            large = asyncio.ensure_future(client.post(CHAT, content=json.dumps(body), headers=stack.pd_headers()))
            statuses: list[int] = []

            async def small_requests() -> None:
                while not large.done() or len(statuses) < 40:
                    small = await client.post(CHAT, json=chat_body(max_tokens=2), headers=stack.pd_headers())
                    statuses.append(small.status_code)

            await asyncio.gather(*(small_requests() for _ in range(8)))
            return await large, statuses

    large, statuses = asyncio.run(run())
    assert large.status_code == 200
    assert statuses == [200] * len(statuses), f"{statuses.count(503)} of {len(statuses)} small requests refused"
