"""An emulated trtllm-serve (TensorRT-LLM's OpenAI server) as a disaggregated context worker, a
generation worker, or both. Shapes follow the pinned source (PROTOCOL.md, "trtllm").

Context: a request whose ``disaggregated_params.request_type`` is ``"context_only"`` gets one token
and ``choices[0].disaggregated_params`` (``ctx_request_id``, an opaque state, ``first_gen_tokens``,
the request's ``disagg_request_id``, ``ctx_info_endpoint``), plus the top-level ``prompt_token_ids``.
The KV it "computed" is held in the worker's KV registry (an HTTP listener at ``ctx_info_endpoint``)
until a generation worker pulls it, once, or the lease expires.

Generation: a request whose params say ``"generation_only"`` pulls the KV from
``ctx_info_endpoint``; the registry hands it over only if the ctx_request_id, disagg_request_id,
opaque state, first tokens and prompt token ids are exactly what the context worker issued. Anything
else fails like trtllm-serve: 400 ``BadRequestError`` (a non-streaming request), or a stream that is
cut after its headers. Like its pydantic models (``extra="forbid"``), the server refuses unknown
request fields, unknown ``disaggregated_params`` fields, and ``stream_options`` without a stream.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import hmac
import json
import re
import secrets
import ssl
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import orjson

from extproc.observability.httpserver import Request, Response
from extproc.protocol.settings_spec import read_secret_file
from extproc.protocol.units import parse_duration
from pd_extproc_lab.emulator import common, text
from pd_extproc_lab.emulator.behaviour import Behaviour
from pd_extproc_lab.emulator.control import Control, Received
from pd_extproc_lab.emulator.http import RawResponse, Reply, StreamResponse

TRTLLM_VERSION = "1.3.0"
DEFAULT_MAX_TOKENS = 16
EOS_TOKEN = 2
VOCAB = 32000
_WORDS = re.compile(r"\w+|[^\w\s]")
# The request models of the pinned source: tensorrt_llm/serve/openai_protocol.py at commit
# 0076e9390e1ed11515f149eec356f5a03f4a00d8 (PROTOCOL.md §4c). Every model derives OpenAIBaseModel,
# ``ConfigDict(extra="forbid", populate_by_name=True)``: any other field is refused.
DISAGG_FIELDS = frozenset({  # class DisaggregatedParams
    "request_type", "first_gen_tokens", "first_gen_log_probs", "first_gen_logits", "ctx_request_id",
    "encoded_opaque_state", "draft_tokens", "disagg_request_id", "ctx_dp_rank", "ctx_info_endpoint",
    "schedule_style", "ctx_usage", "return_prompt_token_ids_b64", "resolved_thinking"})
COMPLETION_FIELDS = frozenset({  # class CompletionRequest: max_tokens only, no max_completion_tokens
    "model", "prompt", "best_of", "echo", "frequency_penalty", "logit_bias", "logprobs", "max_tokens", "n",
    "presence_penalty", "seed", "stop", "stream", "stream_options", "suffix", "temperature", "top_p", "user",
    "lora_request", "prompt_ignore_length", "use_beam_search", "top_k", "top_p_min", "min_p", "repetition_penalty",
    "length_penalty", "early_stopping", "stop_token_ids", "include_stop_str_in_output", "ignore_eos", "min_tokens",
    "skip_special_tokens", "spaces_between_special_tokens", "truncate_prompt_tokens", "return_context_logits",
    "detokenize", "thinking_token_budget", "add_special_tokens", "response_format", "disaggregated_params",
    "priority", "conversation_params"})
CHAT_FIELDS = frozenset({  # class ChatCompletionRequest (max_completion_tokens: validation_alias max_tokens)
    "messages", "prompt_token_ids", "prompt_token_ids_b64", "model", "frequency_penalty", "logit_bias", "logprobs",
    "top_logprobs", "max_completion_tokens", "n", "presence_penalty", "response_format", "seed", "stop", "stream",
    "stream_options", "temperature", "top_p", "tools", "tool_choice", "parallel_tool_calls", "user",
    "reasoning_effort", "thinking", "thinking_token_budget", "prompt_ignore_length", "best_of", "use_beam_search",
    "top_k", "top_p_min", "min_p", "repetition_penalty", "length_penalty", "early_stopping", "stop_token_ids",
    "include_stop_str_in_output", "ignore_eos", "min_tokens", "skip_special_tokens", "spaces_between_special_tokens",
    "truncate_prompt_tokens", "lora_request", "echo", "add_generation_prompt", "add_special_tokens", "documents",
    "chat_template", "chat_template_kwargs", "injected_chat_template_kwargs", "media_io_kwargs",
    "disaggregated_params", "conversation_params", "cache_salt", "priority", "agent_hierarchy",
    "mm_processor_kwargs"})
# Field aliases: the request key -> the field it populates (validation_alias; populate_by_name also
# accepts the field's own name, so both keys in one body populate one field twice: "extra_forbidden").
CHAT_ALIASES = {"max_tokens": "max_completion_tokens"}
AUTH_HEADER = "x-trtllm-disagg-auth"
AUTH_FAILED = "Invalid internal disaggregated request authentication"


def token_ids(prompt: str) -> list[int]:
    """Pseudo token ids of a prompt: one per word or punctuation mark, stable across workers."""
    return [3 + int.from_bytes(hashlib.sha256(w.encode()).digest()[:4], "big") % (VOCAB - 3)
            for w in _WORDS.findall(prompt)] or [3]


def error_response(status: int, message: str, kind: str = "BadRequestError") -> Response:
    """trtllm-serve's create_error_response: a top-level ErrorResponse."""
    return Response(status, orjson.dumps({"object": "error", "message": message, "type": kind, "param": None,
                                          "code": status}))


