"""The emulated vLLM worker (pd_extproc_lab/emulator/vllm.py) against the real one, request for request.

Every end-to-end contract test runs against the emulator, so it must not drift from the engine it
stands for: the same request to a real and to an emulated worker must give responses with the same
keys and JSON types (prefill responses with their handoff, decode responses, validation and
KV-load-failure errors), and streams with the same SSE framing and the same sequence of chunk shapes.
Values (ids, generated text, token counts) legitimately differ and are not compared.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from pd_extproc_lab.emulator.worker import WorkerSpec, start_workers
from tests.helpers import closed_port
from tests.realvllm.stage import RealPd, Reply, send
from tests.realvllm.wire import (
    CHAT,
    COMPLETIONS,
    PATHS,
    SseStream,
    StreamOutline,
    prefill_leg_body,
    request_body,
    shape,
    shape_diff,
)

pytestmark = pytest.mark.realvllm

PATH_IDS = ["chat", "completions"]


class EmulatedPair:
    def __init__(self, prefill_url: str, decode_url: str) -> None:
        self.prefill_http = httpx.Client(base_url=prefill_url, timeout=30)
        self.decode_http = httpx.Client(base_url=decode_url, timeout=30)

    def direct_pd(self, path: str, body: dict[str, Any]) -> tuple[Reply, Reply]:
        prefill = send(self.prefill_http, path, prefill_leg_body(path, body))
        assert prefill.status == 200, prefill.body[:300]
        decode = send(self.decode_http, path, {**body, "kv_transfer_params": prefill.json()["kv_transfer_params"]})
        return prefill, decode

    def close(self) -> None:
        self.prefill_http.close()
        self.decode_http.close()


@pytest.fixture(scope="module")
def emulated(real_pd: RealPd) -> Iterator[EmulatedPair]:
    """An emulated prefill and decode worker serving the real workers' model name."""
    log_dir = Path(tempfile.mkdtemp(prefix="pd-extproc-emulated-shapes-"))
    specs = [WorkerSpec(f"emulated-{role}", role, args=("--model", real_pd.model)) for role in ("prefill", "decode")]
    workers = start_workers(specs, log_dir, 30)
    try:
        pair = EmulatedPair(*(worker.url for worker in workers.values()))
        yield pair
        pair.close()
    finally:
        for worker in workers.values():
            worker.stop()
        shutil.rmtree(log_dir, ignore_errors=True)


def assert_same_shape(real: Any, emulated: Any, what: str) -> None:
    assert shape(emulated) == shape(real), f"{what}: the emulator drifted from vLLM\n" + \
        shape_diff(shape(real), shape(emulated), "real vLLM", "emulator")


def assert_same_stream(real: Reply, emulated: Reply, what: str) -> None:
    """Same status, media type and SSE framing; the same kinds of chunk in the same order, each kind with
    the same shape. Content chunks are compared only when the real stream has them (see
    ``StreamOutline.without_content``)."""
    assert (emulated.status, emulated.media_type) == (real.status, real.media_type), what
    real_stream, emulated_stream = SseStream.parse(real.body), SseStream.parse(emulated.body)
    assert real_stream.ends_with_done and emulated_stream.ends_with_done, what
    real_outline, emulated_outline = StreamOutline.of(real_stream.chunks()), StreamOutline.of(emulated_stream.chunks())
    if "content" not in real_outline.kinds:
        emulated_outline = emulated_outline.without_content()
    assert emulated_outline.kinds == real_outline.kinds, f"{what}: chunk order differs"
    for kind, real_shapes in real_outline.shapes.items():
        emulated_shapes = emulated_outline.shapes[kind]
        assert emulated_shapes == real_shapes, f"{what}: {kind} chunks differ\n" + "\n".join(
            shape_diff(r, e, "real vLLM", "emulator") for r in real_shapes for e in emulated_shapes)


