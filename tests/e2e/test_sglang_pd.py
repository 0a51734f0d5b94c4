"""SGLang PD through a real Envoy, our server and emulated SGLang prefill/decode workers.

Mirrors the reference native-serving test: a non-empty multi-token completion served by distinct
prefill and decode workers (each reports its worker id; both roles must have taken part), streaming
and non-streaming; then SGLang's failure cases: prefill down, bad metadata, a prefill that fails
after decode started (decode is aborted by our rid), a prefill that is late, a client that goes away,
and discovery against workers that require an API key.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from pd_extproc_lab.emulator import text
from tests.harness import Stack, Worker, WorkerSpec, engine_workers, running_stack
from tests.helpers import (
    CHAT,
    COMPLETIONS,
    assert_distinct_workers,
    assert_error,
    assert_event_stream,
    assert_served_by_decode,
    both_endpoints,
    chat_body,
    completion_body,
    eventually,
    only,
    post,
    scrape,
    sse_text,
    stream,
)

pytestmark = pytest.mark.dataplane

# SGLang's bootstrap and waiting timeouts (300 s in the engine): long enough that a decode request that
# was not aborted is still waiting when a test looks, short enough to bound a failing test.
KV_TIMEOUT = ("--kv-timeout", "60s")
BOOTSTRAP = ("bootstrap_host", "bootstrap_port", "bootstrap_room")


def sglang(name: str, role: str) -> WorkerSpec:
    return WorkerSpec(name, role, engine="sglang", args=KV_TIMEOUT)


SGLANG_WORKERS = engine_workers("sglang", KV_TIMEOUT)


def configured_port(workers: dict[str, Worker]) -> dict[str, str]:
    return {"PD_EXTPROC_SGLANG_BOOTSTRAP_PORT": str(workers["prefill"].side_channel_port)}


@pytest.fixture(scope="module")
def sglang_stack() -> Iterator[Stack]:
    with running_stack({"PD_EXTPROC_ADAPTER": "sglang"}, SGLANG_WORKERS,
                       env_from_workers=configured_port) as stack:
        yield stack


@pytest.fixture
def sg(sglang_stack: Stack) -> Stack:
    return sglang_stack.reset()


@pytest.fixture(scope="module")
def discovering_stack() -> Iterator[Stack]:
    workers = (sglang("prefill", "prefill"), sglang("prefill_bad", "prefill"), sglang("decode", "decode"))
    with running_stack({"PD_EXTPROC_ADAPTER": "sglang", "PD_EXTPROC_SGLANG_BOOTSTRAP_PORT": "discover"},
                       workers) as stack:
        yield stack


@pytest.fixture
def disc(discovering_stack: Stack) -> Stack:
    return discovering_stack.reset()




def background_failures(stack: Stack, reason: str) -> float:
    key = f'pd_extproc_background_prefill_failures_total{{adapter="sglang",reason="{reason}"}}'
    return scrape(stack).get(key, 0.0)



def assert_both_roles_took_part(stack: Stack) -> tuple[dict[str, Any], dict[str, Any]]:
    """The prefill and decode workers each served one leg of the same room, and they are distinct."""
    assert stack.prefill.wait("answered"), "the prefill request must finish once decode claimed the room"
    prefill, decode = only(stack.prefill.requests()), only(stack.decode.requests())
    room = decode["json"]["bootstrap_room"]
    assert prefill["json"]["bootstrap_room"] == room and prefill["notes"]["transfer"] == "ok"
    assert prefill["notes"]["claimed_by"] == "decode" and decode["notes"]["prefill_worker"] == "prefill"
    assert_distinct_workers(stack, "sglang")
    return prefill, decode


# --- the reference matrix: a multi-token completion from distinct workers -------------------------


@both_endpoints(max_tokens=6)
def test_non_streaming_completion_is_served_by_distinct_prefill_and_decode_workers(
        sg: Stack, path: str, body: dict[str, Any]) -> None:
    response = post(sg, path, body)
    assert_served_by_decode(response)
    prefill, decode = assert_both_roles_took_part(sg)
    prompt = text.chat_prompt(body["messages"]) if path == CHAT else text.completion_prompt(body["prompt"])
    choice = response.json()["choices"][0]
    content = choice["message"]["content"] if path == CHAT else choice["text"]
    assert content == "".join(text.generate(prompt, 6)) and len(text.generate(prompt, 6)) > 1
    assert response.json()["usage"]["completion_tokens"] == 6
    fields = {"bootstrap_host": "127.0.0.1", "bootstrap_port": sg.prefill.side_channel_port,
              "bootstrap_room": decode["json"]["bootstrap_room"], "rid": decode["json"]["rid"]}
    assert decode["json"] == {**body, **fields}, "decode gets the client's request plus the P/D fields"
    assert prefill["json"] == {**body, **fields, "stream": False}
    assert 1 <= fields["bootstrap_room"] < 2**63 and isinstance(fields["bootstrap_room"], int)
    assert decode["notes"]["rid"] == prefill["notes"]["rid"] == fields["rid"], "one rid of ours on both legs"


@pytest.mark.parametrize("path,body", [(CHAT, chat_body(max_tokens=5, stream=True)),
                                       (COMPLETIONS, completion_body(max_tokens=5, stream=True,
                                                                     stream_options={"include_usage": True}))],
                         ids=["chat", "completions"])
def test_streaming_completion_is_served_by_distinct_prefill_and_decode_workers(
        sg: Stack, path: str, body: dict[str, Any]) -> None:
    response, raw = stream(sg, path, body)
    assert_event_stream(response)
    content, chunks = sse_text(raw.decode(), path == CHAT)
    prompt = text.chat_prompt(body["messages"]) if path == CHAT else text.completion_prompt(body["prompt"])
    assert content == "".join(text.generate(prompt, 5))
    prefill, decode = assert_both_roles_took_part(sg)
    assert decode["json"]["stream"] is True and prefill["json"]["stream"] is False
    assert "stream_options" not in prefill["json"], "the prefill leg is one JSON answer"
    if "stream_options" in body:
        assert chunks[-1]["usage"]["completion_tokens"] == 5


def test_each_request_gets_its_own_room(sg: Stack) -> None:
    for _ in range(3):
        assert post(sg, CHAT, chat_body(max_tokens=2)).status_code == 200
    assert sg.prefill.wait("answered", count=3)
    rooms = {r["json"]["bootstrap_room"] for r in sg.decode.requests()}
    assert len(rooms) == 3 and rooms == {r["json"]["bootstrap_room"] for r in sg.prefill.requests()}


def test_decode_waits_for_a_prefill_that_arrives_late(sg: Stack) -> None:
    """The engines rendezvous on the room: decode's claim waits until prefill registers it."""
    sg.prefill.script({"delay_register": 0.5})
    response = post(sg, CHAT, chat_body(max_tokens=3))
    assert response.status_code == 200, response.text
    assert_both_roles_took_part(sg)


