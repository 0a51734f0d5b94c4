"""TensorRT-LLM context-first disaggregated serving over trtllm-serve's OpenAI API (pins below).

    client request ──► context-only request ──► context worker (prefill)
                         disaggregated_params {request_type "context_only", disagg_request_id},
                         the client's token-limit key set to 1, stream false
                   ◄── choices[0].disaggregated_params + prompt_token_ids
    finish_reason other than "length"/"not_finished"? ──► the client gets the context answer (no decode)
    otherwise ──► client request + those params (request_type "generation_only") + prompt_token_ids
                  [+ x-trtllm-disagg-auth, on a signing pin] ──► local generation worker (decode),
                  which pulls the KV from the context worker

What trtllm-serve's own disaggregated server does, from its source (PROTOCOL.md §4c, with commits):
``_get_ctx_request``/``_verify_ctx_response``/``_get_gen_request``/``_need_gen`` in
``tensorrt_llm/serve/openai_disagg_service.py``; field names and types from ``ChatCompletionRequest``,
``CompletionRequest`` and ``DisaggregatedParams`` in ``tensorrt_llm/serve/openai_protocol.py``
(``extra="forbid"``: an unknown field, or a second name for one field, is a 400); the signature from
``tensorrt_llm/serve/disagg_auth.py`` (``build_internal_disagg_auth_headers``).

Deliberate limits: no "generation first" schedule and no conditional disaggregation; a
client-supplied ``disaggregated_params`` (or ``x-trtllm-disagg-auth``) is refused (stripped);
neither leg is retried (but for the transport's resend on a stale reused connection). The params
are forwarded as the context worker wrote them, only ``request_type`` changes.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import orjson

from extproc.adapters.base import (
    AnswerDirectly,
    Decision,
    DecodeWith,
    Demo,
    Engine,
    Flow,
    Options,
    PlanInput,
    QueueGauges,
    SequentialAdapter,
)
from extproc.adapters.prefill_request import one_token_unstreamed
from extproc.protocol import jsonspan
from extproc.protocol.errors import Problem
from extproc.protocol.fields import (
    FieldRule,
    FieldRules,
    ReservedField,
    equals,
    handoff_error,
    handoff_members,
    int_at_least,
    is_int,
    list_of,
    non_empty_str,
    set_members,
)
from extproc.protocol.openai_request import ClientRequest, Endpoint
from extproc.protocol.prefill_json import parse_prefill_object
from extproc.protocol.settings_spec import SettingSpec, existing_file, read_secret_file
from extproc.protocol.transport import WorkerReply

# Builds before TensorRT-LLM PR #16002 (no request authentication) and builds with it.
PROTOCOL_RC23 = "trtllm-1.3.0rc23-context-first"
PROTOCOL_RC24 = "trtllm-1.3.0rc24-context-first"
PROTOCOLS = (PROTOCOL_RC24, PROTOCOL_RC23)
SIGNING_PINS = frozenset({PROTOCOL_RC24})
KEY = "disaggregated_params"
AUTH_HEADER = "x-trtllm-disagg-auth"  # disagg_auth.py, INTERNAL_DISAGG_AUTH_HEADER
AUTH_KEY_SETTING = "trtllm_auth_key_file"
# trtllm-serve's global disagg request ids live in [2**40, 2**63); local ids are below 2**40
# (llmapi/disagg_utils.py), so ours can never collide with a worker's own request ids.
DISAGG_ID_MIN = 1 << 40
DISAGG_ID_LIMIT = 1 << 63
NEEDS_GENERATION = ("length", "not_finished")  # _need_gen: any other finish_reason ends the request
# The request models' token limits: chat declares one field, max_completion_tokens, with the validation
# alias max_tokens (populate_by_name: either name, never both); completions know max_tokens only.
TOKEN_LIMIT_KEYS = ("max_tokens", "max_completion_tokens")
_GENERATION_ONLY = b'"generation_only"'


def disagg_request_id(nonce: int) -> int:
    return DISAGG_ID_MIN + nonce % (DISAGG_ID_LIMIT - DISAGG_ID_MIN)


def _base64(value: object) -> bool:
    if not isinstance(value, str):
        return False
    try:
        base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError):
        return False
    return True


_TOKEN_IDS = list_of(int_at_least(0), non_empty=True)

# choices[0].disaggregated_params as the pinned context worker writes it. Required: what the
# disaggregated server checks (ctx_request_id, disagg_request_id) and what a generation-only request
# cannot start without (request_type, first_gen_tokens). Other fields are forwarded verbatim. The
# fields are pydantic Optionals, so null is "not set".
RULES = FieldRules(KEY, {
    "request_type": FieldRule(equals("context_only"), required=True),
    "ctx_request_id": FieldRule(int_at_least(0), required=True),
    "disagg_request_id": FieldRule(int_at_least(0), required=True),
    "first_gen_tokens": FieldRule(_TOKEN_IDS, required=True),
    "encoded_opaque_state": FieldRule(_base64, required=False),
    "draft_tokens": FieldRule(list_of(int_at_least(0)), required=False),
    "ctx_dp_rank": FieldRule(int_at_least(0), required=False),
    "ctx_info_endpoint": FieldRule(non_empty_str, required=False),
    "schedule_style": FieldRule(lambda v: is_int(v) and v in (0, 1), required=False),
}, null_is_absent=True)


def context_body(request: ClientRequest, nonce: int) -> bytes:
    """The client's members verbatim except: the context-only params, one JSON response, and one token
    under the token-limit key the client used (max_tokens when it used none; every name it used, so
    a body the models refuse is refused by the context worker, not silently repaired)."""
    params = orjson.dumps({"request_type": "context_only", "disagg_request_id": disagg_request_id(nonce)})
    present = {m.name for m in request.members}
    limits = [name for name in TOKEN_LIMIT_KEYS if name in present] or ["max_tokens"]
    return set_members(request.raw, request.members, {KEY: params, **one_token_unstreamed(limits)})


def _prompt_token_ids(value: object) -> bool:
    """list[int], or a completions batch of exactly one such list (CompletionResponse allows both)."""
    return _TOKEN_IDS(value) or (isinstance(value, list) and len(value) == 1 and _TOKEN_IDS(value[0]))


@dataclass(frozen=True, slots=True)
class ContextResult:
    parsed: dict[str, Any]
    raw: bytes  # the whole context response
    spans: list[jsonspan.Member]
    choice_raw: bytes  # choices[0], as written
    choice_spans: list[jsonspan.Member]  # its members, each key once
    finished: bool


def read_context_reply(reply: WorkerReply) -> ContextResult:
    """Parse and check the context worker's answer (_verify_ctx_response plus field types)."""
    parsed, spans = parse_prefill_object(reply)
    choices = parsed.get("choices")
    if not isinstance(choices, list) or len(choices) != 1 or not isinstance(choices[0], dict):
        raise handoff_error("choices", Problem.INVALID)
    choices_raw = jsonspan.member_value(reply.body, spans, "choices")
    assert choices_raw is not None
    choice_raw = _only_element(choices_raw)
    # finish_reason and disaggregated_params are read from the parsed copy (the last of two) and the
    # params forwarded from the spans (the first): a choice naming either twice is refused.
    choice_spans = handoff_members(choice_raw, "choices")
    finished = choices[0].get("finish_reason") not in NEEDS_GENERATION
    return ContextResult(parsed, reply.body, spans, choice_raw, choice_spans, finished)


