"""Issue 23, one API for the client on every route: the guard's off switch, unsupported P/D variants
served whole when the operator asks, and the prefill engine's own error about the request reaching
the client. The guard itself, per engine: test_contract.py."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest

from tests.harness import Stack, running_stack
from tests.helpers import (
    CHAT,
    COMPLETIONS,
    assert_error,
    assert_no_leg_ran,
    chat_body,
    completion_body,
    eventually,
    only,
    post,
    scrape,
)

pytestmark = pytest.mark.dataplane

SSRF = completion_body(max_tokens=2, kv_transfer_params={"do_remote_decode": True})


@pytest.fixture(scope="module")
def trusting_stack() -> Iterator[Stack]:
    with running_stack({"PD_EXTPROC_TRUST_CLIENT_STEERING": "true"}) as stack:
        yield stack


def test_with_trust_client_steering_a_steering_body_reaches_decode(trusting_stack: Stack) -> None:
    """The documented risk of the setting, observed: decode computes the prompt and leases its KV for
    a client (the emulator grants a lease on do_remote_decode, as vLLM's producer does)."""
    stack = trusting_stack.reset()
    raw = json.dumps(SSRF).encode()
    with stack.client() as client:
        response = client.post(COMPLETIONS, content=raw, headers={"content-type": "application/json"})
    assert response.status_code == 200
    assert stack.decode.raw_body(only(stack.decode.requests())["seq"]) == raw
    assert "kv_transfer_params" in response.json(), "decode acted as a KV producer for the client"


# --- unsupported variants --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def variants_stack() -> Iterator[Stack]:
    with running_stack({"PD_EXTPROC_UNSUPPORTED_VARIANTS": "aggregated"}) as stack:
        yield stack


def _fallbacks(stack: Stack, reason: str) -> float:
    return scrape(stack).get(f'pd_extproc_prefill_fallbacks_total{{adapter="{stack.settings.adapter}",'
                             f'reason="{reason}"}}', 0.0)


@pytest.mark.parametrize("path,body", [(CHAT, chat_body(n=2, max_tokens=2)),
                                       (COMPLETIONS, completion_body(prompt=["one", "two"], max_tokens=2))],
                         ids=["n", "prompt-batch"])
def test_an_unsupported_variant_is_served_whole_exactly_as_sent_when_asked(
        variants_stack: Stack, path: str, body: dict[str, Any]) -> None:
    stack = variants_stack.reset()
    before = _fallbacks(stack, "unsupported_pd_variant")
    raw = json.dumps(body).encode()
    response = post(stack, path, raw)
    assert response.status_code == 200, response.text
    assert response.headers["x-pd-fallback"] == "aggregated; reason=unsupported_pd_variant"
    assert stack.prefill.requests() == [], "no prefill leg"
    assert stack.decode.raw_body(only(stack.decode.requests())["seq"]) == raw, "never a silent rewrite"
    assert _fallbacks(stack, "unsupported_pd_variant") == before + 1
    assert eventually(lambda: '"fallback_reason":"unsupported_pd_variant"' in stack.server_log())


def test_an_unsupported_variant_with_a_steering_field_is_still_refused(variants_stack: Stack) -> None:
    stack = variants_stack.reset()
    error = assert_error(post(stack, CHAT, chat_body(n=2, kv_transfer_params={"do_remote_decode": True})),
                         400, "reserved_request_field")
    assert error["param"] == "kv_transfer_params"
    assert_no_leg_ran(stack)


@pytest.fixture(scope="module")
def default_stack() -> Iterator[Stack]:
    with running_stack() as stack:
        yield stack


def test_an_unsupported_variant_is_refused_by_default(default_stack: Stack) -> None:
    stack = default_stack.reset()
    error = assert_error(post(stack, CHAT, chat_body(n=2)), 400, "unsupported_pd_variant")
    assert error["param"] == "n"
    assert "x-pd-fallback" not in post(stack, CHAT, chat_body(n=2)).headers
    assert_no_leg_ran(stack)


# --- the prefill engine's own error ----------------------------------------------------------------


def test_a_context_length_error_from_prefill_reaches_the_client_as_the_engine_said_it(default_stack: Stack) -> None:
    """The vLLM emulator refuses a prompt over max_model_len (4096) as vLLM does; the client gets that
    400 (message, type, param, code) as it would without P/D, decode never runs, our log has the reason."""
    stack = default_stack.reset()
    prompt = "word " * 5000
    response = post(stack, COMPLETIONS, completion_body(prompt=prompt, max_tokens=2))
    assert response.status_code == 400
    assert response.headers["content-type"] == "application/json"
    error = response.json()["error"]
    assert error["message"].startswith("This model's maximum context length is 4096 tokens. However, your prompt "
                                       "contains 5000 input tokens")
    assert (error["type"], error["param"], error["code"]) == ("BadRequestError", "input_tokens", 400)
    with stack.client() as client:  # the same request without P/D: the same answer
        direct = client.post(COMPLETIONS, json=completion_body(prompt=prompt, max_tokens=2))
    assert direct.status_code == 400 and direct.json() == response.json()
    assert len(stack.decode.requests()) == 1, "decode ran only for the request without P/D"
    assert eventually(lambda: "maximum context length is 4096" in stack.server_log()), "the log has the reason"


def test_a_prefill_4xx_that_is_not_an_engine_error_stays_generic(default_stack: Stack) -> None:
    stack = default_stack.reset()
    stack.prefill.script({"status": 401})
    error = assert_error(post(stack, CHAT, chat_body()), 401, "prefill_upstream_error")
    assert error["message"] == "The prefill worker rejected the request."
    assert stack.decode.requests() == []
