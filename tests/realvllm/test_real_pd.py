"""G01-G06 against real vLLM workers joined by NIXL: what only a real engine can prove.

The emulated tests (tests/e2e) prove our side of the contract. These prove that a real NixlConnector
accepts the handoff we relay: decode's own /metrics count one NIXL transfer per P/D request, with
no failed transfer and no expired lease, and greedy output through P/D equals the same request
served by one worker. Every prompt is used once per run, so no prefix-cache hit can stand in for a
transfer.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from tests.helpers import closed_port
from tests.realvllm import engine
from tests.realvllm.stage import RealPd, Reply, send
from tests.realvllm.wire import CHAT, COMPLETIONS, MAX_TOKENS, PATHS, SseStream, output_text, request_body

pytestmark = pytest.mark.realvllm

PATH_IDS = ["chat", "completions"]
STREAM_IDS = ["json", "sse"]


def completion_text(path: str, reply: Reply, stream: bool) -> str:
    """Check one successful completion's framing and length; return its text."""
    assert reply.status == 200, reply.body[:500]
    if not stream:
        assert reply.media_type == "application/json"
        response = reply.json()
        assert response["choices"][0]["finish_reason"] == "length"
        assert response["usage"]["completion_tokens"] == MAX_TOKENS
        return output_text(path, response)
    assert reply.media_type == "text/event-stream"
    events = SseStream.parse(reply.body)
    assert events.ends_with_done, "a stream ends with exactly one data: [DONE]"
    chunks = events.chunks()
    assert len({chunk["id"] for chunk in chunks}) == 1, "every chunk comes from one response"
    finishes = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]]
    assert finishes[-1] == "length" and set(finishes[:-1]) <= {None}
    usage = events.usage()
    assert usage is not None and usage["completion_tokens"] == MAX_TOKENS
    return events.text(path)


def streamed(body: dict[str, Any], stream: bool) -> dict[str, Any]:
    return {**body, "stream": True, "stream_options": {"include_usage": True}} if stream else body


# --- G01: decode alone -----------------------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True], ids=STREAM_IDS)
@pytest.mark.parametrize("path", PATHS, ids=PATH_IDS)
def test_g01_decode_worker_serves_requests_directly(real_pd: RealPd, path: str, stream: bool) -> None:
    """G01: the decode worker is a working OpenAI server on its own; without a handoff nothing is pulled."""
    body = streamed(request_body(path, real_pd.model, f"G01 baseline on {path}, stream={stream}"), stream)
    before = real_pd.counters()
    text = completion_text(path, send(real_pd.decode.http, path, body), stream)
    reference = real_pd.aggregated(real_pd.prefill, path, {**body, "stream": False, "stream_options": None})
    assert text == output_text(path, reference.json()), "both workers serve the same model"
    assert real_pd.counters().transfers == before.transfers, "no handoff, so no NIXL transfer"


# --- G02: the product path -------------------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True], ids=STREAM_IDS)
@pytest.mark.parametrize("path", PATHS, ids=PATH_IDS)
def test_g02_pd_through_envoy_runs_one_prefill_and_one_decode_with_a_transfer(
        real_pd: RealPd, path: str, stream: bool) -> None:
    """G02: P -> Envoy/ext_proc -> D: one request on each worker, and decode pulled the KV over NIXL."""
    body = streamed(request_body(path, real_pd.model, f"G02 the product path on {path}, stream={stream}"), stream)
    prefill_before, decode_before = engine.finished_requests(real_pd.prefill), engine.finished_requests(real_pd.decode)
    before = real_pd.counters()
    completion_text(path, real_pd.pd(path, body), stream)
    delta = real_pd.counters().since(before)
    assert delta.transfers == 1, f"decode must pull the prompt's KV exactly once, counted {delta.transfers}"
    assert delta.failed_on_decode == 0
    assert engine.finished_requests(real_pd.prefill) == prefill_before + 1, "one prefill-only request"
    assert engine.finished_requests(real_pd.decode) == decode_before + 1, "one decode request"


# --- G03: transfer evidence ------------------------------------------------------------------------


