"""What the end-to-end tests share: request bodies, posting through the stack, reading what the
legs received and what our server counted, and waiting for an observable condition."""

from __future__ import annotations

import functools
import json
import socket
import time
from collections.abc import Callable
from typing import Any

import httpx

from extproc.observability.outcomes import SERVED_OUTCOMES
from tests.harness import Stack

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
# What the operator's error-ratio queries and alerts must exclude: a served or a cancelled request.
NOT_ERROR_OUTCOMES = SERVED_OUTCOMES | {"cancelled"}


def chat_body(**extra: Any) -> dict[str, Any]:
    return {"model": "emulated", "messages": [{"role": "user", "content": "What is a KV cache?"}], **extra}


def completion_body(**extra: Any) -> dict[str, Any]:
    return {"model": "emulated", "prompt": "The KV cache is", **extra}


def both_endpoints(**extra: Any) -> Any:
    """Parametrize a test over a chat and a completions request with these extra fields."""
    import pytest

    return pytest.mark.parametrize("path,body", [(CHAT, chat_body(**extra)), (COMPLETIONS, completion_body(**extra))],
                                   ids=["chat", "completions"])


def post(stack: Stack, path: str, body: dict[str, Any] | bytes, **headers: str) -> Any:
    """POST through Envoy with the P/D header (the stack's prefill worker unless overridden)."""
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    with stack.client() as client:
        return client.post(path, content=content, headers=stack.pd_headers(**headers))


def stream(stack: Stack, path: str, body: dict[str, Any], **headers: str) -> tuple[Any, bytes]:
    """POST a streaming request through Envoy; the response (read) and its raw body bytes, as sent."""
    with stack.client() as client, client.stream("POST", path, content=json.dumps(body),
                                                 headers=stack.pd_headers(**headers)) as response:
        raw = response.read()  # identity encoding: these are the bytes as sent
    return response, raw


def assert_event_stream(response: Any) -> None:
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/event-stream")


def only(records: list[dict[str, Any]]) -> dict[str, Any]:
    assert len(records) == 1, f"expected exactly one request, got {len(records)}"
    return records[0]


def assert_no_leg_ran(stack: Stack) -> None:
    assert stack.prefill.requests() == [], "the prefill leg must not run"
    assert stack.decode.requests() == [], "the decode leg must not run"


def assert_error(response: Any, status: int, code: str) -> dict[str, Any]:
    """Our documented error shape, with this status and code; returns the error object."""
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == "application/json"
    error: dict[str, Any] = response.json()["error"]
    assert error["code"] == code
    assert set(error) == {"message", "type", "param", "code"}
    return error


def ext_proc_streams(stack: Stack) -> int:
    """How many ext_proc streams Envoy opened to our server so far."""
    assert stack.envoy is not None
    stats = stack.envoy.admin_get("/stats?filter=ext_proc.streams_started").decode()
    return sum(int(line.rsplit(":", 1)[1]) for line in stats.splitlines() if line.strip())


def metric_samples(metrics_url: str) -> dict[str, float]:
    """A pd-extproc server's metric samples as {"name{labels}": value}."""
    samples = {}
    for line in httpx.get(metrics_url + "/metrics", timeout=10).text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            samples[name] = float(value)
    return samples


def scrape(stack: Stack) -> dict[str, float]:
    """Our server's metric samples as {"name{labels}": value}."""
    return metric_samples(stack.metrics_url)


def envoy_logged(stack: Stack, *request_ids: str) -> None:
    """Wait until Envoy's access log has a line for each request: its access loggers (the stats ones
    included) have then run."""
    log = stack.log_dir / "envoy.log"
    assert eventually(lambda: all(request_id in log.read_text() for request_id in request_ids)), request_ids


def envoy_stats_settled(stack: Stack) -> None:
    """Wait for two of Envoy's stats flushes (every second; each sets server.uptime): what was
    recorded before this call is then in the merged histograms."""
    assert stack.envoy is not None
    envoy = stack.envoy

    def uptime() -> int:
        return int(envoy.admin_get("/stats?filter=^server.uptime$").decode().rsplit(":", 1)[1])

    start = uptime()
    assert eventually(lambda: uptime() >= start + 2)


def envoy_histogram(stack: Stack, name: str) -> dict[str, tuple[float, float]]:
    """Envoy's histogram ``name`` from its admin port (Prometheus text) as {labels: (count, sum)}, as
    of its last stats flush (see envoy_stats_settled)."""
    assert stack.envoy is not None
    counts: dict[str, float] = {}
    sums: dict[str, float] = {}
    for line in stack.envoy.admin_get("/stats/prometheus").decode().splitlines():
        for suffix, into in (("_count", counts), ("_sum", sums)):
            if line.startswith(f"envoy_{name}{suffix}"):
                labels, value = line[len(name) + len(suffix) + 6:].rsplit(" ", 1)
                into[labels] = float(value)
    return {labels: (count, sums.get(labels, 0.0)) for labels, count in counts.items()}


def eventually(condition: Callable[[], bool], within: float = 60.0) -> bool:
    """Poll an observable condition (bookkeeping that finishes after the client's answer) until it
    holds or ``within`` seconds pass. A passing test waits only as long as the condition takes, so the
    bound is what a loaded machine may need, not what an idle one does."""
    deadline = time.monotonic() + within
    while not condition():
        if time.monotonic() > deadline:
            return bool(condition())
        time.sleep(0.05)
    return True


@functools.cache
def _refusing_socket() -> socket.socket:
    probe = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    probe.bind(("127.0.0.1", 0))
    return probe


def closed_port() -> int:
    """A loopback port that refuses every connection: bound, never listening, and held for the whole
    test run, so nothing else on the machine can take it (a port bound then released could be given to
    any process, or as the source port of an outgoing connection, before the test connects)."""
    return int(_refusing_socket().getsockname()[1])


def sse_events(raw: str) -> list[str]:
    """The data of each server-sent event, in order ("[DONE]" included)."""
    return [line[len("data: "):] for line in raw.split("\n\n") if line.startswith("data: ")]


def sse_text(raw: str, chat: bool) -> tuple[str, list[dict[str, Any]]]:
    """The streamed text and the JSON chunks of an OpenAI stream that ends with [DONE]."""
    events = sse_events(raw)
    assert events[-1] == "[DONE]", "the stream must end with [DONE]"
    chunks = [json.loads(event) for event in events[:-1]]
    pieces = [(c["choices"][0]["delta"].get("content") or "") if chat else c["choices"][0]["text"]
              for c in chunks if c.get("choices")]
    return "".join(pieces), chunks


def assert_distinct_workers(stack: Stack, engine: str) -> None:
    """The two legs were served by the stack's own prefill and decode workers of ``engine``."""
    infos = [worker.info() for worker in (stack.prefill, stack.decode)]
    assert [(i["engine"], i["role"], i["worker_id"]) for i in infos] == [
        (engine, "prefill", "prefill"), (engine, "decode", "decode")]


def assert_served_by_decode(response: Any) -> None:
    assert response.status_code == 200, response.text
    assert response.headers["x-emulator-worker"] == "decode"


def client_request(path: str, body: dict[str, Any] | bytes) -> Any:
    """A validated ClientRequest, as the processor hands it to an adapter."""
    from extproc.protocol.openai_request import parse_client_request

    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    return parse_client_request(path, "application/json", raw, 1 << 20)
