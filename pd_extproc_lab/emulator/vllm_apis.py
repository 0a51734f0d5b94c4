"""The emulated vLLM's Anthropic Messages, Responses and token-in generate APIs: request checks, the
prompt each renders, and the response shapes (full and streamed) of vLLM 0.32. Each shape cites its
upstream file (paths under vllm/entrypoints/). Pure: the worker (vllm.py) does the KV side.
"""

from __future__ import annotations

import hashlib
import secrets
import time
from dataclasses import dataclass
from typing import Any

import orjson

from pd_extproc_lab.emulator import text

DEFAULT_MAX_TOKENS = 16


def _openai_error(status: int, message: str, kind: str, param: str | None = None) -> bytes:
    return orjson.dumps({"error": {"message": message, "type": kind, "param": param, "code": status}})


def _anthropic_error(status: int, message: str, kind: str, param: str | None = None) -> bytes:
    """anthropic/api_router.py translate_error_response: AnthropicErrorResponse from the OpenAI error's
    type and message (protocol.py AnthropicError)."""
    return orjson.dumps({"type": "error", "error": {"type": kind, "message": message}})


def _sse(event: str, data: dict[str, Any]) -> bytes:
    """anthropic/serving.py wrap_data_with_event and openai/responses/api_router.py
    _convert_stream_to_sse_events: ``event: <type>`` then ``data: <json>``."""
    return b"event: " + event.encode() + b"\ndata: " + orjson.dumps(data) + b"\n\n"


def _text_parts(content: Any, text_types: tuple[str, ...]) -> Any:
    """A content list in the chat template's terms: text parts as ``text``, anything else as an image."""
    if not isinstance(content, list):
        return content
    return [{"type": "text", "text": part.get("text", "")} if isinstance(part, dict) and part.get("type") in text_types
            else {"type": "image"} for part in content]


@dataclass(frozen=True)
class Api:
    path: str

    def error(self, status: int, message: str, kind: str, param: str | None = None) -> bytes:
        return _openai_error(status, message, kind, param)

    def check(self, body: dict[str, Any]) -> str | None:
        raise NotImplementedError

    def prompt(self, body: dict[str, Any]) -> str:
        raise NotImplementedError

    def max_tokens(self, body: dict[str, Any]) -> int:
        raise NotImplementedError

    def full(self, model: str, tokens: list[str], prompt_tokens: int, body: dict[str, Any]) -> dict[str, Any]:
        raise NotImplementedError

    def stream(self, model: str, tokens: list[str], prompt_tokens: int, body: dict[str, Any]) -> list[bytes]:
        raise NotImplementedError


class Messages(Api):
    """anthropic/protocol.py AnthropicMessagesRequest/Response; serving.py renders it as a chat request
    (``system`` first, then the messages) through the chat template."""

    def error(self, status: int, message: str, kind: str, param: str | None = None) -> bytes:
        return _anthropic_error(status, message, kind, param)

    def check(self, body: dict[str, Any]) -> str | None:
        if not isinstance(body.get("messages"), list):
            return "messages: Field required"
        max_tokens = body.get("max_tokens")
        if not isinstance(max_tokens, int) or isinstance(max_tokens, bool):
            return "max_tokens: Field required"
        if max_tokens <= 0:
            return "max_tokens must be positive"
        params = body.get("kv_transfer_params")
        producer = isinstance(params, dict) and params.get("do_remote_decode")
        thinking = body.get("thinking")
        if (not producer and isinstance(thinking, dict) and thinking.get("type") == "enabled"
                and isinstance(thinking.get("budget_tokens"), int) and thinking["budget_tokens"] >= max_tokens):
            return "thinking.budget_tokens must be less than max_tokens"  # validate_thinking_budget
        return None

    def prompt(self, body: dict[str, Any]) -> str:
        messages = [{"role": m.get("role"), "content": _text_parts(m.get("content"), ("text",))}
                    for m in body["messages"] if isinstance(m, dict)]
        system = body.get("system")
        if system is not None:
            messages.insert(0, {"role": "system", "content": _text_parts(system, ("text",))})
        return text.chat_prompt(messages)

    def max_tokens(self, body: dict[str, Any]) -> int:
        return int(body["max_tokens"])

    def full(self, model: str, tokens: list[str], prompt_tokens: int, body: dict[str, Any]) -> dict[str, Any]:
        # api_router.py create_messages: model_dump(exclude_none=True), so a null handoff is left out.
        return {"id": "msg_" + secrets.token_hex(12), "type": "message", "role": "assistant",
                "content": [{"type": "text", "text": "".join(tokens)}], "model": model, "stop_reason": "max_tokens",
                "usage": {"input_tokens": prompt_tokens, "output_tokens": len(tokens)}}

    def stream(self, model: str, tokens: list[str], prompt_tokens: int, body: dict[str, Any]) -> list[bytes]:
        # serving.py message_stream_converter: message_start, one text block, message_delta, message_stop.
        message_id = "msg_" + secrets.token_hex(12)
        frames = [_sse("message_start", {"type": "message_start", "message": {
            "id": message_id, "type": "message", "role": "assistant", "content": [], "model": model,
            "stop_reason": None, "stop_sequence": None, "usage": {"input_tokens": prompt_tokens, "output_tokens": 0}}}),
            _sse("content_block_start", {"type": "content_block_start", "index": 0,
                                         "content_block": {"type": "text", "text": ""}})]
        frames += [_sse("content_block_delta", {"type": "content_block_delta", "index": 0,
                                                "delta": {"type": "text_delta", "text": token}}) for token in tokens]
        frames += [_sse("content_block_stop", {"type": "content_block_stop", "index": 0}),
                   _sse("message_delta", {"type": "message_delta", "delta": {"stop_reason": "max_tokens",
                                                                             "stop_sequence": None},
                                          "usage": {"input_tokens": prompt_tokens, "output_tokens": len(tokens)}}),
                   _sse("message_stop", {"type": "message_stop"})]
        return frames


