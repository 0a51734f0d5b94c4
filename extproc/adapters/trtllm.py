"""TensorRT-LLM context-first disaggregated serving over trtllm-serve's OpenAI API (pin below).

    client request ──► context-only request ──► context worker (prefill)
                         disaggregated_params {request_type "context_only", disagg_request_id},
                         max_tokens 1, stream false
                   ◄── choices[0].disaggregated_params + prompt_token_ids
    finish_reason other than "length"/"not_finished"? ──► the client gets the context answer (no decode)
    otherwise ──► client request + those params (request_type "generation_only") + prompt_token_ids
                  ──► local generation worker (decode), which pulls the KV from the context worker

What trtllm-serve's own disaggregated server does, from its source (PROTOCOL.md, "trtllm"):
``_get_ctx_request``/``_verify_ctx_response``/``_get_gen_request``/``_need_gen`` in
``tensorrt_llm/serve/openai_disagg_service.py``; field types from ``DisaggregatedParams`` in
``tensorrt_llm/serve/openai_protocol.py``.

Deliberate limits: no "generation first" schedule and no conditional disaggregation; builds that
require the internal disaggregation HMAC (``x-trtllm-disagg-auth``, serve/disagg_auth.py) are not
supported by this pin; a client-supplied ``disaggregated_params`` is refused; neither leg is
retried. The params are forwarded as the context worker wrote them, only ``request_type`` changes.
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import orjson

from extproc import jsonspan
from extproc.adapters.base import AnswerDirectly, Decision, DecodeWith, Flow, Plan, PrefillReply, ServerInfo
from extproc.adapters.prefill_json import member_value, parse_prefill_object
from extproc.errors import Code, PdError
from extproc.openai_request import ClientRequest, Endpoint
from extproc.prefill_target import PrefillTarget

if TYPE_CHECKING:
    from extproc.config import Settings

PROTOCOL_1_3 = "trtllm-1.3-context-first"
PROTOCOLS = (PROTOCOL_1_3,)
KEY = "disaggregated_params"
# trtllm-serve's global disagg request ids live in [2**40, 2**63); local ids are below 2**40
# (llmapi/disagg_utils.py), so ours can never collide with a worker's own request ids.
DISAGG_ID_MIN = 1 << 40
DISAGG_ID_LIMIT = 1 << 63
NEEDS_GENERATION = ("length", "not_finished")  # _need_gen: any other finish_reason ends the request
_ONE = b"1"
_FALSE = b"false"
_GENERATION_ONLY = b'"generation_only"'


def disagg_request_id(nonce: int) -> int:
    return DISAGG_ID_MIN + nonce % (DISAGG_ID_LIMIT - DISAGG_ID_MIN)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _int_at_least_zero(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _token_ids(value: object) -> bool:
    return isinstance(value, list) and bool(value) and all(_int_at_least_zero(t) for t in value)


def _null_or(check: Callable[[object], bool]) -> Callable[[object], bool]:
    return lambda value: value is None or check(value)


def _base64(value: object) -> bool:
    if not isinstance(value, str):
        return False
    try:
        base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError):
        return False
    return True


@dataclass(frozen=True, slots=True)
class FieldRule:
    check: Callable[[object], bool]
    required: bool


# choices[0].disaggregated_params as the pinned context worker writes it. Required: what the
# disaggregated server checks (ctx_request_id, disagg_request_id) and what a generation-only request
# cannot start without (request_type, first_gen_tokens). Other fields are forwarded verbatim.
RULES: Mapping[str, FieldRule] = {
    "request_type": FieldRule(lambda v: v == "context_only", required=True),
    "ctx_request_id": FieldRule(_int_at_least_zero, required=True),
    "disagg_request_id": FieldRule(_int_at_least_zero, required=True),
    "first_gen_tokens": FieldRule(_token_ids, required=True),
    "encoded_opaque_state": FieldRule(_null_or(_base64), required=False),
    "draft_tokens": FieldRule(_null_or(lambda v: isinstance(v, list) and all(_int_at_least_zero(t) for t in v)),
                              required=False),
    "ctx_dp_rank": FieldRule(_null_or(_int_at_least_zero), required=False),
    "ctx_info_endpoint": FieldRule(_null_or(lambda v: isinstance(v, str) and v != ""), required=False),
    "schedule_style": FieldRule(_null_or(lambda v: _is_int(v) and v in (0, 1)), required=False),
}


def _invalid(field: str, problem: str = "is invalid") -> PdError:
    return PdError(Code.INVALID_PREFILL_HANDOFF, param=f"{field} {problem}")


def refuse_client_params(request: ClientRequest) -> None:
    if request.body.get(KEY) is not None:
        raise PdError(Code.INVALID_REQUEST_FIELD, param=KEY)


def context_body(request: ClientRequest, nonce: int) -> bytes:
    """The client's members verbatim except: the context-only params, one token, one JSON response."""
    params = orjson.dumps({"request_type": "context_only", "disagg_request_id": disagg_request_id(nonce)})
    replace: dict[str, bytes | None] = {KEY: params, "stream": _FALSE, "stream_options": None, "max_tokens": _ONE}
    present = {m.name for m in request.members}
    append = [(name, value) for name, value in (("stream", _FALSE), ("max_tokens", _ONE), (KEY, params))
              if name not in present]
    if "max_completion_tokens" in present:
        replace["max_completion_tokens"] = _ONE
    return jsonspan.rebuild(request.raw, request.members, replace, append)