def test_g03_transfer_counter_grows_by_exactly_the_pd_requests_sent(real_pd: RealPd) -> None:
    """G03: N P/D requests through Envoy, every endpoint and mode: +N NIXL transfers on decode, no failed
    transfer, no expired lease on the producer."""
    before = real_pd.counters()
    sent = 0
    for path in PATHS:
        for stream in (False, True):
            for n in range(2):
                body = streamed(request_body(path, real_pd.model, f"G03 counted request {n} {path} {stream}"), stream)
                completion_text(path, real_pd.pd(path, body), stream)
                sent += 1
    delta = real_pd.counters().since(before)
    assert (delta.transfers, delta.failed_on_decode, delta.expired_leases) == (sent, 0, 0), delta


@pytest.mark.realvllm(phase="last")
def test_g03_whole_run_transfer_ledger(real_pd: RealPd) -> None:
    """G03, whole run: decode's transfer counter grew by exactly the handoffs the stage delivered (through
    Envoy or as direct legs), failures only where a test caused one on purpose, no lease expired."""
    delta = real_pd.counters().since(real_pd.baseline)
    ledger = real_pd.ledger
    assert ledger.through_envoy > 0, "run the whole stage: this check closes it"
    assert delta.transfers == ledger.handoffs, \
        f"{delta.transfers:g} transfers for {ledger.handoffs} handoffs ({ledger})"
    assert delta.failed_on_decode == ledger.deliberate_load_failures, delta
    assert delta.failed_on_prefill == 0, delta
    assert delta.expired_leases == 0, "a prefill's blocks were never pulled"
    assert delta.notifications_after_expiry == 0, delta


# --- G04: correctness ------------------------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True], ids=STREAM_IDS)
@pytest.mark.parametrize("path", PATHS, ids=PATH_IDS)
def test_g04_greedy_output_through_pd_equals_one_aggregated_worker(real_pd: RealPd, path: str, stream: bool) -> None:
    """G04: temperature 0, same request: P/D (KV computed on prefill, pulled by decode) gives the exact
    text the prefill worker gives serving it alone."""
    body = request_body(path, real_pd.model, f"G04 greedy equality {path} stream={stream}: the cache really moved")
    reference = output_text(path, real_pd.aggregated(real_pd.prefill, path, body).json())
    before = real_pd.counters()
    text = completion_text(path, real_pd.pd(path, streamed(body, stream)), stream)
    assert real_pd.counters().since(before).transfers == 1
    assert text == reference


# --- G05: concurrency ------------------------------------------------------------------------------

CONCURRENT_PROMPTS = (
    "Four requests at once",
    "The decode worker pulls those blocks over NIXL and generates",
    "Envoy buffers the request body and asks the external processor what to do with it, then",
    "Streaming responses arrive as server sent events, each one a line of JSON data, and greedy sampling",
)


def test_g05_four_concurrent_pd_requests_get_four_distinct_completions(real_pd: RealPd) -> None:
    """G05: 4 P/D requests in flight together, distinct prompts of distinct lengths: 4 distinct completions,
    each with its own prompt's token count, and 4 transfers."""
    bodies = [request_body(COMPLETIONS, real_pd.model, f"G05 {prompt}") for prompt in CONCURRENT_PROMPTS]
    prompt_tokens = [real_pd.aggregated(real_pd.prefill, COMPLETIONS, body).json()["usage"]["prompt_tokens"]
                     for body in bodies]
    assert len(set(prompt_tokens)) == len(bodies), "the prompts must differ in length for this check"
    before = real_pd.counters()
    with ThreadPoolExecutor(max_workers=len(bodies)) as pool:
        replies = list(pool.map(lambda body: real_pd.pd(COMPLETIONS, body), bodies))
    texts = [completion_text(COMPLETIONS, reply, stream=False) for reply in replies]
    assert len(set(texts)) == len(bodies), texts
    assert [reply.json()["usage"]["prompt_tokens"] for reply in replies] == prompt_tokens, \
        "each completion belongs to its own prompt"
    delta = real_pd.counters().since(before)
    assert (delta.transfers, delta.failed_on_decode) == (len(bodies), 0), delta


# --- G06: what never reaches a worker, or only decode ----------------------------------------------