class Responses(Api):
    """openai/responses/protocol.py ResponsesRequest/ResponsesResponse; serving.py renders ``instructions``
    as the system message, then ``input`` (a string is one user message)."""

    def check(self, body: dict[str, Any]) -> str | None:
        if "input" not in body:
            return "input: Field required"
        if body.get("background") and body.get("store") is False:  # protocol.py validate_background
            return "background can only be used when `store` is true"
        return None

    def prompt(self, body: dict[str, Any]) -> str:
        source = body["input"]
        items = [{"role": "user", "content": source}] if isinstance(source, str) else source
        messages = [{"role": item.get("role", "user"),
                     "content": _text_parts(item.get("content"), ("input_text", "output_text", "text"))}
                    for item in items if isinstance(item, dict)]
        if isinstance(body.get("instructions"), str):
            messages.insert(0, {"role": "system", "content": body["instructions"]})
        return text.chat_prompt(messages)

    def max_tokens(self, body: dict[str, Any]) -> int:
        value = body.get("max_output_tokens")
        return int(value) if isinstance(value, int) else DEFAULT_MAX_TOKENS

    def full(self, model: str, tokens: list[str], prompt_tokens: int, body: dict[str, Any]) -> dict[str, Any]:
        # protocol.py ResponsesResponse.from_request (model_dump by alias, nulls kept; no ``store`` member);
        # a cap reached is status "incomplete". Usage as serving.py responses_full_generator (ResponseUsage
        # with per-turn lists, empty for one turn without tools).
        return {"id": str(body.get("request_id") or "resp_" + secrets.token_hex(12)), "created_at": int(time.time()),
                "incomplete_details": {"reason": "max_output_tokens"}, "instructions": body.get("instructions"),
                "metadata": None, "model": model, "object": "response",
                "output": [{"id": "msg_" + secrets.token_hex(8), "content": [
                    {"annotations": [], "text": "".join(tokens), "type": "output_text", "logprobs": None}],
                    "role": "assistant", "status": "completed", "type": "message", "phase": None}],
                "parallel_tool_calls": True, "temperature": float(body.get("temperature", 1.0) or 0.0),
                "tool_choice": "auto", "tools": [], "top_p": 1.0, "background": bool(body.get("background")),
                "max_output_tokens": self.max_tokens(body), "max_tool_calls": None,
                "previous_response_id": body.get("previous_response_id"), "prompt": None, "reasoning": None,
                "service_tier": "auto", "status": "incomplete", "text": None, "top_logprobs": None,
                "truncation": "disabled", "usage": {
                    "input_tokens": prompt_tokens,
                    "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0,
                                             "input_tokens_per_turn": [], "cached_tokens_per_turn": []},
                    "output_tokens": len(tokens),
                    "output_tokens_details": {"reasoning_tokens": 0, "tool_output_tokens": 0,
                                              "output_tokens_per_turn": [], "tool_output_tokens_per_turn": []},
                    "total_tokens": prompt_tokens + len(tokens)},
                "user": None, "input_messages": None, "output_messages": None, "frequency_penalty": 0.0,
                "presence_penalty": 0.0, "kv_transfer_params": None, "ec_transfer_params": None}

    def stream(self, model: str, tokens: list[str], prompt_tokens: int, body: dict[str, Any]) -> list[bytes]:
        # serving.py responses_stream_generator (simple context): created, in_progress, the item and its
        # part, one output_text.delta per token, the done events, then completed; sequence numbers count up.
        response = self.full(model, tokens, prompt_tokens, body)
        item_id = response["output"][0]["id"]
        in_progress = {**response, "status": "in_progress", "output": [], "incomplete_details": None, "usage": None}
        events: list[dict[str, Any]] = [
            {"type": "response.created", "response": in_progress},
            {"type": "response.in_progress", "response": in_progress},
            {"type": "response.output_item.added", "output_index": 0,
             "item": {"id": item_id, "type": "message", "role": "assistant", "status": "in_progress", "content": [],
                      "phase": None}},
            {"type": "response.content_part.added", "item_id": item_id, "output_index": 0, "content_index": 0,
             "part": {"type": "output_text", "text": "", "annotations": [], "logprobs": []}}]
        events += [{"type": "response.output_text.delta", "item_id": item_id, "output_index": 0, "content_index": 0,
                    "delta": token, "logprobs": []} for token in tokens]
        events += [{"type": "response.output_text.done", "item_id": item_id, "output_index": 0, "content_index": 0,
                    "text": "".join(tokens), "logprobs": []},
                   {"type": "response.content_part.done", "item_id": item_id, "output_index": 0, "content_index": 0,
                    "part": response["output"][0]["content"][0]},
                   {"type": "response.output_item.done", "output_index": 0, "item": response["output"][0]},
                   {"type": "response.completed", "response": response}]
        return [_sse(event["type"], {**event, "sequence_number": i}) for i, event in enumerate(events)]


