"""The stream's phases in order (headers, one whole body, decode's answer, done): a message Envoy sends
only under another processing mode (body chunks, a second body, a second headers message, response
headers before the body) is refused with a JSON 500 and a log line; the request is admitted and
prefilled at most once and counted once. Found in review: a STREAMED body ran a prefill, an admission
and a count per chunk."""

from __future__ import annotations

import logging
import re
from typing import Any

import pytest
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from tests.servicer.test_servicer import CHAT, Harness, body_message, error_of, headers_message, run

BODY = {"messages": [{"role": "user", "content": "x"}]}


def chunk(raw: bytes, end_of_stream: bool) -> pb.ProcessingRequest:
    request = pb.ProcessingRequest()
    request.request_body.body = raw
    request.request_body.end_of_stream = end_of_stream
    return request


def response_headers() -> pb.ProcessingRequest:
    request = pb.ProcessingRequest()
    request.response_headers.headers.headers.add(key=":status", raw_value=b"200")
    return request


def outcomes(h: Harness) -> dict[str, float]:
    exposition = h.server.metrics.exposition().decode()
    return {outcome: float(value) for outcome, value in
            re.findall(r'pd_extproc_requests_total\{adapter="vllm_nixl",outcome="([a-z_]+)"\} ([0-9.]+)', exposition)}


def count_admissions(h: Harness) -> list[int]:
    entered: list[int] = []
    enter = h.server.admission.enter

    def counted() -> None:
        entered.append(1)
        enter()

    h.server.admission.enter = counted  # type: ignore[method-assign]
    return entered


def logged_out_of_order(caplog: pytest.LogCaptureFixture) -> list[Any]:
    return [r for r in caplog.records if r.getMessage().startswith("ext_proc message out of order")]


def test_a_streamed_body_is_refused_at_its_first_chunk(caplog: pytest.LogCaptureFixture) -> None:
    async def test(h: Harness) -> None:
        entered = count_admissions(h)
        raw = b'{"messages": [{"role": "user", "content": "x"}]}'
        with caplog.at_level(logging.ERROR, "extproc.server"):
            responses = await h.exchange(headers_message(CHAT, {"x-prefiller-host-port": h.prefill_address}),
                                         chunk(raw[:10], False), chunk(raw[10:], True))
        assert [r.WhichOneof("response") for r in responses] == ["request_headers", "immediate_response"]
        assert error_of(responses[1]) == (500, "internal_error")
        assert h.prefill.control.records == [] and entered == []
        assert outcomes(h) == {"internal_error": 1.0} and h.server.admission.inflight == 0
        (line,) = logged_out_of_order(caplog)
        assert line.phase == "body" and line.ext_proc_message == "request_body chunk"

    run(test)


def test_a_second_body_is_refused_after_one_prefill_and_one_count(caplog: pytest.LogCaptureFixture) -> None:
    async def test(h: Harness) -> None:
        entered = count_admissions(h)
        with caplog.at_level(logging.ERROR, "extproc.server"):
            responses = await h.exchange(headers_message(CHAT, {"x-prefiller-host-port": h.prefill_address}),
                                         body_message(BODY), body_message(BODY))
        assert [r.WhichOneof("response") for r in responses] == ["request_headers", "request_body",
                                                                  "immediate_response"]
        assert error_of(responses[2]) == (500, "internal_error")
        assert len(h.prefill.control.records) == 1 and entered == [1]
        assert outcomes(h) == {"ok": 1.0}
        (line,) = logged_out_of_order(caplog)
        assert line.phase == "decode_answer" and line.ext_proc_message == "request_body"

    run(test)


@pytest.mark.parametrize("second", ["request_headers", "response_headers", "request_trailers"])
def test_anything_but_the_body_after_the_headers_is_refused_and_counted_once(
        second: str, caplog: pytest.LogCaptureFixture) -> None:
    async def test(h: Harness) -> None:
        entered = count_admissions(h)
        head = headers_message(CHAT, {"x-prefiller-host-port": h.prefill_address})
        if second == "request_headers":
            other = head
        elif second == "response_headers":
            other = response_headers()
        else:
            other = pb.ProcessingRequest()
            other.request_trailers.SetInParent()
        with caplog.at_level(logging.ERROR, "extproc.server"):
            responses = await h.exchange(head, other, body_message(BODY))
        assert [r.WhichOneof("response") for r in responses] == ["request_headers", "immediate_response"]
        assert error_of(responses[1]) == (500, "internal_error")
        assert h.prefill.control.records == [] and entered == []
        assert outcomes(h) == {"internal_error": 1.0} and h.server.admission.inflight == 0
        (line,) = logged_out_of_order(caplog)
        assert line.phase == "body" and line.ext_proc_message == second

    run(test)


def test_response_headers_after_a_sequential_body_continue() -> None:
    """A mode that also sends response headers (a gateway's own setting) is still the expected order."""
    async def test(h: Harness) -> None:
        responses = await h.exchange(headers_message(CHAT, {"x-prefiller-host-port": h.prefill_address}),
                                     body_message(BODY), response_headers())
        assert [r.WhichOneof("response") for r in responses] == ["request_headers", "request_body",
                                                                  "response_headers"]
        assert outcomes(h) == {"ok": 1.0}

    run(test)
