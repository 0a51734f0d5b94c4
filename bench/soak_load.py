"""The soak's client: a seeded mix of requests, each tagged (in its prompt and its x-request-id), and
the classification of every answer into a documented outcome (PROTOCOL.md's error table, through
extproc/protocol/errors.py's SPEC) or the engine's own answer, with the content checked against the tag.

Kinds: P/D chat and completions, streamed and not; passthrough (no prefill header); refused requests
(each with the one code it must get); client disconnects at a random point; large bodies.
"""

from __future__ import annotations

import asyncio
import functools
import random
import re
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import orjson

from extproc.protocol.errors import SPEC, Code
from pd_extproc_lab.emulator.text import chat_prompt, completion_prompt, generate

# Codes Envoy answers itself (local_reply_config); every other code comes from our server.
ENVOY_CODES = frozenset({Code.REQUEST_TOO_LARGE, Code.REQUEST_TIMEOUT, Code.PD_EXTPROC_UNAVAILABLE,
                         Code.PD_EXTPROC_TIMEOUT, Code.DECODE_UPSTREAM_UNAVAILABLE, Code.DECODE_UPSTREAM_TIMEOUT,
                         Code.GATEWAY_ERROR})
PD_PATHS = ("/v1/chat/completions", "/v1/completions")
CLIENT_TIMEOUT = 60.0

# kind -> weight. "refuse_*" kinds name the code they must get when nothing is failing.
MIX: dict[str, float] = {
    "pd_chat": 24, "pd_chat_stream": 18, "pd_completion": 8, "pd_completion_stream": 6,
    "passthrough": 8, "passthrough_models": 2,
    "refuse_body": 2, "refuse_reserved": 2, "refuse_n": 2, "refuse_forbidden": 2, "refuse_target": 2,
    "refuse_too_large": 1, "disconnect": 9, "disconnect_stream": 5, "large": 3,
}
REFUSALS = {
    "refuse_body": Code.INVALID_REQUEST_BODY, "refuse_reserved": Code.RESERVED_REQUEST_FIELD,
    "refuse_n": Code.UNSUPPORTED_PD_VARIANT, "refuse_forbidden": Code.PREFILL_TARGET_FORBIDDEN,
    "refuse_target": Code.INVALID_PREFILL_TARGET, "refuse_too_large": Code.REQUEST_TOO_LARGE,
}


@dataclass
class Outcome:
    tag: str
    kind: str
    pd: bool  # sent to the P/D route (prefill header on a P/D path)
    started: float
    ended: float = 0.0
    status: int | None = None  # None: no response head
    label: str = ""  # ok | <code> | engine_<status> | engine_stream_error | disconnected | no_response | ...
    problem: str = ""  # why the answer is undocumented or wrong (empty = fine)
    disconnected: bool = False
    saw_head: bool = False
    bytes: int = 0


@dataclass
class Built:
    kind: str
    path: str
    headers: dict[str, str]
    body: bytes
    pd: bool
    stream: bool
    expected: str | None  # the exact content decode must return for this tag, None when not checked
    disconnect_after: float | None = None


def _filler(rng: random.Random, words: int) -> str:
    vocab = ("alpha", "beta", "gamma", "delta", "kv", "block", "lease", "token", "prefill", "decode")
    return " ".join(rng.choice(vocab) for _ in range(words))


