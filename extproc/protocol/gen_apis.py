"""Request checks for the generation APIs beyond OpenAI chat and completions: the Anthropic Messages API
(/v1/messages), the OpenAI Responses API (/v1/responses), vLLM's token-in /inference/v1/generate and
SGLang's native /generate. Pure.

Each check raises invalid_request_field for a field P/D depends on that has the wrong type (both legs
would otherwise fail, one after the other) and returns the field that selects a variant P/D cannot
serve (see PROTOCOL.md, "Generation APIs"), or None. Field names come from this module only.
"""

from __future__ import annotations

from typing import Any

from extproc.protocol.errors import Code, PdError
from extproc.protocol.fields import all_ints, is_int


def _positive_int(body: dict[str, Any], name: str, *, required: bool = False) -> None:
    value = body.get(name)
    if value is None and not required:
        return
    if not (is_int(value) and value >= 1):  # type: ignore[operator]
        raise PdError(Code.INVALID_REQUEST_FIELD, field=name)


def check_messages(body: dict[str, Any]) -> str | None:
    """vLLM anthropic/protocol.py AnthropicMessagesRequest: ``messages`` a list, ``max_tokens`` a
    required positive int (validate_max_tokens). The API has no ``n``: every request is one answer."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise PdError(Code.INVALID_REQUEST_FIELD, field="messages")
    _positive_int(body, "max_tokens", required=True)
    return None


# Tool types the Responses API may run on the server (vLLM responses/serving.py
# _generate_with_builtin_tools: a tool call starts another generation turn that reuses the request's
# sampling params, handoff included). Only client-side function tools are served P/D.
_CLIENT_TOOL_TYPES = frozenset({"function"})


def check_responses(body: dict[str, Any]) -> str | None:
    """vLLM openai/responses/protocol.py ResponsesRequest. ``input`` a string or a list;
    ``max_output_tokens`` a positive int when set. State kept on a worker cannot be split between two:
    ``previous_response_id`` names a response only the worker that stored it has, ``background`` runs
    the request as a stored job (_create_responses), ``conversation`` names a stored conversation, and a
    server-side tool starts further turns on one worker. Those go unsupported."""
    value = body.get("input")
    if not (isinstance(value, str) or (isinstance(value, list) and value)):
        raise PdError(Code.INVALID_REQUEST_FIELD, field="input")
    _positive_int(body, "max_output_tokens")
    for name in ("store", "background"):
        flag = body.get(name)
        if flag is not None and not isinstance(flag, bool):
            raise PdError(Code.INVALID_REQUEST_FIELD, field=name)
    if body.get("previous_response_id") is not None:
        return "previous_response_id"
    if body.get("conversation") is not None:
        return "conversation"
    if body.get("background") is True:
        return "background"
    tools = body.get("tools")
    if tools is not None:
        if not isinstance(tools, list) or not all(isinstance(tool, dict) for tool in tools):
            raise PdError(Code.INVALID_REQUEST_FIELD, field="tools")
        if any(tool.get("type") not in _CLIENT_TOOL_TYPES for tool in tools):
            return "tools"
    return None



def check_generate(body: dict[str, Any]) -> str | None:
    """vLLM scale_out/token_in_token_out/protocol.py GenerateRequest: ``token_ids`` a non-empty list of
    non-negative ints, ``sampling_params`` a required object (vLLM's SamplingParams), whose ``n``
    must be 1 (vLLM returns one handoff per request) and whose ``max_tokens`` is a positive int when set."""
    token_ids = body.get("token_ids")
    if not (isinstance(token_ids, list) and token_ids and all_ints(token_ids)
            and min(token_ids) >= 0):
        raise PdError(Code.INVALID_REQUEST_FIELD, field="token_ids")
    params = body.get("sampling_params")
    if not isinstance(params, dict):
        raise PdError(Code.INVALID_REQUEST_FIELD, field="sampling_params")
    max_tokens = params.get("max_tokens")
    if max_tokens is not None and not (is_int(max_tokens) and max_tokens >= 1):
        raise PdError(Code.INVALID_REQUEST_FIELD, field="sampling_params.max_tokens")
    n = params.get("n")
    if n is not None and not (is_int(n) and n == 1):
        return "sampling_params.n"
    return None


def check_sglang_generate(body: dict[str, Any]) -> str | None:
    """SGLang srt/managers/io_struct.py GenerateReqInput (its contract: sglang/api/v1/api_types.py
    GenerateRequest): one prompt as ``text`` (a string) or ``input_ids`` (token ids). A batch (a list
    of texts, of id lists, of sampling params) and ``n`` other than 1 are several requests
    (_determine_batch_size, parallel_sample_num), which one bootstrap room cannot serve; so are
    ``input_embeds`` prompts, whose batch shape we do not read."""
    if body.get("input_embeds") is not None:
        return "input_embeds"
    text, input_ids = body.get("text"), body.get("input_ids")
    if text is not None:
        if isinstance(text, list):
            return "text"
        if not isinstance(text, str) or input_ids is not None:
            raise PdError(Code.INVALID_REQUEST_FIELD, field="text")
    elif isinstance(input_ids, list) and input_ids and not all_ints(input_ids):
        if all(isinstance(ids, list) for ids in input_ids):
            return "input_ids"
        raise PdError(Code.INVALID_REQUEST_FIELD, field="input_ids")
    elif not (isinstance(input_ids, list) and input_ids):
        raise PdError(Code.INVALID_REQUEST_FIELD, field="input_ids")
    params = body.get("sampling_params")
    if isinstance(params, list):
        return "sampling_params"
    if params is not None and not isinstance(params, dict):
        raise PdError(Code.INVALID_REQUEST_FIELD, field="sampling_params")
    n = (params or {}).get("n")
    if n is not None and not (is_int(n) and n == 1):
        return "sampling_params.n"
    return None
