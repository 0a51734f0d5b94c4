"""One worst-shaped body at the size limit, through a real Envoy: while it is inspected, Envoy's health
check of our server keeps passing and small P/D requests keep succeeding."""

from __future__ import annotations

import threading

import httpx
import pytest

from bench.loop_stall import worst_shape_chat
from tests.harness import Stack
from tests.helpers import CHAT, assert_error, chat_body, post

pytestmark = pytest.mark.dataplane


def ext_proc_health(stack: Stack) -> frozenset[str]:
    """The health_flags of every endpoint of Envoy's ext_proc cluster."""
    assert stack.envoy is not None
    flags = set()
    for line in stack.envoy.admin_get("/clusters").decode().splitlines():
        parts = line.split("::")
        if len(parts) == 4 and parts[0] == "pd_extproc" and parts[2] == "health_flags":
            flags.add(parts[3])
    return frozenset(flags)


def test_a_32_mib_worst_shape_body_leaves_the_health_check_and_small_requests_alone(stack: Stack) -> None:
    """1.2 million tiny content parts: inspected on the event loop, this held it for seconds, Envoy marked
    the server unhealthy after two missed checks and every P/D request got a 503. The body is refused
    after the whole inspection (a reserved field), so no leg runs for it."""
    big = worst_shape_chat((32 << 20) - (64 << 10), b'"kv_transfer_params":{"remote_host":"10.0.0.1"},')
    big_answer: list[httpx.Response] = []
    sender = threading.Thread(target=lambda: big_answer.append(post(stack, CHAT, big)))
    assert ext_proc_health(stack) == {"healthy"}
    sender.start()
    during = []
    while sender.is_alive():
        during.append((post(stack, CHAT, chat_body(max_tokens=2)).status_code, ext_proc_health(stack)))
    sender.join()
    assert_error(big_answer[0], 400, "reserved_request_field")
    assert during and set(during) == {(200, frozenset({"healthy"}))}, during
    assert [record["body_len"] < 1024 for record in stack.prefill.requests()] == [True] * len(during)