def build(kind: str, tag: str, rng: random.Random, prefill: str, large_bytes: int, too_large_bytes: int) -> Built:
    headers = {"content-type": "application/json", "x-request-id": tag, "x-prefiller-host-port": prefill}
    max_tokens = rng.randint(3, 12)
    stream = kind.endswith("_stream")
    words = 4000 if kind == "large" else rng.randint(5, 60)
    content = f"soak {tag} " + (_filler(rng, words) if kind != "large" else "x" * large_bytes)
    path, body_obj = "/v1/chat/completions", {"model": "emulated", "messages": [{"role": "user", "content": content}],
                                               "max_tokens": max_tokens}
    if kind.startswith("pd_completion"):
        path, body_obj = "/v1/completions", {"model": "emulated", "prompt": content, "max_tokens": max_tokens}
    if stream:
        body_obj["stream"] = True
    if kind == "refuse_reserved":
        body_obj["kv_transfer_params"] = {"do_remote_prefill": True}
        body_obj["bootstrap_room"] = 7
        body_obj["disaggregated_params"] = {"request_type": "generation_only"}
    if kind == "refuse_n":
        body_obj["n"] = 2
    if kind == "refuse_forbidden":
        headers["x-prefiller-host-port"] = "10.255.255.1:8000"
    if kind == "refuse_target":
        headers["x-prefiller-host-port"] = "127.0.0.1:1,127.0.0.1:2"
    if kind.startswith("passthrough"):
        del headers["x-prefiller-host-port"]
    body = orjson.dumps(body_obj)
    if kind == "refuse_body":
        body = b'{"model": "emulated", "messages": [' + tag.encode()
    if kind == "refuse_too_large":
        body = b'{"pad": "' + b"x" * too_large_bytes + b'"}'
    if kind == "passthrough_models":
        return Built(kind, "/v1/models", {"x-request-id": tag}, b"", False, False, None)
    expected = None
    if kind.startswith(("pd_", "passthrough", "disconnect", "large")) and kind != "passthrough_models":
        prompt = chat_prompt(body_obj["messages"]) if "messages" in body_obj else completion_prompt(body_obj["prompt"])
        expected = "".join(generate(prompt, max_tokens))
    disconnect_after = None
    if kind.startswith("disconnect"):
        # Random points: while the body is sent or the prefill runs (a request takes tens of ms here),
        # between the legs, or in a decode stream (slowed by the soak's scripted token intervals).
        disconnect_after = rng.uniform(0.0, 0.05) if rng.random() < 0.5 else rng.uniform(0.05, 0.6)
        if kind == "disconnect_stream":
            body_obj["stream"] = True
            body = orjson.dumps(body_obj)
            stream = True
    return Built(kind, path, headers, body, "x-prefiller-host-port" in headers and path in PD_PATHS, stream,
                 expected, disconnect_after)


PROTOCOL = Path(__file__).resolve().parents[1] / "PROTOCOL.md"


@functools.cache
def documented_statuses() -> dict[str, range]:
    """The statuses PROTOCOL.md's error table allows for each code: a number, "prefill's own 4xx/5xx",
    or "Envoy's own" (any)."""
    text = PROTOCOL.read_text()
    table = text[text.index("<!-- error-table -->"):text.index("<!-- /error-table -->")]
    allowed: dict[str, range] = {}
    for row in re.finditer(r"^\| `([a-z_]+)` \| ([^|]+) \|", table, re.M):
        code, status = row.group(1), row.group(2).strip()
        if status.isdigit():
            allowed[code] = range(int(status), int(status) + 1)
        elif "4xx/5xx" in status:
            allowed[code] = range(400, 600)
        else:  # Envoy's own
            allowed[code] = range(100, 600)
    return allowed


def classify_error(status: int, body: bytes) -> tuple[str, str]:
    """(label, problem) of a non-200 answer: one of our documented codes with its documented status, or
    the engine's own error (vLLM/TensorRT-LLM's ``{"error": {..., "code": <status>}}``, SGLang's
    ``{"error": "..."}`` or ``{"object": "error", ...}``)."""
    try:
        parsed = orjson.loads(body)
    except orjson.JSONDecodeError:
        return f"http_{status}", f"non-JSON error body: {body[:120]!r}"
    error = parsed.get("error") if isinstance(parsed, dict) else None
    if isinstance(error, dict) and isinstance(error.get("code"), str):
        try:
            code = Code(error["code"])
        except ValueError:
            return f"http_{status}", f"undocumented code {error['code']!r}"
        spec = SPEC[code]
        allowed = documented_statuses().get(code.value)
        if allowed is None:
            return code.value, "a code missing from PROTOCOL.md's error table"
        if status not in allowed:
            return code.value, f"status {status}, PROTOCOL.md's table allows {allowed.start}-{allowed.stop - 1}"
        if error.get("type") != spec.type:
            return code.value, f"type {error.get('type')!r}, the table says {spec.type!r}"
        return code.value, ""
    if isinstance(error, dict) and error.get("code") == status:
        return f"engine_{status}", ""
    if isinstance(parsed, dict) and (isinstance(error, str) or parsed.get("object") == "error"):
        return f"engine_{status}", ""
    return f"http_{status}", f"undocumented error body: {body[:120]!r}"


def _stream_content(raw: bytes, chat: bool) -> tuple[str, str]:
    """(content, problem) of an SSE answer."""
    content, done = [], False
    for event in raw.split(b"\n\n"):
        event = event.strip()
        if not event:
            continue
        if not event.startswith(b"data: "):
            return "", f"not an SSE data event: {event[:80]!r}"
        data = event[6:]
        if data == b"[DONE]":
            done = True
            continue
        chunk = orjson.loads(data)
        if "error" in chunk:
            return "", "error_event"
        for choice in chunk.get("choices", []):
            piece = (choice.get("delta") or {}).get("content") if chat else choice.get("text")
            content.append(piece or "")
    return "".join(content), "" if done else "stream ended without [DONE]"