def token_id(token: str) -> int:
    """The emulated vocabulary's id of a generated token."""
    return int.from_bytes(hashlib.sha256(token.encode()).digest()[:2], "big")


class Generate(Api):
    """scale_out/token_in_token_out/protocol.py GenerateRequest/GenerateResponseBase (output_mode
    "tokens"): token ids in, token ids out; the caps are in ``sampling_params``."""

    def check(self, body: dict[str, Any]) -> str | None:
        token_ids = body.get("token_ids")
        if not isinstance(token_ids, list) or not token_ids:
            return "token_ids: List should have at least 1 item after validation"
        params = body.get("sampling_params")
        if not isinstance(params, dict):
            return "sampling_params: Field required"
        min_tokens, max_tokens = params.get("min_tokens"), params.get("max_tokens")
        if isinstance(min_tokens, int) and isinstance(max_tokens, int) and min_tokens > max_tokens:
            return "min_tokens must be less than or equal to max_tokens"  # vllm/sampling_params.py
        return None

    def prompt(self, body: dict[str, Any]) -> str:
        return text.completion_prompt(body["token_ids"])

    def max_tokens(self, body: dict[str, Any]) -> int:
        value = body["sampling_params"].get("max_tokens")
        return int(value) if isinstance(value, int) else DEFAULT_MAX_TOKENS

    def full(self, model: str, tokens: list[str], prompt_tokens: int, body: dict[str, Any]) -> dict[str, Any]:
        # serving.py serve_tokens_full_generator: every member dumped, nulls kept; weight_versions spans
        # the whole output (GenerateChoiceBase).
        return {"request_id": str(body.get("request_id") or secrets.token_hex(16)), "model": model,
                "created": int(time.time()),
                "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens + len(tokens),
                          "completion_tokens": len(tokens), "prompt_tokens_details": None,
                          "completion_tokens_details": None},
                "prompt_logprobs": None, "prompt_token_id_logprobs": None, "prompt_token_ids": None,
                "mm_placeholders": None, "metrics": None, "kv_transfer_params": None, "ec_transfer_params": None,
                "output_mode": "tokens",
                "choices": [{"index": 0, "logprobs": None, "finish_reason": "length", "stop_reason": None,
                             "token_ids": [token_id(token) for token in tokens], "routed_experts": None,
                             "sampling_mask": None,
                             "weight_versions": [{"start": 0, "end": len(tokens), "version": "0"}]}]}

    def stream(self, model: str, tokens: list[str], prompt_tokens: int, body: dict[str, Any]) -> list[bytes]:
        # serving.py serve_tokens_stream_generator: ``data: <chunk>`` per step, then ``data: [DONE]``.
        request_id = str(body.get("request_id") or secrets.token_hex(16))
        # Each chunk dumps every member but prompt_token_ids, mm_placeholders and metrics while they are null;
        # weight_versions is set on the final chunk only (protocol.py GenerateStreamChoiceBase).
        last = len(tokens) - 1
        frames = [b"data: " + orjson.dumps({
            "request_id": request_id, "usage": None, "output_mode": "tokens",
            "choices": [{"index": 0, "finish_reason": "length" if i == last else None, "stop_reason": None,
                         "token_ids": [token_id(token)], "routed_experts": None, "sampling_mask": None,
                         "weight_versions": [{"start": 0, "end": len(tokens), "version": "0"}] if i == last else None,
                         "logprobs": None}]}) + b"\n\n" for i, token in enumerate(tokens)]
        return [*frames, b"data: [DONE]\n\n"]


APIS: dict[str, Api] = {api.path: api for api in (Messages("/v1/messages"), Responses("/v1/responses"),
                                                   Generate("/inference/v1/generate"))}