# --- failures ----------------------------------------------------------------------------------------


def test_prefill_down_is_our_502_and_counts_the_background_failure(sg: Stack) -> None:
    """Nothing listens at the prefill host: decode cannot reach its bootstrap server either; the client
    gets the prefill leg's documented error, not decode's."""
    before = background_failures(sg, "prefill_upstream_unavailable")
    response = post(sg, CHAT, chat_body(max_tokens=3), **{"x-prefiller-host-port": "127.0.0.2:9"})
    assert_error(response, 502, "prefill_upstream_unavailable")
    assert only(sg.decode.requests())["json"]["bootstrap_host"] == "127.0.0.2"
    assert sg.prefill.requests() == []
    assert eventually(lambda: background_failures(sg, "prefill_upstream_unavailable") == before + 1)


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_a_failed_prefill_aborts_the_waiting_decode_and_the_client_gets_our_error(sg: Stack, stream: bool) -> None:
    """The prefill worker answers 503 while decode waits for the room: we abort decode by our rid
    (/abort_request) instead of letting it wait for SGLang's waiting timeout, and the client gets our
    documented error with the prefill's status. This stack's workers wait 60 s for KV: without the
    abort, decode would still be waiting."""
    before = background_failures(sg, "prefill_upstream_error")
    sg.prefill.script({"status": 503})
    response = post(sg, COMPLETIONS, completion_body(max_tokens=3, stream=stream))
    assert_error(response, 503, "prefill_upstream_error")
    assert only(sg.prefill.requests())["status"] == 503
    decode = only(sg.decode.requests())
    assert decode["notes"].get("aborted") is True, "decode was aborted, not timed out"
    assert decode["status"] == (200 if stream else 500), "SGLang's own answer to the abort (dropped by us)"
    assert eventually(lambda: background_failures(sg, "prefill_upstream_error") == before + 1)
    assert eventually(lambda: '"outcome":"prefill_upstream_error"' in sg.server_log()
                      and '"decode_aborted":true' in sg.server_log()), "and logged"