def validation_error(errors: list[dict[str, Any]]) -> Response:
    """openai_server.py, ``validation_exception_handler``: 400 ``{"error": str(exc)}``, where FastAPI's
    RequestValidationError prints as the repr of its pydantic error list."""
    return Response(400, orjson.dumps({"error": repr(errors)}))


def extra_forbidden(loc: tuple[str, ...], value: Any) -> dict[str, Any]:
    return {"type": "extra_forbidden", "loc": ("body", *loc), "msg": "Extra inputs are not permitted", "input": value}


def value_error(message: str, body: Any) -> dict[str, Any]:
    return {"type": "value_error", "loc": ("body",), "msg": f"Value error, {message}", "input": body}


def _flat_ids(value: Any) -> Any:
    return value[0] if isinstance(value, list) and len(value) == 1 and isinstance(value[0], list) else value


@dataclass(frozen=True, kw_only=True)
class TrtllmBehaviour(Behaviour):
    first_token_eos: bool = False  # the context phase's one token is EOS: the request is finished
    params_set: dict[str, Any] = field(default_factory=dict)  # edits of the issued disaggregated_params
    params_remove: list[str] = field(default_factory=list)
    params_null: bool = False  # choices[0].disaggregated_params: null
    prompt_token_ids: Any = None  # replaces the answer's prompt_token_ids
    omit_prompt_token_ids: bool = False


@dataclass(slots=True)
class ContextKv:
    disagg_request_id: Any
    opaque_state: str
    first_gen_tokens: list[int]
    prompt_token_ids: list[int]
    prompt: str
    expires: float


@dataclass
class Counters:
    contexts: int = 0
    transfers: int = 0
    refused_pulls: int = 0
    failed_generations: int = 0
    expired: int = 0
    refused_auth: int = 0


