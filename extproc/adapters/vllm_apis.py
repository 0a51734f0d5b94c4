"""vLLM's derived prefill requests on the Messages, Responses and generate APIs. Pure.

The prefill leg uses the client's own API (never a conversion: each API renders its own prompt) and
differs from the client's request only in what makes it a one-token, non-streamed, side-effect-free
producer request. Every other member keeps its bytes. The rules and their sources are in PROTOCOL.md
("vllm_nixl: generation APIs").
"""

from __future__ import annotations

from collections.abc import Mapping

from extproc.core import jsonspan
from extproc.core.openai_request import ClientRequest, Endpoint

_ONE = b"1"
_FALSE = b"false"


def _rewrite(raw: bytes, spans: list[jsonspan.Member] | tuple[jsonspan.Member, ...],
             values: Mapping[str, bytes | None]) -> bytes:
    """``raw`` with each named member set (in place where present, appended in ``values``' order where
    absent) or dropped (None)."""
    present = {member.name for member in spans}
    append = [(name, value) for name, value in values.items() if name not in present and value is not None]
    return jsonspan.rebuild(raw, spans, values, append)


def messages_prefill(request: ClientRequest, producer: tuple[str, bytes]) -> bytes:
    """Anthropic Messages (vllm anthropic/protocol.py AnthropicMessagesRequest): ``max_tokens`` is its
    only cap (serving.py maps it to both chat caps itself) and ``validate_thinking_budget`` skips a
    producer request, so a thinking budget above 1 is accepted."""
    key, params = producer
    return _rewrite(request.raw, request.members, {"stream": _FALSE, "max_tokens": _ONE, key: params})


def responses_prefill(request: ClientRequest, producer: tuple[str, bytes]) -> bytes:
    """Responses (vllm openai/responses/protocol.py ResponsesRequest; serving.py _create_responses):
    ``max_output_tokens`` is its cap; ``store`` defaults to true and would keep the one-token response
    and its input messages on the prefill worker (with VLLM_ENABLE_RESPONSES_API_STORE), so the prefill
    leg says ``store: false``; ``background`` is false (a background request is refused earlier)."""
    key, params = producer
    return _rewrite(request.raw, request.members, {
        "stream": _FALSE, "stream_options": None, "max_output_tokens": _ONE, "store": _FALSE, "background": None,
        key: params})


def generate_prefill(request: ClientRequest, producer: tuple[str, bytes]) -> bytes:
    """Token-in generate (vllm scale_out/token_in_token_out/protocol.py GenerateRequest): the caps live
    in ``sampling_params`` (vLLM's SamplingParams, which refuses min_tokens above max_tokens), rewritten
    member by member like the body (openai_request.NESTED_REWRITES)."""
    key, params = producer
    sampling_raw = jsonspan.member_value(request.raw, request.members, "sampling_params")
    assert sampling_raw is not None  # gen_apis.check_generate requires an object
    # Found, each key once, with the body's checks (off the event loop for a large body): a long stop
    # list scanned here would stall every stream.
    spans = request.nested["sampling_params"]
    sampling = _rewrite(sampling_raw, spans, {"max_tokens": _ONE, "min_tokens": None})
    return _rewrite(request.raw, request.members, {
        "stream": _FALSE, "stream_options": None, "sampling_params": sampling, key: params})


PREFILLS = {Endpoint.MESSAGES: messages_prefill, Endpoint.RESPONSES: responses_prefill,
            Endpoint.GENERATE: generate_prefill}