def _only_element(array_raw: bytes) -> bytes:
    """The raw bytes of the single element of a one-element JSON array."""
    return array_raw.strip()[1:-1].strip()


def generation_params(params_raw: bytes, spans: list[jsonspan.Member]) -> bytes:
    """The context's params, byte for byte, with request_type "generation_only"."""
    return jsonspan.rebuild(params_raw, spans, {"request_type": _GENERATION_ONLY})


def generation_body(request: ClientRequest, params: bytes, prompt_ids: bytes) -> bytes:
    """The client's request plus the params and the context's prompt token ids (the generation worker
    then does not tokenize again): ``prompt`` on completions, ``prompt_token_ids`` on chat. The
    client's own token-limit key and value are kept."""
    prompt_key = "prompt" if request.endpoint is Endpoint.COMPLETIONS else "prompt_token_ids"
    return set_members(request.raw, request.members, {prompt_key: prompt_ids, KEY: params})


def signature(key: bytes, params: Mapping[str, Any]) -> str:
    """The x-trtllm-disagg-auth value for a generation request's params (disagg_auth.py at the rc24
    pin, ``_auth_payload``/``build_internal_disagg_auth_headers``): HMAC-SHA256 with the shared key over
    the canonical JSON (sorted keys, no spaces, ASCII escapes) of the two protected fields, a list
    endpoint reduced to its first element; lower-case hex behind ``sha256=``."""
    endpoint = params.get("ctx_info_endpoint")
    if isinstance(endpoint, list):
        endpoint = endpoint[0] if endpoint else None
    payload = {"ctx_info_endpoint": endpoint, "encoded_opaque_state": params.get("encoded_opaque_state")}
    canonical = json.dumps(payload, sort_keys=True, separators=(",", ":")).encode("utf-8")
    return "sha256=" + hmac.new(key, canonical, hashlib.sha256).hexdigest()


