"""vLLM's derived prefill requests on the Messages, Responses and generate APIs. Pure.

The prefill leg uses the client's own API (never a conversion: each API renders its own prompt) and
differs from the client's request only in what makes it a one-token, non-streamed, side-effect-free
producer request. Every other member keeps its bytes. The rules and their sources are in PROTOCOL.md
("vllm_nixl: generation APIs").
"""

from __future__ import annotations

from extproc.adapters.prefill_request import JSON_FALSE, JSON_ONE, one_token_unstreamed
from extproc.protocol import jsonspan
from extproc.protocol.fields import set_members
from extproc.protocol.openai_request import ClientRequest, Endpoint


def messages_prefill(request: ClientRequest, producer: tuple[str, bytes]) -> bytes:
    """Anthropic Messages (vllm anthropic/protocol.py AnthropicMessagesRequest): ``max_tokens`` is its
    only cap (serving.py maps it to both chat caps itself) and ``validate_thinking_budget`` skips a
    producer request, so a thinking budget above 1 is accepted."""
    key, params = producer
    return set_members(request.raw, request.members, {
        **one_token_unstreamed(["max_tokens"], drop_stream_options=False), key: params})


def responses_prefill(request: ClientRequest, producer: tuple[str, bytes]) -> bytes:
    """Responses (vllm openai/responses/protocol.py ResponsesRequest; serving.py _create_responses):
    ``max_output_tokens`` is its cap; ``store`` defaults to true and would keep the one-token response
    and its input messages on the prefill worker (with VLLM_ENABLE_RESPONSES_API_STORE), so the prefill
    leg says ``store: false``; ``background`` is false (a background request is refused earlier)."""
    key, params = producer
    return set_members(request.raw, request.members, {
        **one_token_unstreamed(["max_output_tokens"]), "store": JSON_FALSE, "background": None, key: params})


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
    sampling = set_members(sampling_raw, spans, {"max_tokens": JSON_ONE, "min_tokens": None})
    return set_members(request.raw, request.members, {
        **one_token_unstreamed(), "sampling_params": sampling, key: params})


PREFILLS = {Endpoint.MESSAGES: messages_prefill, Endpoint.RESPONSES: responses_prefill,
            Endpoint.GENERATE: generate_prefill}