@pytest.mark.parametrize("path", PATHS, ids=PATH_IDS)
def test_prefill_and_decode_responses_have_the_real_shape(real_pd: RealPd, emulated: EmulatedPair, path: str) -> None:
    """The producer response (with its 14-field handoff) and the decode response, non-streaming."""
    body = request_body(path, real_pd.model, f"shape of the responses on {path}")
    real_prefill, real_decode = real_pd.direct_pd(path, body)
    emulated_prefill, emulated_decode = emulated.direct_pd(path, body)
    for real, fake, what in ((real_prefill, emulated_prefill, "prefill response"),
                             (real_decode, emulated_decode, "decode response")):
        assert (fake.status, fake.media_type) == (real.status, real.media_type) == (200, "application/json"), what
        assert_same_shape(real.json(), fake.json(), f"{path} {what}")


@pytest.mark.parametrize("include_usage", [False, True], ids=["no-usage", "include-usage"])
@pytest.mark.parametrize("path", PATHS, ids=PATH_IDS)
def test_decode_streams_have_the_real_framing_and_chunk_shapes(
        real_pd: RealPd, emulated: EmulatedPair, path: str, include_usage: bool) -> None:
    """SSE: data-only events, blank-line separated, one [DONE] last; role/content/final/usage chunks alike."""
    extra: dict[str, Any] = {"stream": True}
    if include_usage:
        extra["stream_options"] = {"include_usage": True}
    body = request_body(path, real_pd.model, f"shape of the stream on {path} usage={include_usage}", **extra)
    _, real = real_pd.direct_pd(path, body)
    _, fake = emulated.direct_pd(path, body)
    assert real.status == 200, real.body[:300]
    assert_same_stream(real, fake, f"{path} stream (include_usage={include_usage})")


def test_validation_error_has_the_real_shape(real_pd: RealPd, emulated: EmulatedPair) -> None:
    """A request vLLM refuses (min_tokens above max_tokens): same status, same error object."""
    body = request_body(COMPLETIONS, real_pd.model, "min above max", min_tokens=5, max_tokens=1)
    real = send(real_pd.decode.http, COMPLETIONS, body)
    fake = send(emulated.decode_http, COMPLETIONS, body)
    assert (fake.status, fake.media_type) == (real.status, real.media_type) == (400, "application/json")
    assert_same_shape(real.json(), fake.json(), "400 error")


def failing_handoff() -> dict[str, Any]:
    """A well-formed handoff whose producer side channel does not exist: the KV load must fail."""
    return {"do_remote_prefill": True, "do_remote_decode": False, "remote_block_ids": [[7]],
            "remote_engine_id": "00000000-0000-4000-8000-00000000dead", "remote_request_id": "cmpl-dead-0-00000000",
            "remote_host": "127.0.0.1", "remote_port": closed_port(), "tp_size": 1}


@pytest.mark.realvllm(phase="late")
@pytest.mark.parametrize("path,stream", [(CHAT, False), (CHAT, True), (COMPLETIONS, True)],
                         ids=["chat-json", "chat-sse", "completions-sse"])
def test_kv_load_failure_has_the_real_shape(real_pd: RealPd, emulated: EmulatedPair, path: str, stream: bool) -> None:
    """kv_load_failure_policy=fail: a handoff that cannot be loaded is a 500 (JSON), or an error event
    inside a 200 stream. Costs the real decode one failed transfer each (counted in the ledger)."""
    body = request_body(path, real_pd.model, f"nothing to load on {path}", stream=stream,
                        kv_transfer_params=failing_handoff())
    real_pd.ledger.deliberate_load_failures += 1
    real = send(real_pd.decode.http, path, body)
    fake = send(emulated.decode_http, path, body)
    if stream:
        assert_same_stream(real, fake, f"{path} stream after a failed KV load")
        errors = [c for c in SseStream.parse(real.body).chunks() if "error" in c]
        assert [e["error"]["code"] for e in errors] == [500]
    else:
        assert (fake.status, fake.media_type) == (real.status, real.media_type) == (500, "application/json")
        assert fake.json() == real.json(), "the fail-policy error body is a fixed text"
    assert real_pd.decode.http.get("/health").status_code == 200, "decode stays healthy after a failed load"


# --- the Messages, Responses and generate APIs ------------------------------------------------------------

