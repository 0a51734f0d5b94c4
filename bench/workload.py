"""The request bodies: a small chat request (streamed or not), a chat request carrying a ~20 MiB image, and
the size sweep's chat and completions requests whose prompt text makes them exactly 1 KiB .. 8 MiB."""

from __future__ import annotations

import base64
from pathlib import Path

import orjson

CHAT_PATH = "/v1/chat/completions"
COMPLETIONS_PATH = "/v1/completions"
SWEEP_KINDS = {"chat": CHAT_PATH, "completions": COMPLETIONS_PATH}  # the size sweep's kinds -> path
SWEEP_SIZES = (1 << 10, 16 << 10, 256 << 10, 1 << 20, 8 << 20)
MAX_TOKENS = 16
MODEL = "emulated"  # the model every request names
LARGE_BODY_BYTES = 20 << 20
_PROMPT = (
    "You are a helpful assistant. Summarise the following notes about disaggregated serving in three "
    "sentences: prefill computes the prompt's KV cache on one worker, the cache moves over a fast link, "
    "and decode streams tokens from another worker. "
) * 3  # about 750 bytes of prompt: a short chat turn


def chat_body(stream: bool) -> bytes:
    body: dict[str, object] = {
        "model": MODEL,
        "messages": [{"role": "user", "content": _PROMPT}],
        "max_tokens": MAX_TOKENS,
    }
    if stream:
        body["stream"] = True
    return orjson.dumps(body)


def large_image_body(total_bytes: int = LARGE_BODY_BYTES) -> bytes:
    """A chat request whose one user message has a text part and a base64 PNG data URL, ``total_bytes``
    long in all (the image payload is filler bytes; no engine here decodes it)."""
    envelope = orjson.dumps({
        "model": MODEL,
        "messages": [{"role": "user", "content": [
            {"type": "text", "text": "What is in this image?"},
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,"}},
        ]}],
        "max_tokens": MAX_TOKENS,
    })
    marker = b"base64,"
    cut = envelope.index(marker) + len(marker)
    image_chars = (total_bytes - len(envelope)) // 4 * 4  # valid base64: whole 4-character groups
    raw_image = (bytes(range(256)) * (image_chars // 4 * 3 // 256 + 1))[: image_chars // 4 * 3]
    image = base64.b64encode(raw_image)
    return envelope[:cut] + image + envelope[cut:]


def size_label(total_bytes: int) -> str:
    return f"{total_bytes >> 20}MiB" if total_bytes >= 1 << 20 else f"{total_bytes >> 10}KiB"


def sweep_body_name(kind: str, total_bytes: int) -> str:
    return f"{kind}-{size_label(total_bytes)}"


def sized_body(kind: str, total_bytes: int) -> bytes:
    """A non-streaming chat (one user message) or completions request of exactly ``total_bytes``: plain
    prose as the prompt (no escapes, so the JSON is as long as the text), the real shape of a long prompt."""
    prompt_key = "prompt" if kind == "completions" else "content"
    envelope: dict[str, object] = {"model": MODEL, "max_tokens": MAX_TOKENS}
    if kind == "completions":
        envelope["prompt"] = ""
    else:
        envelope["messages"] = [{"role": "user", "content": ""}]
    empty = orjson.dumps(envelope)
    room = total_bytes - len(empty)
    if room < 0:
        raise ValueError(f"{total_bytes} bytes is too small for a {kind} request")
    text = (_PROMPT * (room // len(_PROMPT) + 1))[:room].encode()
    marker = f'"{prompt_key}":""'.encode()
    cut = empty.index(marker) + len(marker) - 1
    return empty[:cut] + text + empty[cut:]


def write_bodies(directory: Path, sweep_sizes: tuple[int, ...] = ()) -> dict[str, Path]:
    """Every body the benchmark sends, as files wrk reads: name -> path."""
    bodies = {
        "non-stream": chat_body(stream=False),
        "stream": chat_body(stream=True),
        "20MiB": large_image_body(),
        **{sweep_body_name(kind, size): sized_body(kind, size) for kind in SWEEP_KINDS for size in sweep_sizes},
    }
    paths = {}
    for name, body in bodies.items():
        path = directory / f"body-{name}.json"
        path.write_bytes(body)
        paths[name] = path
    return paths