def needs_signature(params: Mapping[str, Any]) -> bool:
    """request_requires_internal_disagg_auth: either protected field is set."""
    return params.get("encoded_opaque_state") is not None or params.get("ctx_info_endpoint") is not None


def _answer_choice(choice: dict[str, Any]) -> dict[str, Any]:
    return {key: value for key, value in choice.items() if key != KEY}


def direct_answer(request: ClientRequest, context: ContextResult) -> AnswerDirectly:
    """The context answer for a request the first token already finished (EOS, a stop string)."""
    parsed = context.parsed
    choice = _answer_choice(parsed["choices"][0])
    if not request.stream:
        return AnswerDirectly(200, "application/json", orjson.dumps({**parsed, "choices": [choice]}))
    return AnswerDirectly(200, "text/event-stream", direct_answer_stream(request, parsed, choice))


def _include_usage(request: ClientRequest) -> bool:
    options = request.body.get("stream_options")
    return isinstance(options, dict) and options.get("include_usage", True) is True  # TRT-LLM's default: True


def direct_answer_stream(request: ClientRequest, parsed: dict[str, Any], choice: dict[str, Any]) -> bytes:
    """The same answer as SSE, in trtllm-serve's chunk shapes: one chunk with the text and the
    finish_reason, a usage chunk when asked for, then [DONE]."""
    chat = request.endpoint is Endpoint.CHAT
    head = {"id": parsed.get("id"), "object": "chat.completion.chunk" if chat else "text_completion",
            "created": parsed.get("created"), "model": parsed.get("model")}
    text = (choice.get("message") or {}).get("content") if chat else choice.get("text")
    piece: dict[str, Any] = {"index": 0}
    if chat:
        piece["delta"] = {"role": "assistant", "content": text or ""}
    else:
        piece["text"] = text or ""
    piece.update(logprobs=None, finish_reason=choice.get("finish_reason"), stop_reason=choice.get("stop_reason"))
    events = [{**head, "choices": [piece]}]
    if _include_usage(request) and parsed.get("usage") is not None:
        events.append({**head, "choices": [], "usage": parsed["usage"]})
    return b"".join(b"data: " + orjson.dumps(event) + b"\n\n" for event in events) + b"data: [DONE]\n\n"


