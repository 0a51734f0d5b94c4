"""The cheapest prefill/decode worker we could write, so that the proxies, not the workers, bound a run.

``python bench/cheap_worker.py --engine vllm|sglang --role prefill|decode [--engine-id ID]`` listens on
127.0.0.1 (a free port), prints ``ready url=http://...`` and answers every generation request with
bytes prepared at start-up: no JSON parsing, one scan per body for the few members it counts, one write
per response. It imports the standard library and uvloop only (no project module), so its cost is what it is.

Its cost per byte is kept near the copy the kernel makes, so that a large body does not make the worker the
bottleneck of the size sweep: a request's head is parsed once and its body collected as the reads that
carry it and joined once (not re-scanned per read), and a large body is scanned by jumping from one double
quote to the next (memchr) and matching the members only there, where a regex search would step through
every byte of the prompt.

What it still proves, per leg, on ``GET /_cheap/counters`` (``POST /_cheap/reset`` zeroes them):

  vllm prefill   ``producer``: requests asking for a KV producer handoff (``"do_remote_decode": true``);
                 each is answered with a vLLM 0.32-shaped handoff naming this worker's engine id and a
                 fresh ``remote_request_id`` (``cheap-N``)
  vllm decode    ``consumer``: requests carrying a handoff (``"do_remote_prefill": true``) whose
                 ``remote_engine_id`` is the prefill worker's (``--engine-id``); ``handoff_ids`` counts
                 distinct ``remote_request_id`` values among them
  sglang both    ``producer`` / ``consumer``: requests carrying ``bootstrap_room`` (decode: and
                 ``bootstrap_host``)
  every role     ``plain``: generation requests with none of that; ``requests``: all of them

There is no KV ledger (no lease, no pull): the emulated workers (pd_extproc_lab/emulator) prove that; these
only count that both legs ran and that decode got the handoff prefill made.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import sys
import time

REASON = {200: b"OK", 404: b"Not Found", 400: b"Bad Request"}
TOKENS = 16
_CONTENT = "".join(f"tok{i} " for i in range(TOKENS))
DEFAULT_ENGINE_ID = "cheap-prefill-engine"  # the vllm prefill engine id both roles use unless told
HANDOFF_WINDOW = 4096  # bytes either side of the consumer mark where the handoff's members are read
# The members counted: the boolean ones count when true, the bootstrap ones when present.
_MARK = re.compile(rb'"(stream|do_remote_decode|do_remote_prefill|bootstrap_room|bootstrap_host)"\s*:\s*(true)?')
_PRESENCE_MARKS = (b"bootstrap_room", b"bootstrap_host")
QUOTE_WALK_FROM = 16 << 10  # bytes: below, one regex pass is cheaper than a Python step per quote
_ENGINE_ID = re.compile(rb'"remote_engine_id"\s*:\s*"([^"]*)"')
_REQUEST_ID = re.compile(rb'"remote_request_id"\s*:\s*"([^"]*)"')


def marks(body: bytes) -> dict[bytes, int]:
    """Each counted member found in ``body`` -> where its first counting occurrence starts.

    The same matches as ``_MARK.finditer`` over the whole body: every match starts at a double quote, so a
    large body is walked from quote to quote (``bytes.find`` of one byte is a memchr) and matched only there.
    """
    found: dict[bytes, int] = {}
    if len(body) < QUOTE_WALK_FROM:
        for match in _MARK.finditer(body):
            _note(found, match)
        return found
    at = body.find(b'"')
    while at >= 0:
        here = _MARK.match(body, at)
        if here is None:
            at = body.find(b'"', at + 1)
            continue
        _note(found, here)
        at = body.find(b'"', here.end())
    return found


def _note(found: dict[bytes, int], match: re.Match[bytes]) -> None:
    name = match.group(1)
    if match.group(2) is not None or name in _PRESENCE_MARKS:
        found.setdefault(name, match.start())


def _response(status: int, body: bytes, content_type: bytes = b"application/json") -> bytes:
    return (b"HTTP/1.1 %d %s\r\ncontent-type: %s\r\ncontent-length: %d\r\n\r\n"
            % (status, REASON.get(status, b"OK"), content_type, len(body))) + body


def _chunked_stream(body: bytes) -> bytes:
    """One SSE body as a chunked response: one chunk, then the last chunk (written at once)."""
    return (b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncache-control: no-cache\r\n"
            b"transfer-encoding: chunked\r\n\r\n%x\r\n%s\r\n0\r\n\r\n" % (len(body), body))


def _completion(model: str, chat: bool) -> dict[str, object]:
    choice: dict[str, object]
    if chat:
        choice = {"index": 0, "message": {"role": "assistant", "content": _CONTENT}, "logprobs": None,
                  "finish_reason": "length"}
    else:
        choice = {"index": 0, "text": _CONTENT, "logprobs": None, "finish_reason": "length"}
    return {"id": "cheap", "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
            "model": model, "choices": [choice],
            "usage": {"prompt_tokens": 150, "completion_tokens": TOKENS, "total_tokens": 150 + TOKENS}}


def _sse(model: str, chat: bool) -> bytes:
    created = int(time.time())
    frames = []
    for i in range(TOKENS + 1):  # a role chunk (chat) or an empty first chunk, then one chunk per token
        last = i == TOKENS
        token = "" if i == 0 else f"tok{i - 1} "
        choice: dict[str, object] = ({"index": 0, "delta": {"role": "assistant", "content": token} if i == 0
                                      else {"content": token}, "logprobs": None} if chat
                                     else {"index": 0, "text": token, "logprobs": None})
        choice["finish_reason"] = "length" if last else None
        chunk = {"id": "cheap", "object": "chat.completion.chunk" if chat else "text_completion",
                 "created": created, "model": model, "choices": [choice]}
        frames.append(b"data: " + json.dumps(chunk, separators=(",", ":")).encode() + b"\n\n")
    frames.append(b"data: [DONE]\n\n")
    return b"".join(frames)


def vllm_handoff(engine_id: str, request_id: str) -> dict[str, object]:
    """The kv_transfer_params a vllm prefill worker answers with (vLLM 0.32's NixlConnector shape)."""
    return {
        "do_remote_prefill": True, "do_remote_decode": False, "remote_block_ids": [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10]],
        "remote_engine_id": engine_id, "remote_request_id": request_id, "remote_host": "127.0.0.1",
        "remote_port": 5600, "tp_size": 1, "dcp_size": 1, "pp_size": 1, "remote_num_tokens": 150,
        "remote_blocks_expiry_time": None, "transfer_mode": "pull", "remote_prefill_cached_tokens": 0}