def test_a_decode_error_ends_the_prefill_request_that_waits_for_its_claim(sg: Stack) -> None:
    """Decode answers 500 before it claims the room: its answer reaches the client, and the prefill
    request, which would wait for the claim until SGLang's bootstrap timeout (60 s on this stack, 300 s
    in the engine) holding an admission slot, is closed at once (found by the soak, bench/SOAK.md)."""
    before = scrape(sg).get('pd_extproc_requests_total{adapter="sglang",outcome="ok"}', 0.0)
    sg.decode.script({"status": 500})
    response = post(sg, CHAT, chat_body(max_tokens=3))
    assert response.status_code == 500 and "emulated failure" in response.text, "decode's own answer"
    # 30 s: well under the stack's 60 s bootstrap timeout, after which a prefill left waiting is closed too.
    assert sg.prefill.wait("disconnected", timeout=30), "the prefill request must be closed, not left waiting"
    assert eventually(lambda: scrape(sg).get("pd_extproc_admission_slots_in_use") == 0.0)
    assert eventually(lambda: scrape(sg).get(
        'pd_extproc_requests_total{adapter="sglang",outcome="ok"}', 0.0) == before + 1), "decode's answer: ok"


def test_an_abort_that_reaches_decode_before_its_request_is_sent_again(sg: Stack) -> None:
    """SGLang forgets an abort for a rid it does not have yet. The prefill fails at once and decode
    receives its request later; the abort is repeated until decode has answered."""
    sg.decode.script({"delay": 1.0})
    sg.prefill.script({"status": 500})
    response = post(sg, COMPLETIONS, completion_body(max_tokens=3))
    assert_error(response, 500, "prefill_upstream_error")
    assert only(sg.decode.requests())["notes"].get("aborted") is True


def test_a_streaming_client_whose_prefill_is_down_gets_our_json_error(sg: Stack) -> None:
    """SGLang would answer 200 with an error event inside the stream; the client gets our error instead,
    before any byte of the stream (decode's response headers carry nothing yet)."""
    response, _ = stream(sg, CHAT, chat_body(stream=True), **{"x-prefiller-host-port": "127.0.0.2:9"})
    assert_error(response, 502, "prefill_upstream_unavailable")


@pytest.mark.parametrize("field,value", [("bootstrap_host", "10.1.2.3"), ("bootstrap_room", 7),
                                         ("bootstrap_port", 8998), ("rid", "client-chosen")])
def test_client_supplied_bootstrap_fields_are_refused_before_any_leg(sg: Stack, field: str, value: Any) -> None:
    error = assert_error(post(sg, CHAT, chat_body(**{field: value})), 400, "reserved_request_field")
    assert error["param"] == field
    assert sg.prefill.requests() == [] and sg.decode.requests() == []


@pytest.fixture(scope="module")
def overriding_stack() -> Iterator[Stack]:
    """Workers started as with SGLANG_ENABLE_REQUEST_HEADER_OVERRIDES=1."""
    workers = engine_workers("sglang", (*KV_TIMEOUT, "--request-header-overrides"))
    with running_stack({"PD_EXTPROC_ADAPTER": "sglang"}, workers, env_from_workers=configured_port) as stack:
        yield stack


def test_client_override_headers_for_our_fields_reach_neither_leg(overriding_stack: Stack) -> None:
    """With header overrides on, a client's x-override-bootstrap-room (or rid, host, port, prefill DP
    rank) would replace ours on a leg: the engines would meet in the client's room. Both legs lose
    them, so the request runs in our room; a rank for decode stays on decode only."""
    stack = overriding_stack.reset()
    overrides = {"x-override-bootstrap-room": "7", "x-override-rid": "client-rid",
                 "x-override-bootstrap-host": "10.1.2.3", "x-override-bootstrap-port": "1",
                 "x-override-disagg-prefill-dp-rank": "3", "x-override-routed-dp-rank": "0"}
    assert_served_by_decode(post(stack, CHAT, chat_body(max_tokens=3), **overrides))
    prefill, decode = assert_both_roles_took_part(stack)
    assert decode["json"]["bootstrap_room"] != 7 and decode["json"]["rid"].startswith("pd-")
    for leg in (prefill, decode):
        assert not {name for name, _ in leg["headers"]} & (overrides.keys() - {"x-override-routed-dp-rank"})
    assert dict(decode["headers"])["x-override-routed-dp-rank"] == "0", "decode's own rank stays"
    assert "x-override-routed-dp-rank" not in dict(prefill["headers"])