class TrtllmAdapter(SequentialAdapter):
    name: ClassVar[str] = "trtllm"
    reserved_fields: ClassVar[tuple[ReservedField, ...]] = (ReservedField(KEY),)
    reserved_headers = frozenset({AUTH_HEADER})

    def __init__(self, protocol: str = PROTOCOL_RC23, auth_key: bytes | None = None) -> None:
        if protocol not in PROTOCOLS:
            raise ValueError(protocol)
        if (protocol in SIGNING_PINS) != (auth_key is not None):
            raise ValueError("a signing pin needs a key, and only a signing pin takes one")
        super().__init__(protocol)
        self._auth_key = auth_key

    def prefill_body(self, request: ClientRequest, plan: PlanInput) -> bytes:
        return context_body(request, plan.nonce)

    def decide(self, request: ClientRequest, reply: WorkerReply) -> Decision:
        context = read_context_reply(reply)
        if context.finished:
            return direct_answer(request, context)
        params = context.parsed["choices"][0].get(KEY)
        params_raw = jsonspan.member_value(context.choice_raw, context.choice_spans, KEY)
        # Each params key once before any is checked: the checked copy is the forwarded one.
        params_spans = handoff_members(params_raw, KEY) if isinstance(params, dict) and params_raw else []
        RULES.check(params)
        if not _prompt_token_ids(context.parsed.get("prompt_token_ids")):
            raise handoff_error("prompt_token_ids", Problem.MISSING if "prompt_token_ids" not in context.parsed
                                else Problem.INVALID)
        prompt_ids = jsonspan.member_value(context.raw, context.spans, "prompt_token_ids")
        assert prompt_ids is not None
        assert params_raw is not None
        body = generation_body(request, generation_params(params_raw, params_spans), prompt_ids)
        headers: tuple[tuple[str, bytes], ...] = ()
        if self._auth_key is not None and needs_signature(params):
            headers = ((AUTH_HEADER, signature(self._auth_key, params).encode()),)
        return DecodeWith(body, headers)


def build(protocol: str, options: Options) -> TrtllmAdapter:
    path = options.get(AUTH_KEY_SETTING) or ""
    return TrtllmAdapter(protocol, read_secret_file(path) if protocol in SIGNING_PINS else None)


def option_problems(protocol: str, options: Options) -> list[str]:
    path = options.get(AUTH_KEY_SETTING) or ""
    if protocol in SIGNING_PINS and not path:
        return [f"protocol {protocol} signs generation requests (x-trtllm-disagg-auth): set "
                f"PD_EXTPROC_TRTLLM_AUTH_KEY_FILE to a file holding the workers' internal_request_auth_key"]
    if protocol not in SIGNING_PINS and path:
        return [f"PD_EXTPROC_TRTLLM_AUTH_KEY_FILE is set but protocol {protocol} does not sign requests"]
    return []


ENGINE = Engine(
    name=TrtllmAdapter.name, engine="trtllm", pins=PROTOCOLS, flow=Flow.SEQUENTIAL, build=build,
    # tensorrt_llm/metrics/collector.py: trtllm_num_requests_waiting, served on /prometheus/metrics when
    # the worker runs with return_perf_metrics.
    decode_queue=QueueGauges("/prometheus/metrics", ("trtllm_num_requests_waiting",)),
    emulator="pd_extproc_lab.emulator.trtllm:TrtllmEmulator",
    settings=(SettingSpec(AUTH_KEY_SETTING, existing_file,
                          "trtllm adapter, signing pins: file holding the workers' internal_request_auth_key "
                          "(the key itself is never logged or shown)", default=""),),
    option_problems=option_problems,
    # The demo signs generation requests: one random key for the server and both emulated workers.
    demo=Demo(key_setting="PD_EXTPROC_TRTLLM_AUTH_KEY_FILE", key_flag="--auth-key-file"),
    summary="TensorRT-LLM trtllm-serve, context-first: context_only request, validate disaggregated_params, "
            "then generation_only decode",
)
