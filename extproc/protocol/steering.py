"""What a client could send to make an engine connect somewhere or hold KV: the request fields and headers
that steer KV transfer (or encoder-cache transfer), read in each engine's source at our pins. Pure data.

On the P/D route the adapters refuse their own reserved fields (fields.py) and remove their own headers;
on every other route Envoy refuses these fields and removes these headers (extproc/envoy/guard.py), unless the
operator set PD_EXTPROC_TRUST_CLIENT_STEERING. The list is the union over the engines: a name here
means nothing to the other engines, so one list serves every adapter (and adapter ``none``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from extproc.protocol.errors import Code, PdError


@dataclass(frozen=True, slots=True)
class SteeringField:
    """A JSON member, as the path of object keys from the body's top level, and where an engine reads it."""

    path: tuple[str, ...]
    engine: str
    source: str

    @property
    def name(self) -> str:
        """The OpenAI ``param`` of a refusal: the dotted path."""
        return ".".join(self.path)


@dataclass(frozen=True, slots=True)
class SteeringHeader:
    name: str
    engine: str
    source: str


_VLLM_MODELS = ("vLLM 0.32.0 request models: entrypoints/openai/chat_completion/protocol.py ChatCompletionRequest, "
                "openai/completion/protocol.py CompletionRequest, openai/responses/protocol.py ResponsesRequest, "
                "anthropic/protocol.py AnthropicMessagesRequest, cohere/protocol.py CohereChatV2Request, "
                "scale_out/token_in_token_out/protocol.py GenerateRequest")
_VLLM_XARGS = ("vLLM 0.32.0: to_sampling_params of ChatCompletionRequest, CompletionRequest, ResponsesRequest "
               "(extra_args starts as vllm_xargs); AnthropicMessagesRequest.vllm_xargs; read by v1/request.py "
               "Request.__init__ (sampling_params.extra_args.get)")
_VLLM_GENERATE = ("vLLM 0.32.0: scale_out/token_in_token_out/protocol.py GenerateRequest.sampling_params "
                  "(SamplingParams.extra_args, vllm/sampling_params.py); read by v1/request.py Request.__init__")
_SGLANG_MODELS = ("SGLang 0.5.23: srt/entrypoints/openai/protocol.py PDRoutingFields (ChatCompletionRequest, "
                  "CompletionRequest, ResponsesRequest; anthropic/protocol.py AnthropicMessagesRequest); "
                  "srt/managers/io_struct.py GenerateReqInput (/generate)")
_SGLANG_VERTEX = ("SGLang 0.5.23: srt/entrypoints/http_server.py vertex_generate (parameters is splatted into "
                  "GenerateReqInput)")
_TRTLLM_MODELS = ("TensorRT-LLM: tensorrt_llm/serve/openai_protocol.py ChatCompletionRequest, CompletionRequest "
                  "(disaggregated_params: DisaggregatedParams, with ctx_info_endpoint)")

