"""Gateway mode with PD_EXTPROC_PREFILL_FALLBACK=aggregated: when the prefill worker fails, the client's
request goes, without a handoff, to the decode endpoint the picker chose (docs/gateway.md)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.gateway.stack import DECODES, GatewayStack, gateway_stack
from tests.gateway.test_gateway_contract import assert_error, post, served
from tests.helpers import CHAT, chat_body, closed_port, only

pytestmark = pytest.mark.dataplane


@pytest.fixture(scope="module")
def fallback_running() -> Iterator[GatewayStack]:
    with gateway_stack({"PD_EXTPROC_PREFILL_FALLBACK": "aggregated"}, replicas=1) as stack:
        yield stack


@pytest.fixture
def fallback(fallback_running: GatewayStack) -> GatewayStack:
    return fallback_running.reset()


@pytest.mark.parametrize("decode", ["decode-a", "decode-c"])
def test_a_dead_prefill_falls_back_to_the_picked_decode_marked(fallback: GatewayStack, decode: str) -> None:
    fallback.pick(decode, prefill=f"127.0.0.1:{closed_port()}")
    body = chat_body(max_tokens=3)
    response = post(fallback, CHAT, body)
    assert response.status_code == 200, response.text
    assert response.headers["x-pd-fallback"] == "aggregated; reason=prefill_upstream_unavailable"
    assert response.headers["x-emulator-worker"] == decode
    assert served(fallback) == {name: int(name == decode) for name in DECODES}, "only the picked decode"
    assert only(fallback.decode(decode).requests())["json"] == body, "the client's request, no handoff"
    assert fallback.metric(
        'pd_extproc_prefill_fallbacks_total{adapter="vllm_nixl",reason="prefill_upstream_unavailable"}') >= 1


def test_a_request_error_never_falls_back(fallback: GatewayStack) -> None:
    fallback.pick("decode-b", prefill=f"127.0.0.1:{closed_port()}")
    assert_error(post(fallback, CHAT, chat_body(n=2)), 400, "unsupported_pd_variant")
    assert served(fallback) == dict.fromkeys(DECODES, 0)


def test_a_pd_request_with_a_live_prefill_is_not_a_fallback(fallback: GatewayStack) -> None:
    fallback.pick("decode-b")
    response = post(fallback, CHAT, chat_body(max_tokens=2))
    assert response.status_code == 200 and "x-pd-fallback" not in response.headers
    assert only(fallback.decode("decode-b").requests())["json"]["kv_transfer_params"]
