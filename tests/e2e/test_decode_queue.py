"""Decode-queue-aware admission: with PD_EXTPROC_DECODE_QUEUE_LIMIT, our server reads the local decode
worker's own waiting-queue gauges at an interval and refuses P/D requests while they are over the
limit, before any prefill (whose KV would otherwise wait on the producer past its lease). Each
engine's emulator reports the gauges its engine exports; a test sets their values."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from extproc.adapters import by_engine
from tests.harness import Stack, engine_workers, running_stack
from tests.helpers import CHAT, assert_error, assert_no_leg_ran, chat_body, eventually, post, scrape

pytestmark = pytest.mark.dataplane


@pytest.fixture(scope="module", params=["vllm", "sglang", "trtllm"])
def queue_stack(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    engine: str = request.param
    # The default interval, 1 s: each scrape is bounded by it and a reading ages out after three, so at
    # 100 ms a worker starved for a few tenths of a second on a loaded machine let the shed request in.
    env = {"PD_EXTPROC_ADAPTER": by_engine()[engine].name, "PD_EXTPROC_DECODE_QUEUE_LIMIT": "4",
           "PD_EXTPROC_DECODE_QUEUE_INTERVAL": "1s"}
    args: tuple[str, ...] = ()
    if engine == "sglang":
        env["PD_EXTPROC_SGLANG_BOOTSTRAP_PORT"] = "discover"
    if engine == "trtllm":
        key = Path(tmp_path_factory.mktemp("key")) / "internal.key"
        key.write_text("queue-test-key\n")
        env["PD_EXTPROC_TRTLLM_AUTH_KEY_FILE"] = str(key)
        args = ("--auth-key-file", str(key))
    with running_stack(env, engine_workers(engine, args)) as stack:
        yield stack


def set_waiting(stack: Stack, waiting: float) -> None:
    gauges = by_engine()[stack.decode.info()["engine"]].decode_queue
    assert gauges is not None
    # The first gauge carries the value; the rest (SGLang's prealloc queue) stay 0: they are summed.
    assert stack.decode.call("POST", "/_emulator/gauges", {gauges.names[0]: waiting})[0] == 200


def reading(stack: Stack) -> float:
    return scrape(stack)["pd_extproc_decode_queue_waiting"]


def test_a_deep_decode_queue_refuses_pd_requests_before_any_prefill(queue_stack: Stack) -> None:
    stack = queue_stack.reset()
    set_waiting(stack, 9)
    assert eventually(lambda: reading(stack) == 9), "our server reads the decode worker's gauge"
    assert_error(post(stack, CHAT, chat_body(max_tokens=3)), 503, "pd_overloaded")
    assert_no_leg_ran(stack)
    sheds = f'pd_extproc_decode_queue_sheds_total{{adapter="{stack.settings.adapter}"}}'
    assert scrape(stack)[sheds] >= 1
    set_waiting(stack, 4)  # at the limit is not over it
    assert eventually(lambda: reading(stack) == 4)
    assert post(stack, CHAT, chat_body(max_tokens=3)).status_code == 200
    assert len(stack.prefill.requests()) == 1