class Worker:
    def __init__(self, engine: str, role: str, engine_id: str, bootstrap_port: int, model: str = "cheap") -> None:
        self.engine, self.role, self.engine_id = engine, role, engine_id.encode()
        self.counters = {"requests": 0, "producer": 0, "consumer": 0, "plain": 0}
        self.handoff_ids: set[bytes] = set()
        self.unknown_paths: set[str] = set()
        self._next_id = 0
        self._full = {chat: _response(200, json.dumps(_completion(model, chat)).encode()) for chat in (True, False)}
        self._stream = {chat: _chunked_stream(_sse(model, chat)) for chat in (True, False)}
        handoff_completion = _completion(model, True)
        handoff_completion["kv_transfer_params"] = vllm_handoff(engine_id, "@ID@")
        self._handoff_parts = json.dumps(handoff_completion).encode().split(b"@ID@")
        self._info = {
            "model_path": model, "served_model_name": model, "tp_size": 1, "dp_size": 1,
            "disaggregation_mode": role, "disaggregation_bootstrap_port": bootstrap_port, "version": "cheap",
        }

    def get(self, path: bytes) -> bytes:
        if path == b"/health" or path == b"/health_generate":
            return _response(200, b"")
        if path == b"/_cheap/counters":
            return _response(200, json.dumps({**self.counters, "handoff_ids": len(self.handoff_ids),
                                              "unknown_paths": sorted(self.unknown_paths)}).encode())
        if path == b"/v1/models":
            return _response(200, b'{"object":"list","data":[{"id":"cheap","object":"model","owned_by":"cheap"}]}')
        if path in (b"/server_info", b"/get_server_info", b"/get_model_info", b"/model_info"):
            return _response(200, json.dumps(self._info).encode())
        return self._unknown(path)

    def post(self, path: bytes, body: bytes) -> bytes:
        if path == b"/_cheap/reset":
            self.counters = dict.fromkeys(self.counters, 0)
            self.handoff_ids.clear()
            return _response(200, b"{}")
        chat = path == b"/v1/chat/completions"
        if not chat and path not in (b"/v1/completions", b"/generate"):
            return self._unknown(path)
        self.counters["requests"] += 1
        found = marks(body)
        stream = b"stream" in found
        if self.engine == "vllm":
            return self._vllm(body, found, chat, stream)
        marked = b"bootstrap_room" in found and (self.role == "prefill" or b"bootstrap_host" in found)
        self.counters["producer" if self.role == "prefill" and marked else
                      "consumer" if marked else "plain"] += 1
        return self._stream[chat] if stream else self._full[chat]

    def _vllm(self, body: bytes, found: dict[bytes, int], chat: bool, stream: bool) -> bytes:
        if self.role == "prefill" and b"do_remote_decode" in found:
            self.counters["producer"] += 1
            self._next_id += 1
            payload = self._handoff_parts[0] + b"cheap-%d" % self._next_id + self._handoff_parts[1]
            return _response(200, payload)
        consumer = found.get(b"do_remote_prefill") if self.role == "decode" else None
        if consumer is not None:
            # The handoff's other members sit in the same small object: read them near the mark, not in
            # the whole body (a long prompt would make the worker pay per byte, as the proxies do).
            near = body[max(0, consumer - HANDOFF_WINDOW):consumer + HANDOFF_WINDOW]
            engine = _ENGINE_ID.search(near)
            if engine is not None and engine.group(1) == self.engine_id:
                self.counters["consumer"] += 1
                request_id = _REQUEST_ID.search(near)
                if request_id is not None:
                    self.handoff_ids.add(request_id.group(1))
                return self._stream[chat] if stream else self._full[chat]
        self.counters["plain"] += 1
        return self._stream[chat] if stream else self._full[chat]

    def _unknown(self, path: bytes) -> bytes:
        text = path.decode("latin-1")
        if text not in self.unknown_paths:
            self.unknown_paths.add(text)
            sys.stderr.write(f"cheap worker: unknown path {text}\n")
        return _response(404, b'{"error":"not found"}')


