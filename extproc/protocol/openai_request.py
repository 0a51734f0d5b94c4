"""Validation of the client's OpenAI request, before either leg runs. Pure: bytes in, a value or PdError out.

We check only what the P/D path depends on; everything else is the engines' business and reaches
them verbatim.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

import orjson

from extproc.protocol import gen_apis, jsonspan
from extproc.protocol.errors import Code, PdError
from extproc.protocol.fields import all_ints, is_int


class Endpoint(StrEnum):
    CHAT = "/v1/chat/completions"
    COMPLETIONS = "/v1/completions"
    MESSAGES = "/v1/messages"  # Anthropic Messages API (vLLM)
    RESPONSES = "/v1/responses"  # OpenAI Responses API (vLLM)
    GENERATE = "/inference/v1/generate"  # vLLM's token-in generate API
    SGLANG_GENERATE = "/generate"  # SGLang's native generate API

    @property
    def api(self) -> str:
        """The API's short name: the ``api`` label of metrics, logs and traces."""
        return _API_NAMES[self]


_API_NAMES = {Endpoint.CHAT: "chat", Endpoint.COMPLETIONS: "completions", Endpoint.MESSAGES: "messages",
              Endpoint.RESPONSES: "responses", Endpoint.GENERATE: "generate",
              Endpoint.SGLANG_GENERATE: "sglang_generate"}
# The endpoints every engine serves P/D; an adapter that serves more lists them (its ``endpoints``).
OPENAI_ENDPOINTS = frozenset({Endpoint.CHAT, Endpoint.COMPLETIONS})


def paths_of(endpoints: frozenset[Endpoint]) -> frozenset[str]:
    """The request paths of ``endpoints`` (what a route or the gateway decision compares a path with)."""
    return frozenset(endpoint.value for endpoint in endpoints)


@dataclass(frozen=True, slots=True)
class ClientRequest:
    endpoint: Endpoint
    path: str  # the original :path, query string included
    raw: bytes  # the client's body, exactly as received
    # The parsed body (read-only by convention). On the P/D route (protocol/inspection.py) only the members
    # whose values are small are kept: large ones were checked and are read from ``raw`` only.
    body: dict[str, Any]
    members: tuple[jsonspan.Member, ...]
    # The field that selects a variant P/D cannot serve as sent (n other than 1, a batch of prompts):
    # refused, or with PD_EXTPROC_UNSUPPORTED_VARIANTS=aggregated served whole by the decode worker.
    unsupported: str | None = None
    # The member spans of a nested object the prefill body rewrites member by member (NESTED_REWRITES),
    # relative to that member's value: found with the body's checks, so off the event loop for a large body.
    nested: Mapping[str, tuple[jsonspan.Member, ...]] = field(default_factory=dict)

    @property
    def stream(self) -> bool:
        return self.body.get("stream") is True


# Fields whose types we rely on. Names here are the only request names an error can carry.
_OPTIONAL_BOOL = ("stream",)
_OPTIONAL_POSITIVE_INT = ("max_tokens", "max_completion_tokens")
# Top-level members a body may have: the OpenAI request has a few dozen, the engines' extensions as many
# again. The bound keeps what a worker process answers about a body (protocol/inspection.py) small.
MAX_MEMBERS = 256


def endpoint_of(path: str, served: frozenset[Endpoint] = OPENAI_ENDPOINTS) -> Endpoint:
    bare = path.split("?", 1)[0]
    for endpoint in served:
        if bare == endpoint.value:
            return endpoint
    raise PdError(Code.UNSUPPORTED_ENDPOINT)


def is_json_content_type(value: str | None) -> bool:
    if value is None:
        return False
    media = value.split(";", 1)[0].strip().lower()
    return media == "application/json" or (media.startswith("application/") and media.endswith("+json"))


def precheck(path: str, content_type: str | None, raw: bytes, max_bytes: int,
             served: frozenset[Endpoint] = OPENAI_ENDPOINTS) -> None:
    """The checks of ``parse_client_request`` that do not read the body, in its order (cheap at any size).
    ``served`` are the endpoints the adapter serves P/D."""
    endpoint_of(path, served)
    if len(raw) > max_bytes:
        raise PdError(Code.REQUEST_TOO_LARGE)
    if not is_json_content_type(content_type):
        raise PdError(Code.UNSUPPORTED_MEDIA_TYPE)


