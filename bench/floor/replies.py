"""What the grpc.aio floor and its variants answer (bench/floor/aio.py). Pure: a message in, a message out.

  plain   continue on the headers; the client's body back with its content-length (floor-aio, and the
          delay and burn variants, which only wait or spin before they answer)
  shape   continue on the headers; our own reply to a successful vllm_nixl P/D request (floor-aio-shape):
          content-length set, the remove_headers list PdProcessor._decode_reply sends for vllm_nixl (the
          adapter's reserved headers, none, and the steering headers, sorted), and the client's body with a
          cheap prefill worker's kv_transfer_params appended as vllm_nixl.decode_body appends it, naming
          the cheap prefill worker's engine id so that the cheap decode worker counts a consumer leg
"""

from __future__ import annotations

import json

from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from bench.cheap_worker import DEFAULT_ENGINE_ID, vllm_handoff
from extproc.adapters.vllm_nixl import KEY, VllmNixlAdapter
from extproc.protocol.steering import STEERING_HEADER_NAMES

_OVERWRITE = base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD
SHAPE_REQUEST_ID = "floor-shape"  # one id for every request: decode counts consumer legs, not distinct ids
SHAPE_HANDOFF = json.dumps(vllm_handoff(DEFAULT_ENGINE_ID, SHAPE_REQUEST_ID)).encode()
SHAPE_REMOVE_HEADERS = tuple(sorted(VllmNixlAdapter.reserved_headers | STEERING_HEADER_NAMES))
_MEMBER = b',"' + KEY.encode() + b'":'


def shaped_body(client_body: bytes, handoff: bytes = SHAPE_HANDOFF) -> bytes:
    """The client's body with ``handoff`` as its last member, kv_transfer_params: vllm_nixl.decode_body's
    bytes for a compact JSON object without that member (the benchmark's bodies), with no parse."""
    body = client_body.rstrip()
    if not body.endswith(b"}") or body.endswith(b"{}"):
        raise ValueError("not a non-empty JSON object")
    return body[:-1] + _MEMBER + handoff + b"}"


def _set_length(mutation: pb.HeaderMutation, body: bytes) -> None:
    header = mutation.set_headers.add(append_action=_OVERWRITE).header
    header.key = "content-length"
    header.raw_value = b"%d" % len(body)


def plain_reply(request: pb.ProcessingRequest) -> pb.ProcessingResponse:
    """Continue on headers; the same body back, with its content-length, on the body."""
    response = pb.ProcessingResponse()
    kind = request.WhichOneof("request")
    if kind == "request_body":
        body = request.request_body.body
        common = response.request_body.response
        _set_length(common.header_mutation, body)
        common.body_mutation.body = body
    elif kind is not None:
        getattr(response, kind).SetInParent()
    return response


def shape_reply(request: pb.ProcessingRequest) -> pb.ProcessingResponse:
    """Continue on headers; on the body, the message our server sends for a successful vllm_nixl request."""
    if request.WhichOneof("request") != "request_body":
        return plain_reply(request)
    body = shaped_body(request.request_body.body)
    response = pb.ProcessingResponse()
    common = response.request_body.response
    _set_length(common.header_mutation, body)
    common.header_mutation.remove_headers.extend(SHAPE_REMOVE_HEADERS)
    common.body_mutation.body = body
    return response