class Connection(asyncio.Protocol):
    """HTTP/1.1 keep-alive, requests with Content-Length or chunked bodies, answered in order.

    A request's head is parsed once; a Content-Length body is then collected as the reads that carry it
    (no copy into a growing buffer, no re-scan per read) and joined once when complete.
    """

    def __init__(self, worker: Worker) -> None:
        self.worker = worker
        self.buffer = bytearray()  # bytes not yet parsed: heads, chunked bodies
        self.transport: asyncio.Transport | None = None
        self._request_line = b""
        self._body_parts: list[bytes] = []
        self._body_left = 0  # > 0 while a Content-Length body is being collected
        self._chunked_at: int | None = None  # where a chunked body starts in ``buffer`` while incomplete
        self._chunk_scanned = 0  # where to look for its last chunk from

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # uvloop's transports are not subclasses

    def data_received(self, data: bytes) -> None:
        replies: list[bytes] = []
        if self._body_left:
            data = self._collect(data, replies)
        if data:
            self.buffer += data
            self._parse(replies)
        if replies and self.transport is not None:
            self.transport.write(b"".join(replies))

    def _collect(self, data: bytes, replies: list[bytes]) -> bytes:
        """Take the current body's bytes from ``data``; what follows it (a pipelined request) is returned."""
        take = data if len(data) <= self._body_left else data[:self._body_left]
        self._body_parts.append(take)
        self._body_left -= len(take)
        if self._body_left:
            return b""
        parts, self._body_parts = self._body_parts, []
        replies.append(self._answer(self._request_line, parts[0] if len(parts) == 1 else b"".join(parts)))
        return data[len(take):] if len(take) < len(data) else b""

    def _parse(self, replies: list[bytes]) -> None:
        buffer = self.buffer
        while True:
            if self._chunked_at is not None:
                # Decode only once the last chunk may have come ("\r\n0\r\n" in the bytes not yet looked
                # at; the head's own CRLF precedes an empty body's): not every chunk again on every read.
                # Those bytes inside a chunk (JSON between tokens only) cost a decode per read, never a miss.
                last = buffer.find(b"\r\n0\r\n", self._chunk_scanned)
                if last < 0:
                    self._chunk_scanned = max(self._chunked_at - 2, len(buffer) - 4)
                    return
                self._chunk_scanned = last
                decoded = _dechunk(buffer, self._chunked_at)
                if decoded is None:
                    return
                body, consumed = decoded
                del buffer[:consumed]
                self._chunked_at = None
                replies.append(self._answer(self._request_line, body))
                continue
            end = buffer.find(b"\r\n\r\n")
            if end < 0:
                return
            head = bytes(buffer[:end])
            self._request_line, _, header_block = head.partition(b"\r\n")
            lowered = header_block.lower()
            body_start = end + 4
            length = 0
            at = lowered.find(b"content-length:")
            if at >= 0:
                line_end = lowered.find(b"\r\n", at)
                length = int(lowered[at + 15:line_end if line_end >= 0 else None])
            elif b"transfer-encoding: chunked" in lowered:
                self._chunked_at, self._chunk_scanned = body_start, body_start - 2
                continue
            if len(buffer) >= body_start + length:
                body = bytes(memoryview(buffer)[body_start:body_start + length])
                del buffer[:body_start + length]
                replies.append(self._answer(self._request_line, body))
                continue
            # The body's remaining bytes are collected by data_received as they come.
            self._body_parts = [bytes(memoryview(buffer)[body_start:])]
            self._body_left = length - len(self._body_parts[0])
            buffer.clear()
            return

    def _answer(self, request_line: bytes, body: bytes) -> bytes:
        method, _, rest = request_line.partition(b" ")
        path = rest.rpartition(b" ")[0].split(b"?", 1)[0]
        return self.worker.post(path, body) if method == b"POST" else self.worker.get(path)