def assert_our_error(reply: Reply, status: int, code: str) -> dict[str, Any]:
    assert reply.status == status, reply.body[:500]
    assert reply.media_type == "application/json"
    error: dict[str, Any] = reply.json()["error"]
    assert error["code"] == code
    return error


def test_g06_unreachable_prefill_is_our_502_and_decode_never_runs(real_pd: RealPd) -> None:
    """G06: x-prefiller-host-port names a port nobody listens on: 502 prefill_upstream_unavailable."""
    body = request_body(CHAT, real_pd.model, "G06 nobody is listening")
    decode_before = engine.finished_requests(real_pd.decode)
    before = real_pd.counters()
    reply = real_pd.through_envoy(CHAT, body, {"x-prefiller-host-port": f"127.0.0.1:{closed_port()}"})
    assert_our_error(reply, 502, "prefill_upstream_unavailable")
    assert engine.finished_requests(real_pd.decode) == decode_before, "decode must not run"
    assert real_pd.counters().transfers == before.transfers


def test_g06_no_header_passes_through_to_decode_alone(real_pd: RealPd) -> None:
    """G06: without the header Envoy sends the request straight to decode: 200, no prefill, no transfer."""
    body = request_body(COMPLETIONS, real_pd.model, "G06 passthrough, no prefill header")
    prefill_before, decode_before = engine.finished_requests(real_pd.prefill), engine.finished_requests(real_pd.decode)
    before = real_pd.counters()
    reply = real_pd.through_envoy(COMPLETIONS, body, {})
    completion_text(COMPLETIONS, reply, stream=False)
    assert engine.finished_requests(real_pd.prefill) == prefill_before, "prefill must not run"
    assert engine.finished_requests(real_pd.decode) == decode_before + 1
    assert real_pd.counters().transfers == before.transfers


def test_g06_n_2_is_refused_with_400_before_either_worker(real_pd: RealPd) -> None:
    """G06: n: 2 cannot be disaggregated (children share one handoff): our 400, no worker runs."""
    body = request_body(CHAT, real_pd.model, "G06 two choices please", n=2, temperature=1.0)
    prefill_before, decode_before = engine.finished_requests(real_pd.prefill), engine.finished_requests(real_pd.decode)
    reply = real_pd.through_envoy(CHAT, body, {"x-prefiller-host-port": real_pd.prefill.address})
    assert assert_our_error(reply, 400, "unsupported_pd_variant")["param"] == "n"
    assert engine.finished_requests(real_pd.prefill) == prefill_before
    assert engine.finished_requests(real_pd.decode) == decode_before


def test_g07_passthrough_refuses_a_client_kv_producer_request_before_decode(real_pd: RealPd) -> None:
    """G07 (issue 23): without the header, a body asking the decode worker to act as a KV producer
    (do_remote_decode: compute the prompt and lease its KV) is refused by Envoy; the real decode
    engine finishes no request."""
    body = request_body(COMPLETIONS, real_pd.model, "G07 lease me some KV",
                        kv_transfer_params={"do_remote_decode": True})
    decode_before = engine.finished_requests(real_pd.decode)
    reply = real_pd.through_envoy(COMPLETIONS, body, {})
    assert assert_our_error(reply, 400, "reserved_request_field")["param"] == "kv_transfer_params"
    assert engine.finished_requests(real_pd.decode) == decode_before, "decode must not run"


def test_g07_a_context_length_error_reaches_the_client_as_vllm_said_it(real_pd: RealPd) -> None:
    """G07 (issue 23): a prompt over --max-model-len (512): the prefill engine's own 400 reaches the
    client through P/D exactly as the decode engine answers the same request directly."""
    body = request_body(COMPLETIONS, real_pd.model, "word " * 2000)
    decode_before = engine.finished_requests(real_pd.decode)
    reply = real_pd.through_envoy(COMPLETIONS, body, {"x-prefiller-host-port": real_pd.prefill.address})
    direct = send(real_pd.decode.http, COMPLETIONS, body)
    assert (reply.status, reply.media_type) == (direct.status, direct.media_type) == (400, "application/json")
    assert reply.json() == direct.json()
    assert "maximum context length" in reply.json()["error"]["message"]
    assert engine.finished_requests(real_pd.decode) == decode_before, "neither request reached the decode engine"