def judge(built: Built, outcome: Outcome, body: bytes) -> None:
    """Fill ``outcome.label`` and ``outcome.problem`` from a complete answer."""
    status = outcome.status
    assert status is not None
    if status != 200:
        outcome.label, outcome.problem = classify_error(status, body)
        return
    if built.kind == "passthrough_models":
        outcome.label = "ok"
        return
    chat = built.path == "/v1/chat/completions"
    if built.stream:
        content, problem = _stream_content(body, chat)
        if problem == "error_event":
            outcome.label = "engine_stream_error"
            return
    else:
        try:
            parsed = orjson.loads(body)
            choice = parsed["choices"][0]
            content, problem = (choice["message"]["content"] if chat else choice["text"]), ""
        except (orjson.JSONDecodeError, KeyError, IndexError, TypeError):
            content, problem = "", f"200 without a completion: {body[:120]!r}"
    outcome.label = "ok"
    if problem:
        outcome.problem = problem
    elif built.expected is not None and content != built.expected:
        # Another request's answer (a crossed handoff or response) reads as someone else's tokens.
        outcome.problem = f"content is not this request's: {content[:60]!r} != {built.expected[:60]!r}"


async def send(session: aiohttp.ClientSession, base: str, built: Built, tag: str) -> Outcome:
    outcome = Outcome(tag, built.kind, built.pd, time.monotonic())
    method = "GET" if built.kind == "passthrough_models" else "POST"

    async def exchange() -> bytes:
        async with session.request(method, base + built.path, data=built.body or None,
                                   headers=built.headers) as response:
            outcome.status = response.status
            outcome.saw_head = True
            return await response.read()

    try:
        if built.disconnect_after is not None:
            try:
                body = await asyncio.wait_for(exchange(), built.disconnect_after)
            except TimeoutError:
                outcome.disconnected = True
                outcome.label = "disconnected"
                return outcome
        else:
            body = await exchange()
        outcome.bytes = len(body)
        judge(built, outcome, body)
    except (aiohttp.ClientError, OSError, TimeoutError) as exc:
        outcome.label = "no_response" if not outcome.saw_head else "cut_after_head"
        outcome.problem = type(exc).__name__
    finally:
        outcome.ended = time.monotonic()
    return outcome


@dataclass
class Load:
    """Sends the mix at ``rate`` requests per second (Poisson arrivals) while ``running`` is set."""

    base: str
    prefill: str
    rate: float
    rng: random.Random
    large_bytes: int
    too_large_bytes: int
    outcomes: list[Outcome] = field(default_factory=list)
    inflight: set[asyncio.Task[Outcome]] = field(default_factory=set)
    running: asyncio.Event = field(default_factory=asyncio.Event)
    sent: int = 0
    limit: int = 0  # stop after this many requests (0 = no limit)
    _seq: int = 0

    def next_tag(self) -> str:
        self._seq += 1
        return f"soak-{self._seq:07d}"

    async def run(self, session: aiohttp.ClientSession, stop: asyncio.Event) -> None:
        kinds, weights = list(MIX), list(MIX.values())
        while not stop.is_set():
            await self.running.wait()
            await asyncio.sleep(self.rng.expovariate(self.rate))
            if not self.running.is_set() or stop.is_set():
                continue
            if self.limit and self.sent >= self.limit:
                stop.set()
                break
            kind = self.rng.choices(kinds, weights)[0]
            tag = self.next_tag()
            built = build(kind, tag, self.rng, self.prefill, self.large_bytes, self.too_large_bytes)
            self.sent += 1
            task = asyncio.get_running_loop().create_task(send(session, self.base, built, tag))
            self.inflight.add(task)
            task.add_done_callback(self._done)

    def _done(self, task: asyncio.Task[Outcome]) -> None:
        self.inflight.discard(task)
        if not task.cancelled() and task.exception() is None:
            self.outcomes.append(task.result())

    async def quiesce(self, within: float) -> bool:
        """Stop sending and wait for every request in flight; False if some are still running."""
        self.running.clear()
        if self.inflight:
            await asyncio.wait(set(self.inflight), timeout=within)
        return not self.inflight


async def probe(session: aiohttp.ClientSession, base: str, prefill: str, rng: random.Random, tag: str) -> Outcome:
    """One plain P/D chat request (for recovery times)."""
    return await send(session, base, build("pd_chat", tag, rng, prefill, 0, 0), tag)