def validate_params(params: object) -> None:
    if params is None:
        raise _invalid(KEY, "is missing")
    if not isinstance(params, dict):
        raise _invalid(KEY, "is not an object")
    for name, rule in RULES.items():
        value = params.get(name)
        if value is None and rule.required:
            raise _invalid(f"{KEY}.{name}", "is missing")
        if name in params and not rule.check(value):
            raise _invalid(f"{KEY}.{name}")


def _prompt_token_ids(value: object) -> bool:
    """list[int], or a completions batch of exactly one such list (CompletionResponse allows both)."""
    return _token_ids(value) or (isinstance(value, list) and len(value) == 1 and _token_ids(value[0]))


@dataclass(frozen=True, slots=True)
class ContextResult:
    parsed: dict[str, Any]
    raw: bytes  # the whole context response
    choice_raw: bytes  # choices[0], as written
    finished: bool


def read_context_reply(reply: PrefillReply) -> ContextResult:
    """Parse and check the context worker's answer (_verify_ctx_response plus field types)."""
    parsed, spans = parse_prefill_object(reply)
    choices = parsed.get("choices")
    if not isinstance(choices, list) or len(choices) != 1 or not isinstance(choices[0], dict):
        raise _invalid("choices")
    choices_raw = member_value(reply.body, spans, "choices")
    assert choices_raw is not None
    finished = choices[0].get("finish_reason") not in NEEDS_GENERATION
    return ContextResult(parsed, reply.body, _only_element(choices_raw), finished)


def _only_element(array_raw: bytes) -> bytes:
    """The raw bytes of the single element of a one-element JSON array."""
    return array_raw.strip()[1:-1].strip()


def generation_params(choice_raw: bytes) -> bytes:
    """The context's params, byte for byte, with request_type "generation_only"."""
    params_raw = member_value(choice_raw, jsonspan.members(choice_raw), KEY)
    assert params_raw is not None
    spans = jsonspan.members(params_raw)
    if len({m.name for m in spans}) != len(spans):  # parsers disagree on which duplicate wins
        raise _invalid(KEY, "has a duplicate field")
    return jsonspan.rebuild(params_raw, spans, {"request_type": _GENERATION_ONLY})


def generation_body(request: ClientRequest, params: bytes, prompt_ids: bytes) -> bytes:
    """The client's request plus the params and the context's prompt token ids (the generation worker
    then does not tokenize again): ``prompt`` on completions, ``prompt_token_ids`` on chat."""
    prompt_key = "prompt" if request.endpoint is Endpoint.COMPLETIONS else "prompt_token_ids"
    present = {m.name for m in request.members}
    replace = {name: value for name, value in ((KEY, params), (prompt_key, prompt_ids)) if name in present}
    append = [(name, value) for name, value in ((prompt_key, prompt_ids), (KEY, params)) if name not in present]
    return jsonspan.rebuild(request.raw, request.members, replace, append)


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


class TrtllmAdapter:
    name: ClassVar[str] = "trtllm"
    flow: ClassVar[Flow] = Flow.SEQUENTIAL
    server_info_path: ClassVar[str | None] = None
    protocols: ClassVar[tuple[str, ...]] = PROTOCOLS

    def __init__(self, protocol: str = PROTOCOL_1_3) -> None:
        if protocol not in PROTOCOLS:
            raise ValueError(protocol)
        self._protocol = protocol

    @property
    def protocol(self) -> str:
        return self._protocol

    def plan(self, request: ClientRequest, target: PrefillTarget, nonce: int, server_info: ServerInfo | None) -> Plan:
        refuse_client_params(request)
        return Plan(prefill_body=context_body(request, nonce))

    def decide(self, request: ClientRequest, reply: PrefillReply) -> Decision:
        context = read_context_reply(reply)
        if context.finished:
            return direct_answer(request, context)
        validate_params(context.parsed["choices"][0].get(KEY))
        if not _prompt_token_ids(context.parsed.get("prompt_token_ids")):
            raise _invalid("prompt_token_ids", "is missing" if "prompt_token_ids" not in context.parsed else
                           "is invalid")
        spans = jsonspan.members(context.raw)
        prompt_ids = member_value(context.raw, spans, "prompt_token_ids")
        assert prompt_ids is not None
        return DecodeWith(generation_body(request, generation_params(context.choice_raw), prompt_ids))

    def check_background(self, reply: PrefillReply) -> None:
        raise AssertionError("a sequential adapter has no background prefill")


def build(protocol: str, settings: Settings) -> TrtllmAdapter:
    return TrtllmAdapter(protocol)