def parse_client_request(path: str, content_type: str | None, raw: bytes, max_bytes: int,
                         allow_unsupported: bool = False,
                         served: frozenset[Endpoint] = OPENAI_ENDPOINTS) -> ClientRequest:
    """Validate the request the client sent on the P/D route; raise PdError for anything we refuse.
    With ``allow_unsupported`` an unsupported variant is returned (``unsupported`` names it), not refused.
    ``served`` are the endpoints the adapter serves P/D."""
    precheck(path, content_type, raw, max_bytes, served)
    endpoint = endpoint_of(path, served)
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError:
        raise PdError(Code.INVALID_REQUEST_BODY) from None
    if not isinstance(body, dict):
        raise PdError(Code.INVALID_REQUEST_BODY)
    try:
        members = jsonspan.unique_members(raw)
    except jsonspan.RepeatedKey:  # we refuse rather than guess which duplicate the engine sees
        raise PdError(Code.INVALID_REQUEST_BODY) from None
    if len(members) > MAX_MEMBERS:
        raise PdError(Code.INVALID_REQUEST_BODY)
    unsupported = _check_fields(endpoint, body)
    request = ClientRequest(endpoint=endpoint, path=path, raw=raw, body=body, members=tuple(members),
                            unsupported=unsupported, nested=_nested_spans(endpoint, raw, members))
    if not allow_unsupported:
        refuse_unsupported(request)
    return request


# The nested objects whose members a derived prefill body rewrites, per endpoint (vLLM's generate API keeps
# its caps in ``sampling_params``: adapters/vllm_apis.py).
NESTED_REWRITES: Mapping[Endpoint, tuple[str, ...]] = {Endpoint.GENERATE: ("sampling_params",)}


def _nested_spans(endpoint: Endpoint, raw: bytes,
                  members: list[jsonspan.Member]) -> dict[str, tuple[jsonspan.Member, ...]]:
    """The spans of each NESTED_REWRITES object present, each key once (a repeated one is refused as in the
    body: we do not guess which copy the engine reads)."""
    spans = {}
    for name in NESTED_REWRITES.get(endpoint, ()):
        value = jsonspan.member_value(raw, members, name)
        if value is None or not value.lstrip().startswith(b"{"):
            continue
        try:
            spans[name] = tuple(jsonspan.unique_members(value))
        except jsonspan.RepeatedKey:
            raise PdError(Code.INVALID_REQUEST_BODY) from None
    return spans


def refuse_unsupported(request: ClientRequest) -> None:
    """Raise unsupported_pd_variant for a request P/D cannot serve as sent."""
    if request.unsupported is not None:
        raise PdError(Code.UNSUPPORTED_PD_VARIANT, field=request.unsupported)


def _check_fields(endpoint: Endpoint, body: dict[str, Any]) -> str | None:
    """Raise for a field of the wrong type; return the field that selects an unsupported variant."""
    for name in _OPTIONAL_BOOL:
        value = body.get(name)
        if value is not None and not isinstance(value, bool):
            raise PdError(Code.INVALID_REQUEST_FIELD, field=name)
    for name in _OPTIONAL_POSITIVE_INT:
        value = body.get(name)
        if value is not None and not (is_int(value) and value >= 1):
            raise PdError(Code.INVALID_REQUEST_FIELD, field=name)
    other_api = _OTHER_APIS.get(endpoint)
    if other_api is not None:
        return other_api(body)
    unsupported = None
    if endpoint is Endpoint.CHAT:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise PdError(Code.INVALID_REQUEST_FIELD, field="messages")
    elif _prompt_is_batch(body.get("prompt")):
        unsupported = "prompt"
    n = body.get("n")
    if n is not None and not (is_int(n) and n == 1):
        unsupported = "n"
    return unsupported


_OTHER_APIS = {Endpoint.MESSAGES: gen_apis.check_messages, Endpoint.RESPONSES: gen_apis.check_responses,
               Endpoint.GENERATE: gen_apis.check_generate, Endpoint.SGLANG_GENERATE: gen_apis.check_sglang_generate}


def _prompt_is_batch(prompt: object) -> bool:
    """A completions prompt must be one prompt: a string, a list of token ids, or a one-item batch.

    vLLM returns kv_transfer_params for the first prompt of a batch only, so a batch cannot be
    disaggregated correctly.
    """
    if isinstance(prompt, str):
        return False
    if isinstance(prompt, list) and prompt:
        if all_ints(prompt):
            return False
        one = len(prompt) == 1 and (isinstance(prompt[0], str) or
                                    (isinstance(prompt[0], list) and all_ints(prompt[0])))
        return not one
    raise PdError(Code.INVALID_REQUEST_FIELD, field="prompt")
