"""The ext_proc servicer in-process: our gRPC server (extproc/envoy/h2server.py) driven by a gRPC client that speaks
ext_proc, with an emulated prefill worker in the same event loop. No Envoy: these tests pin the
message-level contract and the paths Envoy's routes never exercise."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from collections.abc import Awaitable, Callable
from typing import Any

import grpc
import pytest
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from extproc.app import EXT_PROC_SERVICE, ExtProcServer
from extproc.config import load_settings
from pd_extproc_lab.emulator.vllm import VllmBehaviour, VllmEmulator
from tests.ext_proc_messages import body_message, error_of, exchange, headers_message

CHAT = "/v1/chat/completions"


@dataclasses.dataclass
class Harness:
    server: ExtProcServer
    prefill: VllmEmulator
    prefill_address: str
    channel: grpc.aio.Channel

    def stub(self) -> Any:
        return pb_grpc.ExternalProcessorStub(self.channel)

    async def exchange(self, *messages: pb.ProcessingRequest) -> list[pb.ProcessingResponse]:
        return await exchange(self.channel, *messages)


async def with_harness(test: Callable[[Harness], Awaitable[None]], **env: str) -> None:
    prefill = VllmEmulator("prefill", "m", "prefill", "127.0.0.1", 16, 30.0)
    port = await prefill.start("127.0.0.1", 0, 0)
    settings = load_settings({"PD_EXTPROC_GRPC_LISTEN": "127.0.0.1:0", "PD_EXTPROC_METRICS_LISTEN": "127.0.0.1:0",
                              "PD_EXTPROC_PREFILL_ALLOW": "127.0.0.0/8:*", **env}, {})
    server = ExtProcServer(settings)
    await server.start()
    channel = grpc.aio.insecure_channel(server.address)
    try:
        await test(Harness(server, prefill, f"127.0.0.1:{port}", channel))
    finally:
        await channel.close()
        await server.grpc.stop(0)
        await server.prefill_client.aclose()
        await server.decode_control.aclose()
        await server.http.close()
        server.processor.inspector.close()
        await prefill.close()


def run(test: Callable[[Harness], Awaitable[None]], **env: str) -> None:
    asyncio.run(with_harness(test, **env))


def test_pd_exchange_replies_continue_then_a_body_mutation_with_its_length() -> None:
    async def test(h: Harness) -> None:
        responses = await h.exchange(headers_message(CHAT, {"x-prefiller-host-port": h.prefill_address}),
                                     body_message({"messages": [{"role": "user", "content": "x"}]}))
        assert [r.WhichOneof("response") for r in responses] == ["request_headers", "request_body"]
        common = responses[1].request_body.response
        length = next(m.header.raw_value for m in common.header_mutation.set_headers
                      if m.header.key == "content-length")
        assert int(length) == len(common.body_mutation.body)
        assert json.loads(common.body_mutation.body)["kv_transfer_params"]["do_remote_prefill"] is True

    run(test)


def test_unsupported_endpoint_is_refused() -> None:
    """A P/D request on a path we do not support (only reachable with a hand-edited Envoy config)."""
    async def test(h: Harness) -> None:
        responses = await h.exchange(headers_message("/v1/embeddings", {"x-prefiller-host-port": h.prefill_address}),
                                     body_message({"input": "x"}))
        assert error_of(responses[-1]) == (404, "unsupported_endpoint")
        assert h.prefill.control.records == []

    run(test)


def test_headers_with_end_of_stream_are_refused_as_an_empty_body() -> None:
    async def test(h: Harness) -> None:
        responses = await h.exchange(headers_message(CHAT, {"x-prefiller-host-port": h.prefill_address}, True))
        assert error_of(responses[0]) == (400, "invalid_request_body")

    run(test)


def test_drain_refuses_new_pd_requests() -> None:
    """Once draining starts, a new stream is refused with 503 pd_shutting_down; health says NOT_SERVING."""
    async def test(h: Harness) -> None:
        health = health_pb2_grpc.HealthStub(h.channel)
        serving = await health.Check(health_pb2.HealthCheckRequest(service=EXT_PROC_SERVICE))
        assert serving.status == health_pb2.HealthCheckResponse.SERVING
        h.server.admission.draining = True
        h.server.health.set(EXT_PROC_SERVICE, health_pb2.HealthCheckResponse.NOT_SERVING)
        responses = await h.exchange(headers_message(CHAT, {"x-prefiller-host-port": h.prefill_address}))
        assert error_of(responses[0]) == (503, "pd_shutting_down")
        draining = await health.Check(health_pb2.HealthCheckRequest(service=EXT_PROC_SERVICE))
        assert draining.status == health_pb2.HealthCheckResponse.NOT_SERVING

    run(test)


def test_internal_error_is_json() -> None:
    """A bug in an adapter becomes a JSON 500 internal_error, with no traceback or detail in the body."""
    class Broken:
        name = "broken"

        def __getattr__(self, _name: str) -> Any:
            raise RuntimeError("secret detail")

    async def test(h: Harness) -> None:
        h.server.processor._adapter = Broken()  # type: ignore[assignment]
        responses = await h.exchange(headers_message(CHAT, {"x-prefiller-host-port": h.prefill_address}),
                                     body_message({"messages": [{"role": "user", "content": "x"}]}))
        assert error_of(responses[-1]) == (500, "internal_error")
        assert b"secret detail" not in responses[-1].immediate_response.body

    run(test)


def test_cancelled_stream_cancels_the_prefill_call_and_releases_its_slot() -> None:
    """Envoy resetting the stream mid-prefill cancels the prefill HTTP request (the worker sees the
    connection close), counts the request as cancelled, and frees the in-flight slot."""
    async def test(h: Harness) -> None:
        released = asyncio.Event()
        leave = h.server.admission.leave

        def leave_and_signal() -> None:
            leave()
            released.set()

        h.server.admission.leave = leave_and_signal  # type: ignore[method-assign]
        h.prefill.control.script.append(VllmBehaviour(hang=True))
        call = h.stub().Process()
        await call.write(headers_message(CHAT, {"x-prefiller-host-port": h.prefill_address}))
        assert (await call.read()).WhichOneof("response") == "request_headers"
        await call.write(body_message({"messages": [{"role": "user", "content": "x"}]}))
        assert await h.prefill.control.wait_for(lambda: len(h.prefill.control.records) == 1, 10)
        assert h.server.admission.inflight == 1
        call.cancel()
        assert await h.prefill.control.wait_for(
            lambda: h.prefill.control.records[0].outcome == "disconnected", 10)
        await asyncio.wait_for(released.wait(), 10)
        assert h.server.admission.inflight == 0
        exposition = h.server.metrics.exposition().decode()
        assert 'pd_extproc_requests_total{adapter="vllm_nixl",outcome="cancelled"} 1.0' in exposition
        assert "pd_extproc_inflight_requests 0.0" in exposition

    run(test)


def test_a_message_before_the_headers_is_refused() -> None:
    async def test(h: Harness) -> None:
        trailers = pb.ProcessingRequest()
        trailers.request_trailers.SetInParent()
        responses = await h.exchange(trailers)
        assert error_of(responses[0]) == (500, "internal_error") and len(responses) == 1

    run(test)


def test_settings_reach_the_server() -> None:
    async def test(h: Harness) -> None:
        assert h.server.admission.limit == 7
        assert dataclasses.asdict(h.server.policy)["allow_loopback"] is False

    run(test, PD_EXTPROC_MAX_INFLIGHT="7")


@pytest.mark.parametrize("status,expected", [(302, 502), (418, 400), (599, 502), (503, 503)])
def test_prefill_status_keeps_its_class_in_the_immediate_response(status: int, expected: int) -> None:
    async def test(h: Harness) -> None:
        h.prefill.control.script.append(VllmBehaviour(status=status))
        responses = await h.exchange(headers_message(CHAT, {"x-prefiller-host-port": h.prefill_address}),
                                     body_message({"messages": [{"role": "user", "content": "x"}]}))
        assert error_of(responses[-1]) == (expected, "prefill_upstream_error")

    run(test)


def test_a_message_that_is_not_a_processing_request_ends_the_stream_with_internal() -> None:
    async def test(h: Harness) -> None:
        method = h.channel.stream_stream(f"/{EXT_PROC_SERVICE}/Process", request_serializer=lambda raw: raw,
                                         response_deserializer=pb.ProcessingResponse.FromString)
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            [response async for response in method(iter([b"\xff\xff\xff"]))]
        assert refused.value.code() == grpc.StatusCode.INTERNAL
        assert refused.value.details() == "a message that is not a ProcessingRequest"
        assert h.server.admission.inflight == 0

    run(test)