class TrtllmEmulator:
    def __init__(self, role: str, model: str, worker_id: str, side_host: str, lease_seconds: float,
                 auth_key: bytes | None = None) -> None:
        assert role in ("prefill", "decode", "both")
        self.role = role
        self.model = model
        self.worker_id = worker_id
        self.side_host = side_host
        self.side_port = 0
        self.lease_seconds = lease_seconds
        self.auth_key = auth_key
        self.kv: dict[int, ContextKv] = {}
        self.counters = Counters()
        self.control = Control({"engine": "trtllm", "role": role, "worker_id": worker_id, "model": model,
                                "version": TRTLLM_VERSION}, TrtllmBehaviour)
        self.servers = common.EngineServers(self.control, self.handle, self.handle_registry, 30.0)

    @staticmethod
    def add_arguments(group: Any) -> None:
        group.add_argument("--lease", default="30s", help="how long a context worker holds an unpulled KV")
        group.add_argument("--auth-key-file", default="",
                           help="internal_request_auth_key: check x-trtllm-disagg-auth on protected requests")

    @classmethod
    def from_args(cls, args: Any) -> TrtllmEmulator:
        key = read_secret_file(args.auth_key_file) if args.auth_key_file else None
        return cls(args.role, args.model, args.worker_id, args.side_channel.host, parse_duration(args.lease), key)

    def _check_auth(self, request: Request, params: Any) -> Response | None:
        """serve/disagg_auth.py (the rc24 pin), ``validate_internal_disagg_request``, called by
        openai_server.py ``_validate_internal_disagg_request`` in openai_chat/openai_completion: a request
        whose params carry ``encoded_opaque_state`` or ``ctx_info_endpoint`` needs
        ``x-trtllm-disagg-auth: sha256=<HMAC-SHA256 hex>`` over the canonical JSON of those two fields,
        compared with hmac.compare_digest; a failure is ``create_error_response``, 400 BadRequestError.
        Without a key the check is off (builds before PR #16002, and later ones that only warn)."""
        if self.auth_key is None or not isinstance(params, dict):
            return None
        if params.get("encoded_opaque_state") is None and params.get("ctx_info_endpoint") is None:
            return None
        endpoint = params.get("ctx_info_endpoint")
        if isinstance(endpoint, list):
            endpoint = endpoint[0] if endpoint else None
        payload = {"ctx_info_endpoint": endpoint, "encoded_opaque_state": params.get("encoded_opaque_state")}
        canonical = json.dumps(payload, sort_keys=True, separators=(",", ":")).encode("utf-8")
        expected = ("sha256=" + hmac.new(self.auth_key, canonical, hashlib.sha256).hexdigest()).encode()
        sent = request.header(AUTH_HEADER)
        try:
            sent_bytes = sent.encode("utf-8") if sent is not None else b""
        except UnicodeEncodeError:
            sent_bytes = b""
        if sent is None or not hmac.compare_digest(sent_bytes, expected):
            self.counters.refused_auth += 1
            return error_response(400, AUTH_FAILED)
        return None

    async def start(self, host: str, port: int, side_port: int, tls: ssl.SSLContext | None = None) -> int:
        serves_kv = self.role != "decode"
        bound, side = await self.servers.start(host, port, tls, (self.side_host, side_port) if serves_kv else None)
        self.side_port = side or 0
        self.control.info.update({"port": bound, "ctx_info_endpoint": self.ctx_info_endpoint})
        return bound

    async def close(self) -> None:
        await self.servers.close()

    @property
    def ctx_info_endpoint(self) -> str | None:
        return f"http://{common.authority(self.side_host, self.side_port)}" if self.side_port else None

    async def handle(self, request: Request) -> Reply:
        control = await self.control.handle(request)
        if control is not None:
            return control
        if request.path == "/health":
            return Response(200, b"")
        if request.path == "/version":
            return Response(200, orjson.dumps({"version": TRTLLM_VERSION}))
        if request.path == "/metrics":
            return Response(200, b"[]")  # trtllm-serve's /metrics is a JSON list of iteration stats
        if request.path == "/prometheus/metrics":  # with return_perf_metrics (metrics/collector.py)
            waiting = self.control.gauge("trtllm_num_requests_waiting")
            return Response(200, f"# TYPE trtllm_num_requests_waiting gauge\n"
                                 f'trtllm_num_requests_waiting{{model_name="{self.model}"}} {waiting}\n'.encode(),
                            content_type="text/plain; version=0.0.4")
        if request.path == "/v1/models":
            return Response(200, orjson.dumps({"object": "list", "data": [
                {"id": self.model, "object": "model", "created": int(time.time()), "owned_by": "tensorrt_llm"}]}))
        if request.method != "POST" or request.path not in common.GENERATION_PATHS:
            return Response(404, b'{"detail":"Not Found"}')
        return await self.control.answer(request, self._generate)

    async def _generate(self, request: Request, received: Received) -> Reply:
        behaviour = self.control.next_behaviour(received)
        misbehaviour = await common.misbehave(self.control, behaviour, lambda status, message: error_response(
            status, message, "InternalServerError" if status >= 500 else "BadRequestError"))
        if misbehaviour is not None:
            return misbehaviour
        chat = request.path == "/v1/chat/completions"
        body = common.json_object(request.body)
        if body == "not JSON":
            return validation_error([{"type": "json_invalid", "loc": ("body", 0), "msg": "JSON decode error",
                                      "input": {}}])
        if isinstance(body, str):
            return validation_error([{"type": "model_attributes_type", "loc": ("body",),
                                      "msg": "Input should be a valid dictionary or object to extract fields from",
                                      "input": orjson.loads(request.body)}])
        problems = _validate(body, chat)
        if problems:
            return validation_error(problems)
        params = body.get("disaggregated_params")
        refusal = self._check_auth(request, params)
        if refusal is not None:
            return refusal
        request_type = params.get("request_type") if isinstance(params, dict) else None
        if request_type == "context_only":
            return self._context(body, chat, received, behaviour)
        if request_type == "generation_only" and isinstance(params, dict):
            return await self._generation(body, chat, params, received)
        prompt = common.prompt_text(body, chat)
        limit = common.max_tokens(body, chat, DEFAULT_MAX_TOKENS)
        return self._answer(body, chat, prompt, text.generate(prompt, limit))

    # --- context-only: one token, the params, the KV held for a generation worker -----------------------

    def _context(self, body: dict[str, Any], chat: bool, received: Received, behaviour: TrtllmBehaviour) -> Reply:
        if self.ctx_info_endpoint is None:
            return error_response(400, "This worker has no cache transceiver for context-only requests")
        self._reap()
        prompt = common.prompt_text(body, chat)
        ids = token_ids(prompt)
        first = text.generate(prompt, 1)
        eos = behaviour.first_token_eos
        first_ids = [EOS_TOKEN] if eos else token_ids(first[0])[:1]
        limit = common.max_tokens(body, chat, DEFAULT_MAX_TOKENS)
        ctx_request_id = secrets.randbelow(1 << 40)
        params: dict[str, Any] = {
            "request_type": "context_only", "first_gen_tokens": first_ids, "ctx_request_id": ctx_request_id,
            "encoded_opaque_state": base64.b64encode(secrets.token_bytes(24)).decode(), "draft_tokens": None,
            "disagg_request_id": body["disaggregated_params"].get("disagg_request_id"), "ctx_dp_rank": 0,
            "ctx_info_endpoint": self.ctx_info_endpoint, "schedule_style": None,
        }
        self.kv[ctx_request_id] = ContextKv(params["disagg_request_id"], params["encoded_opaque_state"], first_ids,
                                            ids, prompt, time.monotonic() + self.lease_seconds)
        self.counters.contexts += 1
        params.update(behaviour.params_set)
        for key in behaviour.params_remove:
            params.pop(key, None)
        received.notes.update(ctx_request_id=ctx_request_id, disaggregated_params=params, prompt_token_ids=ids)
        finish = "stop" if eos else ("length" if limit == 1 else "not_finished")
        answer = self._full(chat, "" if eos else first[0], len(ids), 1, finish)
        answer["choices"][0]["disaggregated_params"] = params
        answer["prompt_token_ids"] = ids
        if behaviour.omit_prompt_token_ids:
            del answer["prompt_token_ids"]
        elif behaviour.prompt_token_ids is not None:
            answer["prompt_token_ids"] = behaviour.prompt_token_ids
        if behaviour.params_null:
            answer["choices"][0]["disaggregated_params"] = None
        return Response(200, orjson.dumps(answer), headers=[(common.WORKER_HEADER, self.worker_id)])

    # --- generation-only: pull the KV from the context worker's registry, then generate --------------------

    async def _generation(self, body: dict[str, Any], chat: bool, params: dict[str, Any],
                          received: Received) -> Reply:
        received.notes["disaggregated_params"] = params
        prompt_ids = body.get("prompt_token_ids") if chat else body.get("prompt")
        if not isinstance(prompt_ids, list):
            prompt_ids = token_ids(common.prompt_text(body, chat))
        outcome = await self._pull(params, _flat_ids(prompt_ids))
        if isinstance(outcome, str):
            self.counters.failed_generations += 1
            received.notes["kv"] = outcome
            if body.get("stream") is True:
                return RawResponse(_cut_stream)
            return error_response(400, f"Generation-only request failed: {outcome}")
        prompt, context_worker = outcome
        received.notes.update(kv="ok", context_worker=context_worker)
        self.counters.transfers += 1
        limit = common.max_tokens(body, chat, DEFAULT_MAX_TOKENS)
        return self._answer(body, chat, prompt, text.generate(prompt, limit))

    async def _pull(self, params: dict[str, Any], prompt_ids: Any) -> tuple[str, str] | str:
        """(prompt, context worker id) of the pulled KV, or why it could not be pulled."""
        endpoint = params.get("ctx_info_endpoint")
        if not isinstance(endpoint, str) or not isinstance(params.get("ctx_request_id"), int):
            return "no context to receive the KV cache from"
        claim = {key: params.get(key) for key in ("ctx_request_id", "disagg_request_id", "encoded_opaque_state",
                                                  "first_gen_tokens")}
        claim.update(prompt_token_ids=prompt_ids, generation_worker=self.worker_id)
        try:
            async with self.servers.client.post(f"{endpoint}/kv/pull", data=orjson.dumps(claim)) as reply:
                answer = await reply.json(content_type=None)
        except (aiohttp.ClientError, OSError, TimeoutError, ValueError) as exc:
            return f"cache transceiver could not reach the context worker: {type(exc).__name__}"
        if reply.status != 200:
            return str(answer.get("error", "KV cache transfer refused"))
        return str(answer["prompt"]), str(answer["context_worker"])

    async def handle_registry(self, request: Request) -> Reply:
        """The context worker's side of the transfer: hand a KV over once, to the exact params issued."""
        if request.path != "/kv/pull" or request.method != "POST":
            return Response(404, b"{}")
        self._reap()
        try:
            claim = orjson.loads(request.body)
            entry = self.kv.get(claim["ctx_request_id"])
        except (orjson.JSONDecodeError, KeyError, TypeError):
            entry = None
            claim = {}
        if entry is None or not _same_context(entry, claim):
            self.counters.refused_pulls += 1
            return Response(404, orjson.dumps({"error": "unknown context request or mismatched state"}))
        del self.kv[claim["ctx_request_id"]]
        return Response(200, orjson.dumps({"prompt": entry.prompt, "context_worker": self.worker_id}))

    def _reap(self) -> None:
        now = time.monotonic()
        for key in [k for k, entry in self.kv.items() if entry.expires <= now]:
            del self.kv[key]
            self.counters.expired += 1

    # --- responses ------------------------------------------------------------------------------------

    def _full(self, chat: bool, content: str, prompt_tokens: int, completion_tokens: int,
              finish: str) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": 0}
        if chat:
            choice["message"] = {"role": "assistant", "content": content, "reasoning_content": None,
                                 "reasoning": None, "tool_calls": []}
            choice.update(logprobs=None, finish_reason=finish, stop_reason=None, mm_embedding_handle=None)
        else:
            choice.update(text=content, token_ids=None, logprobs=None, context_logits=None, finish_reason=finish,
                          stop_reason=None)
        choice.update(disaggregated_params=None, avg_decoded_tokens_per_iter=None)
        return {"id": ("chatcmpl-" if chat else "cmpl-") + secrets.token_hex(16),
                "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
                "model": self.model, "choices": [choice], "usage": _usage(prompt_tokens, completion_tokens),
                "prompt_token_ids": None}

    def _answer(self, body: dict[str, Any], chat: bool, prompt: str, tokens: list[str]) -> Reply:
        prompt_tokens = len(token_ids(prompt))
        if body.get("stream") is True:
            return StreamResponse(self._stream(chat, tokens, prompt_tokens, common.include_usage(body)))
        answer = self._full(chat, "".join(tokens), prompt_tokens, len(tokens), "length")
        return Response(200, orjson.dumps(answer), headers=[(common.WORKER_HEADER, self.worker_id)])

    async def _stream(self, chat: bool, tokens: list[str], prompt_tokens: int,
                      usage: bool) -> AsyncIterator[bytes]:
        request_id = ("chatcmpl-" if chat else "cmpl-") + secrets.token_hex(16)
        head = {"id": request_id, "object": "chat.completion.chunk" if chat else "text_completion",
                "created": int(time.time()), "model": self.model}
        for i, token in enumerate(tokens):
            finish = "length" if i == len(tokens) - 1 else None
            piece: dict[str, Any] = {"index": 0}
            if chat:
                piece["delta"] = {"role": "assistant", "content": token} if i == 0 else {"content": token}
            else:
                piece["text"] = token
            piece.update(logprobs=None, finish_reason=finish, stop_reason=None)
            yield b"data: " + orjson.dumps({**head, "choices": [piece], "usage": None}) + b"\n\n"
        if usage:
            usage_event: dict[str, Any] = {**head, "choices": [], "usage": _usage(prompt_tokens, len(tokens))}
            yield b"data: " + orjson.dumps(usage_event) + b"\n\n"
        yield b"data: [DONE]\n\n"