def test_override_headers_never_reach_a_decode_engine_that_honours_them_on_the_passthrough_route(
        overriding_stack: Stack) -> None:
    """Issue 23: without x-prefiller-host-port, a client's x-override-bootstrap-* would point the decode
    engine (which honours them) at a host and room of the client's choosing. Envoy removes them; the
    decode worker gets the body byte for byte and none of those headers."""
    stack = overriding_stack.reset()
    overrides = {"x-override-bootstrap-host": "127.0.0.1", "x-override-bootstrap-port": "9",
                 "x-override-bootstrap-room": "7", "x-override-disagg-prefill-dp-rank": "1"}
    raw = json.dumps(chat_body(max_tokens=2)).encode()
    with stack.client() as client:
        client.post(CHAT, content=raw, headers={"content-type": "application/json", **overrides})
    decode = only(stack.decode.requests())
    assert not {name for name, _ in decode["headers"]} & overrides.keys()
    assert stack.decode.raw_body(decode["seq"]) == raw
    assert stack.prefill.requests() == []


def test_client_gone_while_decode_waits_cancels_the_prefill_request(sg: Stack) -> None:
    """Decode is waiting for the room, prefill has not registered it; the client leaves. Envoy resets
    our stream, the background prefill request is cancelled and the prefill worker sees it close."""
    sg.prefill.script({"delay_register": 30})

    async def abandon() -> None:
        async with httpx.AsyncClient(base_url=sg.url, timeout=60) as client:
            request = asyncio.ensure_future(client.post(CHAT, content=json.dumps(chat_body()),
                                                        headers=sg.pd_headers()))
            assert await asyncio.to_thread(lambda: sg.prefill.wait("pending") and sg.decode.wait("pending"))
            request.cancel()
            with pytest.raises(asyncio.CancelledError):
                await request

    asyncio.run(abandon())
    assert sg.prefill.wait("disconnected"), "the prefill request must be cancelled"
    assert sg.decode.wait("disconnected"), "Envoy ends the decode request too"


# --- discovery ---------------------------------------------------------------------------------------


def test_discovered_bootstrap_port_is_the_prefill_workers_own(disc: Stack) -> None:
    response = post(disc, CHAT, chat_body(max_tokens=4))
    assert response.status_code == 200, response.text
    _, decode = assert_both_roles_took_part(disc)
    assert decode["json"]["bootstrap_port"] == disc.prefill.side_channel_port
    assert [r["target"] for r in disc.prefill.requests()] == [CHAT], "/server_info is not a recorded request"


def test_discovery_from_a_prefill_worker_that_is_down_stops_before_either_leg(disc: Stack) -> None:
    response = post(disc, CHAT, chat_body(), **{"x-prefiller-host-port": "127.0.0.2:9"})
    assert_error(response, 502, "prefill_upstream_unavailable")
    assert disc.decode.requests() == [] and disc.prefill.requests() == []


def test_bad_server_info_stops_before_either_leg(disc: Stack) -> None:
    """A prefill worker that advertises its bootstrap port as a string (the processor caches the
    document per endpoint, so this worker is used by this test only)."""
    bad = disc.workers["prefill_bad"]
    assert bad.call("POST", "/_emulator/server_info", {"disaggregation_bootstrap_port": "8998"})[0] == 200
    response = post(disc, CHAT, chat_body(), **{"x-prefiller-host-port": bad.address})
    error = assert_error(response, 502, "invalid_prefill_handoff")
    assert error["param"] == "server_info.disaggregation_bootstrap_port is invalid"
    assert bad.requests() == [] and disc.decode.requests() == []


def test_a_decode_worker_named_as_prefill_target_is_refused(disc: Stack) -> None:
    response = post(disc, CHAT, chat_body(), **{"x-prefiller-host-port": disc.decode.address})
    error = assert_error(response, 502, "invalid_prefill_handoff")
    assert error["param"] == "server_info.disaggregation_mode is invalid"
    assert disc.decode.requests() == []


# --- workers started with --api-key (utils/auth.py) ---------------------------------------------------

WORKER_KEY = "sk-sglang-workers-0123456789"


@pytest.fixture(scope="module")
def keyed_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    key_file = tmp_path_factory.mktemp("sglang-key") / "api.key"
    key_file.write_text(WORKER_KEY + "\n")
    workers = engine_workers("sglang", (*KV_TIMEOUT, "--api-key-file", str(key_file)))
    with running_stack({"PD_EXTPROC_ADAPTER": "sglang", "PD_EXTPROC_SGLANG_BOOTSTRAP_PORT": "discover",
                        "PD_EXTPROC_SGLANG_API_KEY_FILE": str(key_file)}, workers) as stack:
        yield stack


