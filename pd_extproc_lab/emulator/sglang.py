"""An emulated SGLang 0.5.23 OpenAI server in PD disaggregation mode: a prefill worker (with its
bootstrap server) or a decode worker. Shapes follow SGLang's own source (PROTOCOL.md, "sglang").

Prefill (``--disaggregation-mode prefill``): a request must carry ``bootstrap_room`` (else 400, as the
scheduler refuses it). Its room is registered on the worker's bootstrap server and the request waits
until a decode worker claims the room (the KV "transfer"), then answers with its one token. No claim
within the bootstrap timeout: 500, "Prefill bootstrap failed ... timed out ... in KVPoll.Bootstrapping".
A client that disconnects aborts the request and frees the room.

Decode (``--disaggregation-mode decode``): a request with a room asks the prefill worker's bootstrap
server (``bootstrap_host:bootstrap_port``, or this worker's default port when the request has none)
for its parallel info (``GET /route``, as SGLang does), then claims the room, waiting for the prefill
request to register it. Only a room registered by a prefill request with the same prompt can be
claimed, and only once. Any failure answers like SGLang's decode: 500 "Decode handshake failed ...",
or an error event inside a stream. The bootstrap server's real routes (``/route``,
``/register_dp_rank``, ``/query_dp_ranks``, ``/health``) are served; the claim itself
(``/_emulator/claim``) stands in for the engines' ZMQ/RDMA exchange.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import secrets
import ssl
import time
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import orjson

from extproc.observability.httpserver import Request, Response
from extproc.protocol.settings_spec import read_token_file
from extproc.protocol.units import parse_duration
from pd_extproc_lab.emulator import common, text
from pd_extproc_lab.emulator.behaviour import Behaviour
from pd_extproc_lab.emulator.control import Control, Received
from pd_extproc_lab.emulator.http import Reply, StreamResponse

SGLANG_VERSION = "0.5.23"
DEFAULT_BOOTSTRAP_PORT = 8998
DEFAULT_MAX_TOKENS = 16
FAKE_BOOTSTRAP_HOST = "2.2.2.2"  # SGLang's warm-up/health requests: no transfer
ROUTE_ATTEMPTS = 3  # decode's retries of GET /route before it aborts the request
MODES = {"prefill": "prefill", "decode": "decode", "both": "null"}


def error_response(status: int, message: str, kind: str) -> Response:
    """SGLang's ErrorResponse: top-level, not wrapped in {"error": ...} (serving_base.py)."""
    return Response(status, orjson.dumps({"object": "error", "message": message, "type": kind, "param": None,
                                          "code": status}))


def bad_request(message: str) -> Response:
    return error_response(400, message, "BadRequest")


def stream_error_event(status: int, name: str, message: str) -> bytes:
    """create_streaming_error_response: Python json.dumps spacing, inside {"error": ...}."""
    error = {"object": "error", "message": message, "type": name, "param": None, "code": status}
    return b"data: " + json.dumps({"error": error}).encode() + b"\n\n"


# entrypoints/request_headers.py, _HEADER_OVERRIDES: header -> (field, cast), read only with
# SGLANG_ENABLE_REQUEST_HEADER_OVERRIDES=1 (environ.py, default False).
HEADER_OVERRIDES: dict[str, tuple[str, type]] = {
    "x-override-rid": ("rid", str),
    "x-override-bootstrap-host": ("bootstrap_host", str),
    "x-override-bootstrap-port": ("bootstrap_port", int),
    "x-override-bootstrap-room": ("bootstrap_room", int),
    "x-override-conversation-id": ("conversation_id", str),
    "x-override-routed-dp-rank": ("routed_dp_rank", int),
    "x-override-disagg-prefill-dp-rank": ("disagg_prefill_dp_rank", int),
    "x-override-priority": ("priority", int),
}


def apply_header_overrides(body: dict[str, Any], request: Request) -> Response | None:
    """request_headers.py, apply_header_overrides: each header present replaces its field; a value
    the cast refuses is a 400 (FastAPI's HTTPException detail)."""
    for header, (name, cast) in HEADER_OVERRIDES.items():
        value = request.header(header)
        if value is None:
            continue
        try:
            body[name] = cast(value)
        except ValueError as error:
            return Response(400, orjson.dumps({"detail": f"invalid {header} header {value!r}: {error}"}))
    return None