def _validate(body: dict[str, Any], chat: bool) -> list[dict[str, Any]]:
    """What the pinned pydantic request models refuse before any generation (openai_protocol.py)."""
    fields = CHAT_FIELDS if chat else COMPLETION_FIELDS
    aliases = CHAT_ALIASES if chat else {}
    errors = []
    populated = {aliases[key] for key in body if key in aliases}
    for key, value in body.items():
        if key in aliases:
            continue
        if key not in fields or key in populated:  # unknown, or a second name for an aliased field
            errors.append(extra_forbidden((key,), value))
    if chat and not isinstance(body.get("messages"), list):
        errors.append({"type": "missing", "loc": ("body", "messages"), "msg": "Field required", "input": body})
    if not chat and "prompt" not in body:
        errors.append({"type": "missing", "loc": ("body", "prompt"), "msg": "Field required", "input": body})
    params = body.get("disaggregated_params")
    if params is not None:
        if not isinstance(params, dict) or not isinstance(params.get("request_type"), str):
            errors.append({"type": "missing", "loc": ("body", "disaggregated_params", "request_type"),
                           "msg": "Field required", "input": params})
        else:
            errors.extend(extra_forbidden(("disaggregated_params", key), value) for key, value in params.items()
                          if key not in DISAGG_FIELDS)
    if errors:
        return errors
    # The model validators (validate_stream_options): chat tests "is not None", completions truthiness.
    options = body.get("stream_options")
    if chat and options is not None and not body.get("stream"):
        return [value_error("stream_options can only be set if stream is true", body)]
    if not chat and options and not body.get("stream"):
        return [value_error("Stream options can only be defined when stream is true.", body)]
    return []


def _same_context(entry: ContextKv, claim: dict[str, Any]) -> bool:
    return (claim.get("disagg_request_id") == entry.disagg_request_id
            and claim.get("encoded_opaque_state") == entry.opaque_state
            and claim.get("first_gen_tokens") == entry.first_gen_tokens
            and claim.get("prompt_token_ids") == entry.prompt_token_ids)


def _usage(prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
    return {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens + completion_tokens,
            "completion_tokens": completion_tokens, "prompt_tokens_details": None}


async def _cut_stream(writer: asyncio.StreamWriter) -> None:
    """An exception inside trtllm-serve's stream generator: the headers are out, the body is cut."""
    writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")
    with contextlib.suppress(ConnectionError):
        await writer.drain()
    writer.close()