@pytest.fixture
def keyed(keyed_stack: Stack) -> Stack:
    return keyed_stack.reset()


def test_discovery_authenticates_with_the_configured_key_and_the_legs_carry_the_clients(keyed: Stack) -> None:
    """/server_info needs the API key; our GET carries the configured one. The P/D legs carry the
    client's own authorization (a client without the workers' key is refused by the engines, as it
    would be without P/D); the key never reaches our logs or metrics."""
    client_auth = f"Bearer {WORKER_KEY}"
    response = post(keyed, CHAT, chat_body(max_tokens=3), authorization=client_auth)
    assert response.status_code == 200, response.text
    prefill, decode = assert_both_roles_took_part(keyed)
    assert dict(prefill["headers"])["authorization"] == client_auth
    assert dict(decode["headers"])["authorization"] == client_auth
    assert keyed.prefill.metric("emulator_unauthorized_total") == 0
    assert WORKER_KEY not in keyed.server_log()
    assert WORKER_KEY not in httpx.get(keyed.metrics_url + "/metrics", timeout=10).text


def test_a_client_without_the_workers_key_is_refused_by_the_engines(keyed: Stack) -> None:
    """Nothing of ours upgrades a client's credentials: the prefill engine's 401 is the answer."""
    response = post(keyed, CHAT, chat_body(max_tokens=3), authorization="Bearer not-the-key")
    assert_error(response, 401, "prefill_upstream_error")
    assert keyed.prefill.metric("emulator_unauthorized_total") >= 1


def test_discovery_without_the_key_is_the_prefill_workers_401(sg: Stack, tmp_path: Path) -> None:
    """Before this setting existed, every P/D request to a keyed SGLang failed here."""
    key_file = tmp_path / "api.key"
    key_file.write_text(WORKER_KEY + "\n")
    workers = engine_workers("sglang", (*KV_TIMEOUT, "--api-key-file", str(key_file)))
    with running_stack({"PD_EXTPROC_ADAPTER": "sglang", "PD_EXTPROC_SGLANG_BOOTSTRAP_PORT": "discover"},
                       workers) as stack:
        response = post(stack, CHAT, chat_body(max_tokens=3), authorization=f"Bearer {WORKER_KEY}")
        assert_error(response, 401, "prefill_upstream_error")
        assert stack.decode.requests() == [] and stack.prefill.requests() == [], "discovery comes first"


# --- SGLang's native /generate ------------------------------------------------------------------------

NATIVE = "/generate"


@pytest.mark.parametrize("streamed", [False, True], ids=["json", "sse"])
def test_native_generate_is_served_by_distinct_prefill_and_decode_workers(sg: Stack, streamed: bool) -> None:
    body = {"text": "The KV cache moves between workers", "sampling_params": {"max_new_tokens": 6}, "stream": streamed}
    expected = "".join(text.generate(body["text"], 6))
    if streamed:
        response, raw = stream(sg, NATIVE, body)
        assert_event_stream(response)
        frames = [frame.removeprefix("data: ") for frame in raw.decode().split("\n\n") if frame]
        assert frames[-1] == "[DONE]"
        assert json.loads(frames[-2])["text"] == expected
    else:
        response = post(sg, NATIVE, body)
        assert_served_by_decode(response)
        assert response.json()["text"] == expected
        assert response.json()["meta_info"]["finish_reason"] == {"type": "length", "length": 6}
    prefill, decode = assert_both_roles_took_part(sg)
    assert prefill["target"] == decode["target"] == NATIVE, "both legs on SGLang's own API"
    fields = {"bootstrap_host": "127.0.0.1", "bootstrap_port": sg.prefill.side_channel_port,
              "bootstrap_room": decode["json"]["bootstrap_room"], "rid": decode["json"]["rid"]}
    assert decode["json"] == {**body, **fields}
    assert prefill["json"] == {**body, **fields, "stream": False}


def test_native_generate_batch_is_refused_before_any_leg(sg: Stack) -> None:
    error = assert_error(post(sg, NATIVE, {"text": ["one", "two"]}), 400, "unsupported_pd_variant")
    assert error["param"] == "text"
    assert sg.prefill.requests() == [] and sg.decode.requests() == []