def _scalar(value: Any) -> Any:
    """SGLang accepts each bootstrap field as a scalar or a per-prompt list; one prompt here."""
    return value[0] if isinstance(value, list) and len(value) == 1 else value


@dataclass(frozen=True, kw_only=True)
class SglangBehaviour(Behaviour):
    delay_register: float | None = None  # seconds a prefill request waits before it registers its room


@dataclass
class Room:
    registered: asyncio.Event = field(default_factory=asyncio.Event)
    claimed: asyncio.Event = field(default_factory=asyncio.Event)
    prompt_sha: str = ""
    prompt_tokens: int = 0
    prefill_rid: str = ""
    claimed_by: str = ""
    aborted: bool = False


@dataclass
class Counters:
    transfers: int = 0
    failed_transfers: int = 0
    bootstrap_failures: int = 0
    rooms_registered: int = 0
    aborts: int = 0  # /abort_request calls that reached a request
    unauthorized: int = 0


class SglangEmulator:
    def __init__(self, role: str, model: str, worker_id: str, bootstrap_host: str, kv_timeout: float,
                 default_bootstrap_port: int = DEFAULT_BOOTSTRAP_PORT, api_key: str | None = None,
                 admin_api_key: str | None = None, header_overrides: bool = False) -> None:
        assert role in MODES
        self.role = role
        self.model = model
        self.worker_id = worker_id
        self.bootstrap_host = bootstrap_host
        self.bootstrap_port = default_bootstrap_port if role == "decode" else 0
        self.kv_timeout = kv_timeout
        self.port = 0
        self.rooms: dict[int, Room] = {}
        self.room_to_dp_rank: dict[int, int] = {}
        self.counters = Counters()
        self.api_key = api_key
        self.admin_api_key = admin_api_key
        self.header_overrides = header_overrides
        self.inflight: dict[str, asyncio.Event] = {}  # rid -> set when an abort reaches it
        self.server_info_overrides: dict[str, Any] = {}
        self.control = Control({"engine": "sglang", "role": role, "worker_id": worker_id, "model": model,
                                "version": SGLANG_VERSION}, SglangBehaviour)
        self.servers = common.EngineServers(self.control, self.handle, self.handle_bootstrap, kv_timeout + 10)

    @staticmethod
    def add_arguments(group: Any) -> None:
        group.add_argument("--kv-timeout", default="300s",
                           help="how long prefill waits for decode's claim and decode for prefill's room")
        group.add_argument("--api-key-file", default="", help="serve with --api-key (the file's token)")
        group.add_argument("--admin-api-key-file", default="", help="serve with --admin-api-key (the file's token)")
        group.add_argument("--request-header-overrides", action="store_true",
                           help="as with SGLANG_ENABLE_REQUEST_HEADER_OVERRIDES=1: x-override-* headers set fields")

    @classmethod
    def from_args(cls, args: Any) -> SglangEmulator:
        def key(path: str) -> str | None:
            return read_token_file(path).decode() if path else None

        return cls(args.role, args.model, args.worker_id, args.side_channel.host, parse_duration(args.kv_timeout),
                   api_key=key(args.api_key_file), admin_api_key=key(args.admin_api_key_file),
                   header_overrides=args.request_header_overrides)

    def _authorized(self, request: Request) -> bool:
        """utils/auth.py, ``decide_request_auth``: OPTIONS and /health*, /ready*, /metrics* are open;
        /abort_request is ADMIN_OPTIONAL (the admin key if set, else the API key if set, else open);
        every other endpoint is NORMAL (the API key if set, else open). ``_check_bearer_token``:
        "Bearer" in any case, one space, the key, compared with secrets.compare_digest."""
        if request.method == "OPTIONS" or request.path.startswith(("/health", "/ready", "/metrics")):
            return True
        admin = request.path == "/abort_request"
        expected = (self.admin_api_key or self.api_key) if admin else self.api_key
        if expected is None:
            return True
        parts = (request.header("authorization") or "").split(" ", 1)
        return len(parts) == 2 and parts[0].lower() == "bearer" and secrets.compare_digest(parts[1], expected)

    async def start(self, host: str, port: int, bootstrap_port: int, tls: ssl.SSLContext | None = None) -> int:
        serves_kv = self.role != "decode"
        self.port, side = await self.servers.start(host, port, tls,
                                                   (self.bootstrap_host, bootstrap_port) if serves_kv else None)
        if side is not None:
            self.bootstrap_port = side
        self.control.info.update({"port": self.port, "bootstrap_port": self.bootstrap_port})
        return self.port

    async def close(self) -> None:
        await self.servers.close()

    @property
    def side_port(self) -> int:
        return self.bootstrap_port

    # --- the HTTP server ---------------------------------------------------------------------------

    async def handle(self, request: Request) -> Reply:
        if request.path == "/_emulator/server_info" and request.method == "POST":
            self.server_info_overrides = orjson.loads(request.body)
            return Response(200, b"{}")
        if request.path == "/_emulator/reset" and request.method == "POST":
            self.server_info_overrides = {}
        control = await self.control.handle(request)
        if control is not None:
            return control
        if not self._authorized(request):
            self.counters.unauthorized += 1
            return Response(401, b'{"error":"Unauthorized"}')  # add_api_key_middleware
        if request.path == "/abort_request" and request.method == "POST":
            return self._abort(request)
        if request.path in ("/health", "/health_generate", "/ready"):
            return Response(200, b"")
        if request.path in ("/server_info", "/get_server_info"):
            return Response(200, orjson.dumps(self.server_info()))
        if request.path in ("/model_info", "/get_model_info"):
            return Response(200, orjson.dumps({"model_path": self.model, "served_model_name": self.model,
                                               "is_generation": True,
                                               "disaggregation_mode": MODES[self.role]}))
        if request.path == "/metrics":
            return Response(200, self.metrics().encode(), content_type="text/plain; version=0.0.4")
        if request.path == "/v1/models":
            return Response(200, orjson.dumps({"object": "list", "data": [
                {"id": self.model, "object": "model", "created": int(time.time()), "owned_by": "sglang",
                 "root": self.model, "max_model_len": 4096}]}))
        if request.method != "POST" or request.path not in _APIS:
            return Response(404, b'{"detail":"Not Found"}')
        return await self.control.answer(request, self._generate)

    def server_info(self) -> dict[str, Any]:
        """The keys of /server_info a router reads (build_server_info flattens ServerArgs)."""
        return {
            "model_path": self.model, "served_model_name": self.model, "host": "127.0.0.1", "port": self.port,
            "tp_size": 1, "dp_size": 1, "disaggregation_mode": MODES[self.role],
            "disaggregation_transfer_backend": "mooncake",
            "disaggregation_bootstrap_port": self.bootstrap_port or DEFAULT_BOOTSTRAP_PORT,
            "internal_states": [{}], "version": SGLANG_VERSION, "frontend": "python",
            # ServerArgs.resolved_dict(): the keys are not redacted (only the watermark secrets are).
            "api_key": self.api_key, "admin_api_key": self.admin_api_key,
            **self.server_info_overrides,
        }

    async def _generate(self, request: Request, received: Received) -> Reply:
        behaviour = self.control.next_behaviour(received)
        misbehaviour = await common.misbehave(self.control, behaviour, lambda status, message: error_response(
            status, message, str(status)))
        if misbehaviour is not None:
            return misbehaviour
        body = common.json_object(request.body)
        if isinstance(body, str):
            return bad_request("Invalid JSON body" if body == "not JSON" else "Invalid request body")
        api = _APIS[request.path]
        chat = api == "chat"
        if api == "generate":
            if body.get("text") is None and body.get("input_ids") is None:
                return bad_request("Either text, input_ids or input_embeds should be provided.")
        elif (chat and not isinstance(body.get("messages"), list)) or (not chat and "prompt" not in body):
            return bad_request("messages or prompt: Field required")
        if (chat or api == "generate") and self.header_overrides:  # serving_chat.py and serve_generate_request
            overridden = apply_header_overrides(body, request)
            if isinstance(overridden, Response):
                return overridden
        given = body.get("rid")
        rid = given if isinstance(given, str) else secrets.token_hex(16)
        if rid in self.inflight:  # tokenizer_manager.py, _init_req_state
            return error_response(400, f"Duplicate request ID detected: {rid}", "BadRequestError")
        self.inflight[rid] = asyncio.Event()
        try:
            return await self._serve(body, api, rid, received, behaviour)
        finally:
            del self.inflight[rid]

    async def _serve(self, body: dict[str, Any], api: str, rid: str, received: Received,
                     behaviour: SglangBehaviour) -> Reply:
        prompt = _prompt(body, api)
        room = _scalar(body.get("bootstrap_room"))
        host = _scalar(body.get("bootstrap_host"))
        received.notes.update(rid=rid, room=room)
        if self.role == "both" or host == FAKE_BOOTSTRAP_HOST:
            return self._answer(body, api, rid, prompt, _limit(body, api))
        if not isinstance(room, int) or isinstance(room, bool):
            if room is None:
                return bad_request("Invalid request: Disaggregated request received without bootstrap room id. "
                                   f"req.rid='{rid}'")
            return bad_request("bootstrap_room: Input should be a valid integer")
        if self.role == "prefill":
            return await self._prefill(body, api, rid, prompt, room, received, behaviour)
        port = _scalar(body.get("bootstrap_port")) or self.bootstrap_port
        return await self._decode(body, api, rid, prompt, (str(host), int(port), room), received)

    # --- prefill: register the room, wait for the decode worker's claim --------------------------------

    async def _prefill(self, body: dict[str, Any], api: str, rid: str, prompt: str, room: int,
                       received: Received, behaviour: SglangBehaviour) -> Reply:
        if behaviour.delay_register is not None:
            await asyncio.sleep(behaviour.delay_register)
        state = self.rooms.setdefault(room, Room())
        if state.registered.is_set():
            return bad_request(f"bootstrap_room {room} is already in use")
        state.prompt_sha = hashlib.sha256(prompt.encode()).hexdigest()
        state.prompt_tokens = text.count_tokens(prompt)
        state.prefill_rid = rid
        state.registered.set()
        self.room_to_dp_rank[room] = 0
        self.counters.rooms_registered += 1
        try:
            outcome = await _first(state.claimed.wait(), self.inflight[rid].wait(), self.kv_timeout)
        except TimeoutError:
            self.counters.bootstrap_failures += 1
            received.notes["transfer"] = "bootstrap timeout"
            message = (f"Prefill bootstrap failed for request rank=0 req.rid='{rid}' req.bootstrap_room={room} "
                       f"with exception Request {room} timed out after {self.kv_timeout:.1f}s in KVPoll.Bootstrapping")
            return error_response(500, message, "500")
        finally:
            state.aborted = not state.claimed.is_set()
            state.registered.set()
            if self.rooms.get(room) is state:
                del self.rooms[room]
            self.room_to_dp_rank.pop(room, None)
        if outcome == 1:  # aborted: prefill.py, handle_bootstrap_failure
            received.notes.update(transfer="aborted", aborted=True)
            message = (f"Prefill bootstrap failed for request rank=0 req.rid='{rid}' req.bootstrap_room={room} "
                       f"with exception KVTransferError(bootstrap_room={room}): Aborted by AbortReq.")
            return error_response(500, message, "500")
        received.notes.update(transfer="ok", claimed_by=state.claimed_by)
        return self._answer(body, api, rid, prompt, 1)

    # --- decode: find the prefill worker's bootstrap server, claim the room -----------------------------

    async def _decode(self, body: dict[str, Any], api: str, rid: str, prompt: str,
                      bootstrap: tuple[str, int, int], received: Received) -> Reply:
        host, port, room = bootstrap
        received.notes["bootstrap"] = {"host": host, "port": port, "room": room}
        pulled = await _first(self._pull(host, port, room, prompt, received), self.inflight[rid].wait(), None)
        if pulled == 1:  # decode.py, _update_handshake_waiters after kv_receiver.abort()
            received.notes["aborted"] = True
            problem: str | None = f"KVTransferError(bootstrap_room={room}): Aborted by AbortReq."
        else:
            assert isinstance(pulled, tuple)
            problem = pulled[1]
        if problem is None:
            self.counters.transfers += 1
            return self._answer(body, api, rid, prompt, _limit(body, api))
        self.counters.failed_transfers += 1
        received.notes["transfer"] = problem
        message = (f"Decode handshake failed for request rank=0 decode_req.req.rid='{rid}' "
                   f"decode_req.req.bootstrap_room={room} with exception {problem}")
        if body.get("stream") is True:
            return StreamResponse(_one_event(stream_error_event(500, "INTERNAL_SERVER_ERROR", message)))
        return error_response(500, message, "500")

    async def _pull(self, host: str, port: int, room: int, prompt: str, received: Received) -> str | None:
        """None when the room's KV arrived; otherwise what went wrong, in SGLang's words."""
        base = f"http://{common.authority(host, port)}"
        for _ in range(ROUTE_ATTEMPTS):
            try:
                async with self.servers.client.get(f"{base}/route", params={
                        "prefill_dp_rank": "-1", "prefill_cp_rank": "-1", "target_tp_rank": "-1",
                        "target_pp_rank": "-1"}) as route:
                    if route.status == 200:
                        break
            except (aiohttp.ClientError, OSError, TimeoutError):
                pass
        else:
            return f"Could not fetch prefill parallel info from {common.authority(host, port)} after " \
                   f"{ROUTE_ATTEMPTS} attempts"
        claim = {"room": room, "prompt_sha": hashlib.sha256(prompt.encode()).hexdigest(), "decode": self.worker_id,
                 "wait": self.kv_timeout}
        try:
            async with self.servers.client.post(f"{base}/_emulator/claim", data=orjson.dumps(claim)) as reply:
                answer = await reply.json(content_type=None)
        except (aiohttp.ClientError, OSError, TimeoutError, ValueError) as exc:
            return f"KV transfer from {common.authority(host, port)} failed: {type(exc).__name__}"
        if reply.status != 200:
            return str(answer.get("error", "KV transfer failed"))
        received.notes.update(transfer="ok", prefill_worker=answer.get("prefill_worker"))
        return None

    def _abort(self, request: Request) -> Response:
        """http_server.py ``abort_request`` -> scheduler.py ``Scheduler.abort_request``: every request whose
        rid *starts with* the given one is aborted; an unknown rid is a no-op (an abort that arrives before
        its request is forgotten). Always 200 with an empty body."""
        try:
            data = orjson.loads(request.body)
        except orjson.JSONDecodeError:
            return bad_request("abort_request: invalid JSON")
        rid = data.get("rid") if isinstance(data, dict) else None
        if isinstance(rid, str) and rid:
            for running, event in self.inflight.items():
                if running.startswith(rid) and not event.is_set():
                    event.set()
                    self.counters.aborts += 1
        return Response(200, b"", content_type="text/plain")

    # --- the bootstrap server (prefill) ---------------------------------------------------------------

    async def handle_bootstrap(self, request: Request) -> Reply:
        if request.path == "/health":
            return Response(200, b"OK", content_type="text/plain")
        if request.path == "/route" and request.method == "GET":
            return Response(200, orjson.dumps({
                "attn_tp_size": 1, "attn_cp_size": 1, "dp_size": 1, "pp_size": 1, "page_size": 1,
                "kv_cache_dtype": "auto", "follow_bootstrap_room": True, "enable_dsa_cache_layer_split": False,
                "enable_kv_cache_sharding": False, "prefill_http_port": self.port,
                "decode_allocation_policy": "early"}))
        if request.path == "/register_dp_rank" and request.method == "POST":
            data = orjson.loads(request.body)
            self.room_to_dp_rank[int(data["bootstrap_room"])] = int(data["dp_rank"])
            return Response(200, b"OK", content_type="text/plain")
        if request.path == "/query_dp_ranks" and request.method == "POST":
            rooms = [int(r) for r in orjson.loads(request.body)["bootstrap_rooms"]]
            return Response(200, orjson.dumps({str(r): self.room_to_dp_rank[r] for r in rooms
                                               if r in self.room_to_dp_rank}))
        if request.path == "/_emulator/claim" and request.method == "POST":
            return await self._claim(orjson.loads(request.body))
        return Response(404, b"Not Found", content_type="text/plain")

    async def _claim(self, claim: dict[str, Any]) -> Response:
        room = int(claim["room"])
        wait = float(claim.get("wait", self.kv_timeout))
        state = self.rooms.setdefault(room, Room())
        try:
            async with asyncio.timeout(wait):
                await state.registered.wait()
        except TimeoutError:
            if self.rooms.get(room) is state and not state.registered.is_set():
                del self.rooms[room]
            return _claim_error(408, f"Request {room} timed out after {wait:.1f}s in KVPoll.WaitingForInput")
        except asyncio.CancelledError:  # the decode request went away (an abort, its client left): forget
            # the room it was waiting for, as SGLang's decode drops an aborted receiver's state
            # (disaggregation/decode.py, _update_handshake_waiters after kv_receiver.abort())
            if self.rooms.get(room) is state and not state.registered.is_set():
                del self.rooms[room]
            raise
        if state.aborted:
            return _claim_error(410, f"Request {room} was aborted by the prefill worker")
        if state.claimed.is_set():
            return _claim_error(409, f"Request {room} was already transferred")
        if claim.get("prompt_sha") != state.prompt_sha:
            return _claim_error(409, f"Request {room}: the prefill worker computed the KV of another prompt")
        state.claimed_by = str(claim.get("decode", ""))
        state.claimed.set()
        return Response(200, orjson.dumps({"prefill_worker": self.worker_id, "prompt_tokens": state.prompt_tokens}))

    # --- responses ------------------------------------------------------------------------------------

    def _answer(self, body: dict[str, Any], api: str, rid: str, prompt: str, limit: int) -> Reply:
        tokens = text.generate(prompt, limit)
        prompt_tokens = text.count_tokens(prompt)
        if api == "generate":
            if body.get("stream") is True:
                return StreamResponse(_native_stream(rid, tokens, prompt_tokens))
            return Response(200, orjson.dumps(_native_answer(rid, tokens, prompt_tokens, len(tokens))),
                            headers=[(common.WORKER_HEADER, self.worker_id)])
        chat = api == "chat"
        if body.get("stream") is True:
            return StreamResponse(self._stream(rid, chat, tokens, prompt_tokens, common.include_usage(body)))
        usage = _usage(prompt_tokens, len(tokens))
        content = "".join(tokens)
        choice: dict[str, Any] = {"index": 0}
        if chat:
            choice["message"] = {"role": "assistant", "content": content, "reasoning_content": None}
        else:
            choice["text"] = content
        choice.update(logprobs=None, finish_reason="length", matched_stop=None)
        payload = {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
                   "model": self.model, "choices": [choice], "usage": usage, "metadata": None}
        return Response(200, orjson.dumps(payload), headers=[(common.WORKER_HEADER, self.worker_id)])

    async def _stream(self, rid: str, chat: bool, tokens: list[str], prompt_tokens: int,
                      usage: bool) -> AsyncIterator[bytes]:
        created = int(time.time())
        kind = "chat.completion.chunk" if chat else "text_completion"

        def chunk(piece: dict[str, Any], finish: str | None) -> bytes:
            choice = {"index": 0, **piece, "logprobs": None, "finish_reason": finish, "matched_stop": None}
            event = {"id": rid, "object": kind, "created": created, "model": self.model, "choices": [choice],
                     "usage": None}
            return b"data: " + orjson.dumps(event) + b"\n\n"

        if chat:
            yield chunk({"delta": {"role": "assistant", "content": "", "reasoning_content": None}}, None)
        for i, token in enumerate(tokens):
            finish = "length" if i == len(tokens) - 1 else None
            piece = {"delta": {"role": None, "content": token, "reasoning_content": None}} if chat else {"text": token}
            yield chunk(piece, finish)
        if usage:
            event = {"id": rid, "object": kind, "created": created, "model": self.model, "choices": [],
                     "usage": _usage(prompt_tokens, len(tokens))}
            yield b"data: " + orjson.dumps(event) + b"\n\n"
        yield b"data: [DONE]\n\n"

    def metrics(self) -> str:
        c = self.counters
        labels = f'{{model_name="{self.model}"}}'
        return "\n".join([
            *(f"# TYPE {name} gauge\n{name}{labels} {self.control.gauge(name)}"
              for name in ("sglang:num_queue_reqs", "sglang:num_decode_prealloc_queue_reqs")),
            "# TYPE emulator_kv_transfers counter", f"emulator_kv_transfers_total{labels} {float(c.transfers)}",
            "# TYPE emulator_kv_transfer_failures counter",
            f"emulator_kv_transfer_failures_total{labels} {float(c.failed_transfers)}",
            "# TYPE emulator_bootstrap_failures counter",
            f"emulator_bootstrap_failures_total{labels} {float(c.bootstrap_failures)}",
            "# TYPE emulator_rooms_registered counter",
            f"emulator_rooms_registered_total{labels} {float(c.rooms_registered)}",
            "# TYPE emulator_rooms_open gauge", f"emulator_rooms_open{labels} {float(len(self.rooms))}",
            "# TYPE emulator_aborts counter", f"emulator_aborts_total{labels} {float(c.aborts)}",
            "# TYPE emulator_unauthorized counter", f"emulator_unauthorized_total{labels} {float(c.unauthorized)}",
        ]) + "\n"