STEERING_FIELDS: tuple[SteeringField, ...] = (
    # vLLM: kv_transfer_params drives the KV connector (NIXL: remote_host/remote_port to pull from,
    # do_remote_decode to compute and lease KV as a producer); ec_transfer_params does the same for the
    # encoder cache connector.
    SteeringField(("kv_transfer_params",), "vllm", _VLLM_MODELS),
    SteeringField(("ec_transfer_params",), "vllm",
                  _VLLM_MODELS.replace(", cohere/protocol.py CohereChatV2Request", "")),
    SteeringField(("vllm_xargs", "kv_transfer_params"), "vllm", _VLLM_XARGS),
    SteeringField(("vllm_xargs", "ec_transfer_params"), "vllm", _VLLM_XARGS),
    SteeringField(("sampling_params", "extra_args", "kv_transfer_params"), "vllm", _VLLM_GENERATE),
    SteeringField(("sampling_params", "extra_args", "ec_transfer_params"), "vllm", _VLLM_GENERATE),
    # SGLang: the decode engine dials bootstrap_host:bootstrap_port and waits for bootstrap_room;
    # disagg_prefill_dp_rank tells it which prefill rank holds the KV; bootstrap_pair_key (/generate only).
    SteeringField(("bootstrap_host",), "sglang", _SGLANG_MODELS),
    SteeringField(("bootstrap_port",), "sglang", _SGLANG_MODELS),
    SteeringField(("bootstrap_room",), "sglang", _SGLANG_MODELS),
    SteeringField(("disagg_prefill_dp_rank",), "sglang", _SGLANG_MODELS),
    SteeringField(("bootstrap_pair_key",), "sglang", "SGLang 0.5.23: srt/managers/io_struct.py GenerateReqInput"),
    SteeringField(("parameters", "bootstrap_host"), "sglang", _SGLANG_VERTEX),
    SteeringField(("parameters", "bootstrap_port"), "sglang", _SGLANG_VERTEX),
    SteeringField(("parameters", "bootstrap_room"), "sglang", _SGLANG_VERTEX),
    SteeringField(("parameters", "disagg_prefill_dp_rank"), "sglang", _SGLANG_VERTEX),
    SteeringField(("parameters", "bootstrap_pair_key"), "sglang", _SGLANG_VERTEX),
    # TensorRT-LLM: generation_only params name the context worker (ctx_info_endpoint) and its request.
    SteeringField(("disaggregated_params",), "trtllm", _TRTLLM_MODELS),
)

_SGLANG_OVERRIDES = ("SGLang 0.5.23: srt/entrypoints/request_headers.py _HEADER_OVERRIDES, apply_header_overrides "
                     "(http_server.py serve_generate_request, openai/serving_chat.py) with "
                     "SGLANG_ENABLE_REQUEST_HEADER_OVERRIDES=1")

STEERING_HEADERS: tuple[SteeringHeader, ...] = (
    SteeringHeader("x-override-bootstrap-host", "sglang", _SGLANG_OVERRIDES),
    SteeringHeader("x-override-bootstrap-port", "sglang", _SGLANG_OVERRIDES),
    SteeringHeader("x-override-bootstrap-room", "sglang", _SGLANG_OVERRIDES),
    SteeringHeader("x-override-disagg-prefill-dp-rank", "sglang", _SGLANG_OVERRIDES),
    # Signs a generation_only request's ctx_info_endpoint; only our P/D route may send one.
    SteeringHeader("x-trtllm-disagg-auth", "trtllm",
                   "TensorRT-LLM: tensorrt_llm/serve/disagg_auth.py INTERNAL_DISAGG_AUTH_HEADER, "
                   "validate_internal_disagg_request"),
)
STEERING_HEADER_NAMES = frozenset(header.name for header in STEERING_HEADERS)

# Where a value other than null is tolerated, as the vllm_nixl adapter does on the P/D route: the {}
# some SDKs send for kv_transfer_params (vLLM ignores a falsy kv_transfer_params: to_sampling_params).
EMPTY_OBJECT_TOLERATED = frozenset({"kv_transfer_params"})


def _value_at(body: Mapping[str, object], path: tuple[str, ...]) -> tuple[bool, object]:
    node: object = body
    for key in path:
        if not isinstance(node, Mapping) or key not in node:
            return False, None
        node = node[key]
    return True, node


_TOP_LEVEL_NAMES = frozenset(field.path[0] for field in STEERING_FIELDS)


def refuse_steering(body: Mapping[str, object], skip: frozenset[str] = frozenset()) -> None:
    """Raise reserved_request_field for the first steering member the client set (null, and {} where
    tolerated, count as not set). ``skip``: top-level names the adapter checks itself."""
    if body.keys().isdisjoint(_TOP_LEVEL_NAMES):  # no field's path can start: nothing set (one C call)
        return
    for field in STEERING_FIELDS:
        if field.path[0] in skip and len(field.path) == 1:
            continue
        present, value = _value_at(body, field.path)
        if not present or value is None:
            continue
        if field.name in EMPTY_OBJECT_TOLERATED and value == {} and isinstance(value, dict):
            continue
        raise PdError(Code.RESERVED_REQUEST_FIELD, field=field.name)
