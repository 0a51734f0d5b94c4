"""PD_EXTPROC_PREFILL_FALLBACK=aggregated: when the prefill worker is unreachable, too slow or answers
5xx, the local decode worker serves the request whole (the client's own body), and the response says
so (x-pd-fallback: aggregated; reason=<the failure's code>), as do the log line and a metric. A
failure that is about the request (a 4xx from prefill, a bad target, a refused field) or about the
handoff never falls back. Off (the
default) keeps today's errors: tests/e2e/test_failures.py."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.harness import Stack, engine_workers, running_stack
from tests.helpers import (
    CHAT,
    COMPLETIONS,
    assert_error,
    chat_body,
    closed_port,
    completion_body,
    envoy_histogram,
    envoy_logged,
    envoy_stats_settled,
    eventually,
    only,
    post,
    scrape,
)

pytestmark = pytest.mark.dataplane

# Short enough that the hung prefill's case ends soon, long enough that a prefill worker answering at
# once never trips them on a loaded machine (a timeout there would serve the P/D cases whole).
FALLBACK = {"PD_EXTPROC_PREFILL_FALLBACK": "aggregated", "PD_EXTPROC_PREFILL_READ_TIMEOUT": "5s",
            "PD_EXTPROC_PREFILL_CONNECT_TIMEOUT": "1s",
            "PD_EXTPROC_PREFILL_DEADLINE": "6s"}


@pytest.fixture(scope="module")
def vllm_fallback() -> Iterator[Stack]:
    with running_stack(FALLBACK) as stack:
        yield stack


@pytest.fixture
def fb(vllm_fallback: Stack) -> Stack:
    return vllm_fallback.reset()


def fallbacks(stack: Stack, reason: str) -> float:
    return scrape(stack).get(f'pd_extproc_prefill_fallbacks_total{{adapter="{stack.settings.adapter}",'
                             f'reason="{reason}"}}', 0.0)


def assert_served_whole(stack: Stack, response: Any, raw: bytes, reason: str) -> None:
    assert response.status_code == 200, response.text
    assert response.headers["x-pd-fallback"] == f"aggregated; reason={reason}"
    assert response.headers["x-emulator-worker"] == "decode"
    decode = only(stack.decode.requests())
    assert stack.decode.raw_body(decode["seq"]) == raw, "decode gets the client's own body, nothing of ours"


@pytest.mark.parametrize("case,behaviour,reason", [
    ("unreachable", None, "prefill_upstream_unavailable"),
    ("5xx", {"status": 503}, "prefill_upstream_error"),
    ("timeout", {"hang": True}, "prefill_upstream_timeout"),
])
def test_a_prefill_failure_that_is_not_the_requests_is_served_whole_by_decode(
        fb: Stack, case: str, behaviour: dict[str, Any] | None, reason: str) -> None:
    before = fallbacks(fb, reason)
    raw = json.dumps(chat_body(max_tokens=4)).encode()
    headers = {"x-prefiller-host-port": f"127.0.0.1:{closed_port()}"} if behaviour is None else {}
    if behaviour is not None:
        fb.prefill.script(behaviour)
    response = post(fb, CHAT, raw, **headers)
    assert_served_whole(fb, response, raw, reason)
    assert "kv_transfer_params" not in only(fb.decode.requests())["json"]
    assert fb.decode.metric("emulator_recomputed_prompts_total") >= 1, "decode computed the prompt itself"
    assert fallbacks(fb, reason) == before + 1
    assert eventually(lambda: f'"fallback_reason":"{reason}"' in fb.server_log()), "and logged"


@pytest.mark.parametrize("case,headers,behaviour,body,status,code", [
    ("prefill-4xx", {}, {"status": 403}, chat_body(), 403, "prefill_upstream_error"),
    ("prefill-3xx", {}, {"status": 302}, chat_body(), 502, "prefill_upstream_error"),
    ("invalid-handoff", {}, {"kv_set": {"tp_size": 0}}, chat_body(), 502, "invalid_prefill_handoff"),
    ("forbidden-target", {"x-prefiller-host-port": "169.254.169.254:80"}, None, chat_body(), 403,
     "prefill_target_forbidden"),
    ("reserved-field", {}, None, chat_body(kv_transfer_params={"x": 1}), 400, "reserved_request_field"),
    ("n", {}, None, chat_body(n=3), 400, "unsupported_pd_variant"),
])
def test_a_failure_about_the_request_or_the_handoff_never_falls_back(
        fb: Stack, case: str, headers: dict[str, str], behaviour: dict[str, Any] | None, body: dict[str, Any],
        status: int, code: str) -> None:
    if behaviour is not None:
        fb.prefill.script(behaviour)
    response = post(fb, CHAT, body, **headers)
    assert_error(response, status, code)
    assert "x-pd-fallback" not in response.headers
    assert fb.decode.requests() == [], "decode must not run"


def test_a_request_that_succeeds_carries_no_fallback_mark(fb: Stack) -> None:
    response = post(fb, COMPLETIONS, completion_body(max_tokens=3))
    assert response.status_code == 200 and "x-pd-fallback" not in response.headers
    assert "kv_transfer_params" in only(fb.decode.requests())["json"]


def test_a_fallback_is_not_timed_as_pd(fb: Stack) -> None:
    """Envoy's P/D histograms hold P/D requests only: a fallback adds nothing, the P/D one after it
    adds one decode observation."""
    def decodes() -> float:
        return sum(count for count, _ in envoy_histogram(fb, "pd_decode_ms").values())

    envoy_stats_settled(fb)
    before = decodes()
    ids = ("5a1e0000-0000-4000-8000-0000000fa11a", "5a1e0000-0000-4000-8000-0000000fa11b")
    raw = json.dumps(chat_body(max_tokens=2)).encode()
    response = post(fb, CHAT, raw, **{"x-prefiller-host-port": f"127.0.0.1:{closed_port()}", "x-request-id": ids[0]})
    assert_served_whole(fb, response, raw, "prefill_upstream_unavailable")
    fb.reset()
    assert post(fb, CHAT, chat_body(max_tokens=2), **{"x-request-id": ids[1]}).headers["x-emulator-worker"] == "decode"
    envoy_logged(fb, *ids)
    envoy_stats_settled(fb)
    assert decodes() == before + 1


def test_tensorrt_llms_generation_worker_serves_a_fallback_whole(tmp_path: Path) -> None:
    key = tmp_path / "internal.key"
    key.write_text("fallback-key\n")
    env = {**FALLBACK, "PD_EXTPROC_ADAPTER": "trtllm", "PD_EXTPROC_TRTLLM_AUTH_KEY_FILE": str(key)}
    with running_stack(env, engine_workers("trtllm", ("--auth-key-file", str(key)))) as stack:
        stack.prefill.script({"status": 500})
        raw = json.dumps(completion_body(max_tokens=4)).encode()
        response = post(stack, COMPLETIONS, raw)
        assert_served_whole(stack, response, raw, "prefill_upstream_error")
        assert "disaggregated_params" not in only(stack.decode.requests())["json"]