GEN_APIS = {
    "/v1/messages": lambda model: {"model": model, "max_tokens": 8, "temperature": 0,
                                   "messages": [{"role": "user", "content": "shape of a message"}]},
    "/v1/responses": lambda model: {"model": model, "input": "shape of a response", "max_output_tokens": 8,
                                    "temperature": 0, "store": False},
    "/inference/v1/generate": lambda model: {"model": model, "token_ids": [5, 6, 7, 8],
                                             "sampling_params": {"temperature": 0, "max_tokens": 8}},
}


def gen_api_legs(prefill: httpx.Client, decode: httpx.Client, path: str, body: dict[str, Any]) -> tuple[Reply, Reply]:
    """Both legs by hand with the prefill body our adapter derives (vllm_apis.py)."""
    from extproc.adapters.vllm_nixl import VllmNixlAdapter, prefill_body
    from extproc.protocol.openai_request import parse_client_request

    client = parse_client_request(path, "application/json", orjson.dumps(body), 1 << 20,
                                  served=VllmNixlAdapter.endpoints)
    first = send(prefill, path, prefill_body(client))
    assert first.status == 200, first.body[:300]
    return first, send(decode, path, {**body, "kv_transfer_params": first.json()["kv_transfer_params"]})


@pytest.mark.parametrize("path", list(GEN_APIS), ids=["messages", "responses", "generate"])
def test_the_other_apis_responses_have_the_real_shape(real_pd: RealPd, emulated: EmulatedPair, path: str) -> None:
    """Prefill (with its handoff) and decode responses of each API, non-streaming: same keys and JSON types."""
    body = GEN_APIS[path](real_pd.model)
    real_pd.ledger.direct += 1
    real = gen_api_legs(real_pd.prefill.http, real_pd.decode.http, path, body)
    fake = gen_api_legs(emulated.prefill_http, emulated.decode_http, path, body)
    for real_reply, fake_reply, what in ((real[0], fake[0], "prefill response"), (real[1], fake[1], "decode response")):
        assert (fake_reply.status, fake_reply.media_type) == (real_reply.status, real_reply.media_type), what
        assert_same_shape(real_reply.json(), fake_reply.json(), f"{path} {what}")


def event_outline(raw: bytes) -> list[tuple[str | None, Any]]:
    """Each SSE frame's event name and the shape of its data (``[DONE]`` as is); consecutive frames of
    the same name and shape (the per-token deltas) count once."""
    outline: list[tuple[str | None, Any]] = []
    for frame in raw.decode().split("\n\n"):
        if not frame.strip():
            continue
        lines = dict(line.split(": ", 1) for line in frame.split("\n") if ": " in line)
        data = lines.get("data", "")
        item = (lines.get("event"), data if data == "[DONE]" else shape(orjson.loads(data)))
        if not outline or outline[-1] != item:
            outline.append(item)
    return outline


@pytest.mark.parametrize("path", list(GEN_APIS), ids=["messages", "responses", "generate"])
def test_the_other_apis_streams_have_the_real_events(real_pd: RealPd, emulated: EmulatedPair, path: str) -> None:
    """A streamed decode answer of each API: the same event names, in the same order, each with the same
    data shape (the generated values aside)."""
    body = {**GEN_APIS[path](real_pd.model), "stream": True}
    real_pd.ledger.direct += 1
    _, real = gen_api_legs(real_pd.prefill.http, real_pd.decode.http, path, body)
    _, fake = gen_api_legs(emulated.prefill_http, emulated.decode_http, path, body)
    assert (fake.status, fake.media_type) == (real.status, real.media_type) == (200, "text/event-stream")
    real_outline, fake_outline = event_outline(real.body), event_outline(fake.body)
    assert [name for name, _ in fake_outline] == [name for name, _ in real_outline], path
    drift = [f"event {name}: " + shape_diff(real_shape, fake_shape, "real vLLM", "emulator")
             for (name, real_shape), (_, fake_shape) in zip(real_outline, fake_outline, strict=True)
             if real_shape != fake_shape]
    assert not drift, f"{path}: the emulator drifted from vLLM\n" + "\n".join(drift)