def _dechunk(buffer: bytearray, start: int) -> tuple[bytes, int] | None:
    """(body, bytes consumed) of a complete chunked body starting at ``start``; None while incomplete."""
    parts: list[bytes] = []
    at = start
    while True:
        line_end = buffer.find(b"\r\n", at)
        if line_end < 0:
            return None
        size = int(bytes(buffer[at:line_end]).split(b";", 1)[0], 16)
        if size == 0:
            trailer_end = buffer.find(b"\r\n\r\n", line_end)
            if trailer_end < 0:
                return None
            return b"".join(parts), trailer_end + 4
        if len(buffer) < line_end + 2 + size + 2:
            return None
        parts.append(bytes(buffer[line_end + 2:line_end + 2 + size]))
        at = line_end + 2 + size + 2


async def _serve(worker: Worker, port: int) -> None:
    loop = asyncio.get_running_loop()
    server = await loop.create_server(lambda: Connection(worker), "127.0.0.1", port, backlog=4096)
    bound = server.sockets[0].getsockname()[1]
    sys.stdout.write(f"ready url=http://127.0.0.1:{bound}\n")
    sys.stdout.flush()
    async with server:
        await server.serve_forever()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--engine", choices=("vllm", "sglang"), default="vllm")
    parser.add_argument("--role", choices=("prefill", "decode"), required=True)
    parser.add_argument("--engine-id", default=DEFAULT_ENGINE_ID,
                        help="vllm: the prefill engine id (prefill names it, decode expects it)")
    parser.add_argument("--bootstrap-port", type=int, default=8998, help="sglang: what /server_info reports")
    parser.add_argument("--port", type=int, default=0)
    args = parser.parse_args(argv)
    worker = Worker(args.engine, args.role, args.engine_id, args.bootstrap_port)
    try:
        import uvloop
    except ImportError:
        asyncio.run(_serve(worker, args.port))
    else:
        uvloop.run(_serve(worker, args.port))
    return 0


if __name__ == "__main__":
    sys.exit(main())