def _usage(prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
    return {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens + completion_tokens,
            "completion_tokens": completion_tokens, "prompt_tokens_details": None, "reasoning_tokens": 0,
            "completion_tokens_details": None}


def _claim_error(status: int, message: str) -> Response:
    return Response(status, orjson.dumps({"error": message}))


async def _first(work: Awaitable[Any], aborted: Awaitable[Any], within: float | None) -> Any:
    """(0, work's result) if the work finishes first, 1 if the abort comes first; TimeoutError after
    ``within`` seconds. The loser is cancelled."""
    tasks = [asyncio.ensure_future(work), asyncio.ensure_future(aborted)]
    try:
        done, _ = await asyncio.wait(tasks, timeout=within, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in tasks:
            if not task.done():
                task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    if not done:
        raise TimeoutError
    return (0, tasks[0].result()) if tasks[0] in done else 1


async def _one_event(event: bytes) -> AsyncIterator[bytes]:
    yield event
    yield b"data: [DONE]\n\n"


# --- SGLang's native /generate (srt/entrypoints/http_server.py generate_request) ------------------------

_APIS = {"/v1/chat/completions": "chat", "/v1/completions": "completions", "/generate": "generate"}


def _prompt(body: dict[str, Any], api: str) -> str:
    if api == "generate":  # io_struct.py GenerateReqInput: ``text`` or token ``input_ids``
        given = body.get("text")
        return str(given) if given is not None else text.completion_prompt(body.get("input_ids"))
    return common.prompt_text(body, api == "chat")


def _limit(body: dict[str, Any], api: str) -> int:
    if api == "generate":  # sampling_params.py SamplingParams: max_new_tokens
        params = body.get("sampling_params")
        value = params.get("max_new_tokens") if isinstance(params, dict) else None
        return value if isinstance(value, int) and not isinstance(value, bool) else DEFAULT_MAX_TOKENS
    return common.max_tokens(body, api == "chat", DEFAULT_MAX_TOKENS)


def _native_answer(rid: str, tokens: list[str], prompt_tokens: int, done: int) -> dict[str, Any]:
    """tokenizer_manager.py's output dict: the text so far, and meta_info whose finish_reason is
    schedule_batch.py FINISH_LENGTH.to_json() once the request ends (null before)."""
    finished = done == len(tokens)
    return {"text": "".join(tokens[:done]), "output_ids": [text_id(t) for t in tokens[:done]],
            "meta_info": {"id": rid, "finish_reason": {"type": "length", "length": len(tokens)} if finished else None,
                          "prompt_tokens": prompt_tokens, "completion_tokens": done, "cached_tokens": 0}}


def text_id(token: str) -> int:
    """The emulated vocabulary's id of a generated token."""
    return int.from_bytes(hashlib.sha256(token.encode()).digest()[:2], "big")


async def _native_stream(rid: str, tokens: list[str], prompt_tokens: int) -> AsyncIterator[bytes]:
    """http_server.py stream_results: ``data: <output>`` per step (the text so far), then ``data: [DONE]``."""
    for done in range(1, len(tokens) + 1):
        yield b"data: " + orjson.dumps(_native_answer(rid, tokens, prompt_tokens, done)) + b"\n\n"
    yield b"data: [DONE]\n\n"
