"""An emulated vLLM OpenAI server with the NIXL pull connector, as a prefill (kv_producer) or decode
(kv_consumer) worker. Wire shapes follow vLLM 0.32 (PROTOCOL.md, "vllm_nixl" and "Emulators").

Prefill: a request whose kv_transfer_params has do_remote_decode=true is answered with the full
14-field handoff, and the "blocks" it names are leased on the worker's side channel until a decode
worker pulls them or the lease expires (kv_lease_duration, 30 s by default, as in vLLM >= 0.22).

Decode: a request whose handoff has do_remote_prefill=true pulls those blocks from the producer's
side channel (remote_host:remote_port), exactly once. Like a real decode worker with
kv_load_failure_policy=fail, a handoff that cannot be loaded fails the request (HTTP 500, or an
error event inside a stream) instead of silently recomputing. Successful pulls are counted on
/metrics under vLLM's own metric names.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import secrets
import ssl
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import orjson

from extproc.observability.httpserver import Request, Response
from extproc.protocol.units import parse_duration
from pd_extproc_lab.emulator import common, text, vllm_apis
from pd_extproc_lab.emulator.behaviour import Behaviour
from pd_extproc_lab.emulator.control import Control, Received
from pd_extproc_lab.emulator.http import RawResponse, Reply, StreamResponse

VLLM_VERSION = "0.32.0"
FINGERPRINT = f"vllm-{VLLM_VERSION}-emulated"
DEFAULT_MAX_TOKENS = 16
REQUIRED_FOR_LOAD = ("remote_block_ids", "remote_engine_id", "remote_request_id", "remote_host", "remote_port")


MAX_MODEL_LEN = 4096  # what /v1/models reports; a prompt longer than this is refused like vLLM


def _error_object(status: int, message: str, kind: str, param: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}


def error_json(status: int, message: str, kind: str, param: str | None = None) -> bytes:
    return orjson.dumps(_error_object(status, message, kind, param))


def context_length_error(prompt_tokens: int) -> Response:
    """vLLM 0.32's answer to a prompt over max_model_len: renderers/params.py ``_token_len_check``
    raises VLLMValidationError(parameter="input_tokens"), which serve/exception_handling/error_response.py
    ``create_error_response`` renders as a 400 BadRequestError with that param."""
    message = (f"This model's maximum context length is {MAX_MODEL_LEN} tokens. However, your prompt "
               f"contains {prompt_tokens} input tokens, which exceeds this limit even without any output "
               "tokens. Please reduce the length of the input prompt.")
    return Response(400, error_json(400, message, "BadRequestError", "input_tokens"))


def _bad_request(message: str) -> Response:
    return Response(400, error_json(400, message, "BadRequestError"))


class _Keep:
    """The handoff as the producer made it (the default of VllmBehaviour.kv_transfer_params)."""

    def __repr__(self) -> str:
        return "KEEP"


KEEP: Any = _Keep()


@dataclass(frozen=True, kw_only=True)
class VllmBehaviour(Behaviour):
    echo_request: bool = False  # with status: the error quotes the request, like engines that do
    sse_raw: str | None = None  # answer these bytes as an event stream
    chunking: str = "event"  # how a stream is cut into writes: event | byte
    token_interval: float = 0.0  # seconds between stream writes
    chunked_pad_bytes: int | None = None  # a chunked JSON body of about this many bytes
    raw_body: str | None = None  # answer these bytes, status 200
    content_type: str = "application/json"  # of raw_body
    stall_after_headers: bool = False  # send the response head, then nothing
    drip_interval: float | None = None  # send the body one byte every so many seconds
    truncate: bool = False  # cut the body mid-JSON and close
    kv_transfer_params: Any = KEEP  # replace the producer's handoff with this value (null included)
    sse: bool = False  # answer as a stream even without stream: true
    omit_kv_transfer_params: bool = False  # leave the handoff out of the answer
    pad_bytes: int | None = None  # add a padding field of this many bytes
    kv_set: dict[str, Any] = field(default_factory=dict)  # edit fields of the handoff
    kv_remove: list[str] = field(default_factory=list)  # drop fields of the handoff


@dataclass(slots=True)
class Lease:
    engine_id: str
    block_ids: Any
    expires: float


@dataclass
class Counters:
    transfers: int = 0
    transfer_seconds: float = 0.0
    failed_transfers: int = 0
    expired_leases: int = 0
    recomputed: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    leases_granted: int = 0
    leases_freed: int = 0
    requests_ok: int = 0
    pulls_served: int = 0
    pulls_refused: int = 0
    notes: dict[str, int] = field(default_factory=dict)


class VllmEmulator:
    def __init__(self, role: str, model: str, worker_id: str, side_host: str, block_size: int,
                 lease_seconds: float) -> None:
        assert role in ("prefill", "decode", "both")
        self.role = role
        self.model = model
        self.worker_id = worker_id
        self.engine_id = f"{secrets.token_hex(4)}-{secrets.token_hex(2)}-{secrets.token_hex(2)}-" \
                         f"{secrets.token_hex(2)}-{secrets.token_hex(6)}"
        self.side_host = side_host
        self.side_port = 0
        self.block_size = block_size
        self.lease_seconds = lease_seconds
        self.counters = Counters()
        self.leases: dict[str, Lease] = {}
        self.stored_responses: dict[str, dict[str, Any]] = {}  # /v1/responses with store (see _generate_api)
        self._next_block = 1
        self.control = Control({"engine": "vllm", "role": role, "worker_id": worker_id,
                                "engine_id": self.engine_id, "model": model}, VllmBehaviour)
        self.servers = common.EngineServers(self.control, self.handle, self.handle_side_channel, 30.0)

    @staticmethod
    def add_arguments(group: Any) -> None:
        group.add_argument("--block-size", type=int, default=16, help="KV block size (tokens per block)")
        group.add_argument("--lease", default="30s", help="how long a producer holds unread KV blocks")

    @classmethod
    def from_args(cls, args: Any) -> VllmEmulator:
        return cls(args.role, args.model, args.worker_id, args.side_channel.host, args.block_size,
                   parse_duration(args.lease))

    async def start(self, host: str, port: int, side_port: int, tls: ssl.SSLContext | None = None) -> int:
        serves_kv = self.role != "decode"
        bound, side = await self.servers.start(host, port, tls, (self.side_host, side_port) if serves_kv else None)
        self.side_port = side or 0
        self.control.info.update({"side_channel_port": self.side_port, "port": bound})
        return bound

    async def close(self) -> None:
        await self.servers.close()

    # --- the OpenAI surface -------------------------------------------------------------------------

    async def handle(self, request: Request) -> Reply:
        control = await self.control.handle(request)
        if control is not None:
            return control
        if request.path == "/health":
            return Response(200, b"")
        if request.path == "/metrics":
            return Response(200, self.metrics().encode(), content_type="text/plain; version=0.0.4")
        return await self.control.answer(request, self._generate)

    async def _generate(self, request: Request, received: Received) -> Reply:
        if request.path == "/v1/models":  # recorded too: tests see the readiness probe
            return Response(200, orjson.dumps({"object": "list", "data": [
                {"id": self.model, "object": "model", "owned_by": "vllm", "max_model_len": MAX_MODEL_LEN}]}))
        if request.method == "GET" and request.path.startswith("/v1/responses/"):
            stored = self.stored_responses.get(request.path.rsplit("/", 1)[1])
            return Response(200, orjson.dumps(stored)) if stored is not None else \
                Response(404, error_json(404, "Response not found", "NotFoundError"))
        api = vllm_apis.APIS.get(request.path)
        if request.method != "POST" or (api is None and request.path not in ("/v1/chat/completions",
                                                                             "/v1/completions")):
            return Response(404, error_json(404, "Not Found", "NotFoundError"))
        behaviour = self.control.next_behaviour(received)
        misbehaviour = await self._misbehave(behaviour, request)
        if misbehaviour is not None:
            return misbehaviour
        if api is not None:
            return await self._generate_api(api, request, received, behaviour)
        body = common.json_object(request.body)
        if isinstance(body, str):
            return _bad_request("Invalid JSON body" if body == "not JSON" else "Invalid request body")
        chat = request.path == "/v1/chat/completions"
        problem = self._validate(body, chat)
        if problem is not None:
            return problem
        prompt = text.chat_prompt(body.get("messages")) if chat else text.completion_prompt(body.get("prompt"))
        prompt_tokens = text.count_tokens(prompt)
        if prompt_tokens > MAX_MODEL_LEN:
            return context_length_error(prompt_tokens)
        params = body.get("kv_transfer_params")
        params = params if isinstance(params, dict) else None
        handoff: Any = None
        load_error = False
        if params and params.get("do_remote_decode"):
            handoff = self._grant_lease(prompt_tokens, received, behaviour)
        elif params and params.get("do_remote_prefill"):
            load_error = not await self._pull(params, received)
        else:
            self.counters.recomputed += 1
        limit = self._max_tokens(body, chat)
        tokens = text.generate(prompt, limit)
        self.counters.prompt_tokens += prompt_tokens
        if load_error:
            if body.get("stream") is True:
                return StreamResponse(self._error_stream(chat), status=200)
            return Response(500, error_json(500, "Internal server error", "InternalServerError"))
        self.counters.generation_tokens += len(tokens)
        self.counters.requests_ok += 1
        request_id = ("chatcmpl-" if chat else "cmpl-") + secrets.token_hex(8)
        if behaviour.kv_transfer_params is not KEEP:
            handoff = behaviour.kv_transfer_params
        if body.get("stream") is True or behaviour.sse:
            include_usage = isinstance(body.get("stream_options"), dict) and \
                body["stream_options"].get("include_usage") is True
            return StreamResponse(self._stream(request_id, chat, tokens, prompt_tokens, include_usage,
                                               behaviour))
        payload = self._full_response(request_id, chat, tokens, prompt_tokens)
        if handoff is not None or behaviour.kv_transfer_params is not KEEP:
            payload["kv_transfer_params"] = handoff
        if behaviour.omit_kv_transfer_params:
            payload.pop("kv_transfer_params", None)
        if behaviour.pad_bytes:
            payload["padding"] = "x" * behaviour.pad_bytes
        return Response(200, orjson.dumps(payload), headers=[("x-emulator-worker", self.worker_id)])

    async def _generate_api(self, api: vllm_apis.Api, request: Request, received: Received,
                            behaviour: VllmBehaviour) -> Reply:
        """The Messages, Responses and generate APIs: the same KV side as chat, each API's own shapes."""
        body = common.json_object(request.body)
        if isinstance(body, str):
            return Response(400, api.error(400, "Invalid request body", "BadRequestError"))
        problem = api.check(body)
        if problem is not None:
            return Response(400, api.error(400, problem, "BadRequestError"))
        prompt = api.prompt(body)
        prompt_tokens = text.count_tokens(prompt)
        if prompt_tokens > MAX_MODEL_LEN:
            return Response(400, api.error(400, "prompt too long", "BadRequestError", "input_tokens"))
        params = body.get("kv_transfer_params")
        params = params if isinstance(params, dict) else None
        handoff: Any = None
        if params and params.get("do_remote_decode"):
            handoff = self._grant_lease(prompt_tokens, received, behaviour)
        elif params and params.get("do_remote_prefill"):
            if not await self._pull(params, received):
                return Response(500, api.error(500, "Internal server error", "InternalServerError"))
        else:
            self.counters.recomputed += 1
        tokens = text.generate(prompt, api.max_tokens(body))
        self.counters.prompt_tokens += prompt_tokens
        self.counters.generation_tokens += len(tokens)
        self.counters.requests_ok += 1
        if behaviour.kv_transfer_params is not KEEP:
            handoff = behaviour.kv_transfer_params
        if body.get("stream") is True or behaviour.sse:
            frames = b"".join(api.stream(self.model, tokens, prompt_tokens, body))
            return StreamResponse(_pieces(frames, behaviour.chunking, behaviour.token_interval))
        payload = api.full(self.model, tokens, prompt_tokens, body)
        if handoff is not None or behaviour.kv_transfer_params is not KEEP:
            payload["kv_transfer_params"] = handoff
        if behaviour.omit_kv_transfer_params:
            payload.pop("kv_transfer_params", None)
        # As vLLM with VLLM_ENABLE_RESPONSES_API_STORE=1 (openai/responses/serving.py
        # responses_full_generator): a response whose request did not say store=false is kept.
        if isinstance(api, vllm_apis.Responses) and body.get("store") is not False:
            self.stored_responses[payload["id"]] = payload
        return Response(200, orjson.dumps(payload), headers=[("x-emulator-worker", self.worker_id)])

    def _validate(self, body: dict[str, Any], chat: bool) -> Response | None:
        stream = body.get("stream")
        if body.get("stream_options") is not None and stream is not True:
            return _bad_request("Stream options can only be defined when `stream=True`.")
        n = body.get("n")
        if n is not None and (not isinstance(n, int) or n < 1):
            return _bad_request("n must be at least 1")
        min_tokens = body.get("min_tokens")
        limit = self._max_tokens(body, chat)
        if isinstance(min_tokens, int) and min_tokens > limit:
            return _bad_request("min_tokens must be less than or equal to max_tokens")
        if chat and not isinstance(body.get("messages"), list):
            return _bad_request("messages: Field required")
        if not chat and "prompt" not in body:
            return _bad_request("prompt: Field required")
        return None

    @staticmethod
    def _max_tokens(body: dict[str, Any], chat: bool) -> int:
        if chat and isinstance(body.get("max_completion_tokens"), int):
            return int(body["max_completion_tokens"])
        if isinstance(body.get("max_tokens"), int):
            return int(body["max_tokens"])
        return DEFAULT_MAX_TOKENS

    async def _misbehave(self, behaviour: VllmBehaviour, request: Request) -> Reply | None:
        """Scripted failures, before any normal processing."""
        if behaviour.delay is not None:
            await asyncio.sleep(behaviour.delay)
        if behaviour.hold:
            await self.control.held()
        if behaviour.hang:
            await asyncio.Event().wait()
        if behaviour.status is not None:
            status = behaviour.status
            message = "emulated failure"
            if behaviour.echo_request:  # like an engine that quotes the request in its error
                message += ": " + request.body.decode(errors="replace")
            return Response(status, error_json(status, message, "EmulatedError"))
        if behaviour.sse_raw is not None:
            return StreamResponse(_pieces(behaviour.sse_raw.encode(), behaviour.chunking, behaviour.token_interval))
        if behaviour.chunked_pad_bytes is not None:
            return StreamResponse(_chunked_json(behaviour.chunked_pad_bytes), content_type="application/json")
        if behaviour.raw_body is not None:
            return Response(200, behaviour.raw_body.encode(), content_type=behaviour.content_type)
        if behaviour.close:
            return RawResponse(_close_at_once)
        if behaviour.stall_after_headers:
            return RawResponse(_stall_after_headers)
        if behaviour.drip_interval is not None:
            interval = behaviour.drip_interval
            return RawResponse(lambda writer: _drip(writer, interval))
        if behaviour.truncate:
            return RawResponse(_truncate)
        return None

    # --- responses --------------------------------------------------------------------------------

    def _usage(self, prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
        """The usage object of a stream's usage chunk; a full response adds the (null) details."""
        return {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens + completion_tokens,
                "completion_tokens": completion_tokens}

    def _full_response(self, request_id: str, chat: bool, tokens: list[str],
                       prompt_tokens: int) -> dict[str, Any]:
        content = "".join(tokens)
        choice: dict[str, Any]
        if chat:  # vLLM 0.32 leaves an empty tool_calls out of the message
            choice = {"index": 0, "message": {"role": "assistant", "content": content, "refusal": None,
                                              "annotations": None, "audio": None, "function_call": None,
                                              "reasoning": None},
                      "logprobs": None, "finish_reason": "length", "stop_reason": None, "token_ids": None,
                      "routed_experts": None}
        else:
            choice = {"index": 0, "text": content, "logprobs": None, "finish_reason": "length",
                      "stop_reason": None, "token_ids": None, "prompt_logprobs": None,
                      "prompt_token_ids": None, "routed_experts": None}
        response: dict[str, Any] = {
            "id": request_id,
            "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()),
            "model": self.model,
            "choices": [choice],
            "service_tier": None,
            "system_fingerprint": FINGERPRINT,
            "usage": {**self._usage(prompt_tokens, len(tokens)), "prompt_tokens_details": None,
                      "completion_tokens_details": None},
        }
        if chat:  # prompt echo fields are top-level on chat, per choice on completions
            response.update(prompt_logprobs=None, prompt_token_ids=None, prompt_text=None)
        response.update(kv_transfer_params=None, ec_transfer_params=None, metrics=None)
        return response

    async def _stream(self, request_id: str, chat: bool, tokens: list[str], prompt_tokens: int,
                      include_usage: bool, behaviour: VllmBehaviour) -> AsyncIterator[bytes]:
        created = int(time.time())
        kind = "chat.completion.chunk" if chat else "text_completion"
        interval = behaviour.token_interval
        # Chunks as vLLM 0.32 writes them: chat opens with a role chunk carrying the (null) prompt echo
        # fields; the finishing chunk adds stop_reason and, without a usage chunk, the fingerprint; the
        # usage chunk has no choices, the three counts, and the fingerprint.
        chunks: list[dict[str, Any]] = []
        if chat:
            chunks.append(self._role_chunk(request_id, created))
        for i, token in enumerate(tokens):
            last = i == len(tokens) - 1
            if chat:
                choice: dict[str, Any] = {"index": 0, "delta": {"content": token}, "logprobs": None,
                                          "finish_reason": "length" if last else None,
                                          **({"stop_reason": None} if last else {}), "token_ids": None}
            else:
                choice = {"index": 0, "text": token, "logprobs": None, "finish_reason": "length" if last else None,
                          "stop_reason": None, "prompt_token_ids": None, "token_ids": None}
            chunk: dict[str, Any] = {"id": request_id, "object": kind, "created": created, "model": self.model,
                                     "choices": [choice]}
            if last and not include_usage:
                chunk["system_fingerprint"] = FINGERPRINT
            chunks.append(chunk)
        if include_usage:
            chunks.append({"id": request_id, "object": kind, "created": created, "model": self.model, "choices": [],
                           "usage": self._usage(prompt_tokens, len(tokens)), "system_fingerprint": FINGERPRINT})
        frames = [b"data: " + orjson.dumps(chunk) + b"\n\n" for chunk in chunks]
        frames.append(b"data: [DONE]\n\n")
        async for piece in _pieces(b"".join(frames), behaviour.chunking, interval):
            yield piece

    def _role_chunk(self, request_id: str, created: int) -> dict[str, Any]:
        return {"id": request_id, "object": "chat.completion.chunk", "created": created, "model": self.model,
                "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                             "finish_reason": None}],
                "prompt_token_ids": None, "prompt_text": None}

    async def _error_stream(self, chat: bool) -> AsyncIterator[bytes]:
        """A failed KV load inside a stream, as vLLM 0.32 writes it: chat's role chunk first, then the
        error event (Python's json.dumps spacing, unlike the compact chunks), then [DONE]."""
        if chat:
            request_id = "chatcmpl-" + secrets.token_hex(8)
            yield b"data: " + orjson.dumps(self._role_chunk(request_id, int(time.time()))) + b"\n\n"
        error = _error_object(500, "Internal server error", "InternalServerError")
        yield b"data: " + json.dumps(error).encode() + b"\n\n"
        yield b"data: [DONE]\n\n"

    # --- the NIXL side -----------------------------------------------------------------------------

    def _grant_lease(self, prompt_tokens: int, received: Received, behaviour: VllmBehaviour) -> dict[str, Any]:
        """Hold the prompt's blocks for a consumer and describe them. Scripted edits (kv_set,
        kv_remove) apply before the lease is recorded, so a consumer can pull an edited handoff."""
        self._reap_leases()
        blocks = -(-prompt_tokens // self.block_size)
        block_ids = [[self._next_block + i for i in range(blocks)]]
        self._next_block += blocks
        handoff = _edit_handoff(self._handoff(prompt_tokens, block_ids), behaviour)
        request_id = str(handoff.get("remote_request_id"))
        self.leases[request_id] = Lease(str(handoff.get("remote_engine_id")), handoff.get("remote_block_ids"),
                                        time.monotonic() + self.lease_seconds)
        self.counters.leases_granted += 1
        received.notes["remote_request_id"] = request_id
        received.notes["kv_transfer_params"] = handoff
        return handoff

    def _handoff(self, prompt_tokens: int, block_ids: list[list[int]]) -> dict[str, Any]:
        return {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_block_ids": block_ids,
            "remote_engine_id": self.engine_id,
            "remote_request_id": f"cmpl-{secrets.token_hex(8)}-0-{secrets.token_hex(4)}",
            "remote_host": self.side_host,
            "remote_port": self.side_port,
            "tp_size": 1,
            "dcp_size": 1,
            "pp_size": 1,
            "remote_num_tokens": prompt_tokens,
            "remote_blocks_expiry_time": None,
            "transfer_mode": "pull",
            "remote_prefill_cached_tokens": 0,
        }

    def _reap_leases(self) -> None:
        now = time.monotonic()
        for request_id in [r for r, lease in self.leases.items() if lease.expires <= now]:
            del self.leases[request_id]
            self.counters.expired_leases += 1

    async def _pull(self, params: dict[str, Any], received: Received) -> bool:
        """Load the handoff's blocks from the producer, once. False means the load failed."""
        received.notes["handoff"] = params
        if not params.get("remote_block_ids") or any(key not in params for key in REQUIRED_FOR_LOAD):
            received.notes["load"] = "invalid kv_transfer_params"
            self.counters.failed_transfers += 1
            return False
        host, port = params["remote_host"], params["remote_port"]
        started = time.perf_counter()
        try:
            authority = f"[{host}]:{port}" if ":" in str(host) else f"{host}:{port}"
            async with self.servers.client.post(f"http://{authority}/pull", data=orjson.dumps({
                "engine_id": params["remote_engine_id"], "request_id": params["remote_request_id"],
                "block_ids": params["remote_block_ids"], "consumer": self.worker_id})) as reply:
                await reply.read()
            ok = reply.status == 200
            received.notes["load"] = "ok" if ok else f"producer refused: {reply.status}"
        except (aiohttp.ClientError, OSError, TimeoutError, ValueError, TypeError) as exc:
            ok = False
            received.notes["load"] = f"side channel unreachable: {type(exc).__name__}"
        if ok:
            self.counters.transfers += 1
            self.counters.transfer_seconds += time.perf_counter() - started
        else:
            self.counters.failed_transfers += 1
        return ok

    async def handle_side_channel(self, request: Request) -> Reply:
        """The producer's side channel: a consumer pulls (reads and releases) a lease's blocks."""
        self._reap_leases()
        try:
            pull = orjson.loads(request.body)
            lease = self.leases.get(pull["request_id"])
            valid = (lease is not None and pull["engine_id"] == lease.engine_id
                     and pull["block_ids"] == lease.block_ids)
        except (orjson.JSONDecodeError, KeyError, TypeError):
            valid = False
        if not valid:
            self.counters.pulls_refused += 1
            return Response(404, b'{"error":"unknown request, engine or blocks"}')
        del self.leases[pull["request_id"]]
        self.counters.leases_freed += 1
        self.counters.pulls_served += 1
        return Response(200, b"{}")

    def metrics(self) -> str:
        # vLLM frees an expired lease in its engine loop, not when the next request arrives (NIXL
        # connector, nixl_connector.py: get_finished() checks _reqs_to_send against each expiry every step).
        self._reap_leases()
        c = self.counters
        labels = f'{{engine="0",model_name="{self.model}"}}'
        lines = [
            "# TYPE vllm:nixl_xfer_time_seconds histogram",
            f"vllm:nixl_xfer_time_seconds_count{labels} {float(c.transfers)}",
            f"vllm:nixl_xfer_time_seconds_sum{labels} {c.transfer_seconds}",
            "# TYPE vllm:nixl_num_failed_transfers counter",
            f"vllm:nixl_num_failed_transfers_total{labels} {float(c.failed_transfers)}",
            "# TYPE vllm:nixl_num_kv_expired_reqs counter",
            f"vllm:nixl_num_kv_expired_reqs_total{labels} {float(c.expired_leases)}",
            "# TYPE vllm:prompt_tokens counter",
            f"vllm:prompt_tokens_total{labels} {float(c.prompt_tokens)}",
            "# TYPE vllm:generation_tokens counter",
            f"vllm:generation_tokens_total{labels} {float(c.generation_tokens)}",
            "# TYPE vllm:num_requests_waiting gauge",
            f"vllm:num_requests_waiting{labels} {self.control.gauge('vllm:num_requests_waiting')}",
            "# TYPE emulator_recomputed_prompts counter",
            f"emulator_recomputed_prompts_total{labels} {float(c.recomputed)}",
            "# TYPE emulator_stored_responses gauge",
            f"emulator_stored_responses{labels} {float(len(self.stored_responses))}",
            "# TYPE emulator_kv_leases_outstanding gauge",
            f"emulator_kv_leases_outstanding{labels} {float(len(self.leases))}",
            "# TYPE emulator_kv_leases_granted counter",
            f"emulator_kv_leases_granted_total{labels} {float(c.leases_granted)}",
            "# TYPE emulator_kv_leases_freed counter",
            f"emulator_kv_leases_freed_total{labels} {float(c.leases_freed)}",
        ]
        return "\n".join(lines) + "\n"


async def _pieces(data: bytes, chunking: str, interval: float) -> AsyncIterator[bytes]:
    """``data`` as written by an engine whose writes are cut at ``chunking`` boundaries."""
    if chunking == "whole":
        pieces = [data]
    elif chunking == "byte":
        pieces = [data[i:i + 1] for i in range(len(data))]
    elif chunking == "split":  # boundaries that cut through events and through "\n\n"
        pieces = [data[i:i + 7] for i in range(0, len(data), 7)]
    else:
        pieces = [event + b"\n\n" for event in data.split(b"\n\n") if event]
    for piece in pieces:
        if interval:
            await asyncio.sleep(interval)
        yield piece


async def _chunked_json(pad_bytes: int) -> AsyncIterator[bytes]:
    """A valid JSON object of about ``pad_bytes``, sent in 64 KiB chunks with no Content-Length."""
    yield b'{"padding": "'
    chunk = b"x" * (64 << 10)
    for _ in range(pad_bytes // len(chunk)):
        yield chunk
    yield b'"}'


def _edit_handoff(handoff: dict[str, Any], behaviour: VllmBehaviour) -> dict[str, Any]:
    edited = dict(handoff)
    edited.update(behaviour.kv_set)
    for key in behaviour.kv_remove:
        edited.pop(key, None)
    return edited


async def _close_at_once(writer: asyncio.StreamWriter) -> None:
    writer.close()


async def _stall_after_headers(writer: asyncio.StreamWriter) -> None:
    writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 400\r\n\r\n{\"id\":")
    await writer.drain()
    await asyncio.Event().wait()


async def _drip(writer: asyncio.StreamWriter, interval: float) -> None:
    writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 100000\r\n\r\n")
    await writer.drain()
    with contextlib.suppress(ConnectionError):
        while True:
            await asyncio.sleep(interval)
            if writer.is_closing():  # uvloop raises on a closed transport; the server's watch reports it
                await asyncio.Event().wait()
            writer.write(b" ")
            await writer.drain()


async def _truncate(writer: asyncio.StreamWriter) -> None:
    writer.write(b'HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 500\r\n\r\n{"id": "x", "kv_')
    await writer.drain()
    writer.close()
