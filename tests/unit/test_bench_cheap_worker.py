"""The benchmark's cheap worker: what it counts, however the request's bytes arrive, and its member scan."""

from __future__ import annotations

import re

import orjson
import pytest

from bench import cheap_worker
from bench.cheap_worker import QUOTE_WALK_FROM, Connection, Worker, marks
from bench.workload import sized_body

ENGINE_ID = "prefill-engine-7"


class Transport:
    def __init__(self) -> None:
        self.written: list[bytes] = []

    def write(self, data: bytes) -> None:
        self.written.append(data)


def _request(body: bytes, path: str = "/v1/chat/completions", chunked: bool = False) -> bytes:
    if chunked:
        framed = b"".join(b"%x\r\n%s\r\n" % (len(body[i:i + 1000]), body[i:i + 1000])
                          for i in range(0, len(body), 1000)) + b"0\r\n\r\n"
        return b"POST %s HTTP/1.1\r\nhost: w\r\ntransfer-encoding: chunked\r\n\r\n%s" % (path.encode(), framed)
    return b"POST %s HTTP/1.1\r\nhost: w\r\ncontent-length: %d\r\n\r\n%s" % (path.encode(), len(body), body)


def _feed(worker: Worker, stream: bytes, read_bytes: int) -> list[bytes]:
    """Every HTTP response the connection wrote, the stream given to it ``read_bytes`` at a time."""
    connection = Connection(worker)
    transport = Transport()
    connection.connection_made(transport)  # type: ignore[arg-type]
    for at in range(0, len(stream), read_bytes):
        connection.data_received(stream[at:at + read_bytes])
    return re.findall(rb"HTTP/1\.1 \d+ [^\r]*\r\n(?:[^\r]+\r\n)*\r\n", b"".join(transport.written))


def _consumer_body(size: int, engine_id: str = ENGINE_ID, request_id: str = "r-1") -> bytes:
    body = orjson.loads(sized_body("chat", size))
    body["kv_transfer_params"] = {"do_remote_prefill": True, "do_remote_decode": False,
                                  "remote_engine_id": engine_id, "remote_request_id": request_id}
    return orjson.dumps(body)


@pytest.mark.parametrize("read_bytes", [7, 65536, 1 << 22])
@pytest.mark.parametrize("chunked", [False, True])
def test_decode_counts_each_pipelined_request_however_the_bytes_arrive(read_bytes: int, chunked: bool) -> None:
    worker = Worker("vllm", "decode", ENGINE_ID, 8998)
    large = _consumer_body(1 << 20, request_id="r-large")
    small = _consumer_body(1 << 10, request_id="r-small")
    plain = sized_body("completions", 300 << 10)
    stream = b"".join([_request(large, chunked=chunked), _request(small, chunked=chunked),
                       _request(plain, "/v1/completions", chunked=chunked), _request(_consumer_body(2048, "other"))])
    responses = _feed(worker, stream, read_bytes)
    assert len(responses) == 4 and all(r.startswith(b"HTTP/1.1 200") for r in responses)
    assert worker.counters["requests"] == 4
    assert worker.handoff_ids == {b"r-large", b"r-small"}
    assert worker.counters["consumer"] == 2
    assert worker.counters["plain"] == 2  # the plain body and the handoff naming another engine


@pytest.mark.parametrize("chunked", [False, True])
def test_a_byte_at_a_time(chunked: bool) -> None:
    worker = Worker("vllm", "decode", ENGINE_ID, 8998)
    stream = _request(_consumer_body(3000, request_id="a"), chunked=chunked) + _request(b"", chunked=chunked)
    assert len(_feed(worker, stream, 1)) == 2
    assert worker.handoff_ids == {b"a"} and worker.counters["plain"] == 1


def test_prefill_answers_a_producer_request_with_a_fresh_handoff() -> None:
    worker = Worker("vllm", "prefill", ENGINE_ID, 8998)
    body = orjson.loads(sized_body("chat", 1 << 20))
    body["kv_transfer_params"] = {"do_remote_decode": True, "do_remote_prefill": False}
    connection = Connection(worker)
    transport = Transport()
    connection.connection_made(transport)  # type: ignore[arg-type]
    connection.data_received(_request(orjson.dumps(body)) + _request(orjson.dumps(body)))
    answers = [orjson.loads(part.rpartition(b"\r\n\r\n")[2]) for part in transport.written[0].split(b"HTTP/1.1 ")[1:]]
    assert [a["kv_transfer_params"]["remote_request_id"] for a in answers] == ["cheap-1", "cheap-2"]
    assert {a["kv_transfer_params"]["remote_engine_id"] for a in answers} == {ENGINE_ID}
    assert worker.counters["producer"] == 2


def test_sglang_counts_bootstrap_members_by_presence() -> None:
    decode = Worker("sglang", "decode", ENGINE_ID, 8998)
    prompt = sized_body("completions", 64 << 10)[:-1]  # open object: members appended after the long prompt
    for extra in (b',"bootstrap_room":0,"bootstrap_host":"h"}', b',"bootstrap_room":0}', b"}"):
        decode.post(b"/generate", prompt + extra)
    assert decode.counters == {"requests": 3, "producer": 0, "consumer": 1, "plain": 2}


SCAN_CASES = [
    b'{"stream":true}',
    b'{"stream" : false, "x": "\\"stream\\": true"}',
    b'{"a":"' + b'"' * 0 + b'q' * 40000 + b'","stream":\ttrue,"bootstrap_host":"h"}',
    b'{"a":"' + b'\\"' * 30000 + b'","do_remote_prefill": true,"do_remote_decode":true,"bootstrap_room":null}',
    b'{"do_remote_prefill":false,"p":"' + b"x" * 20000 + b'","do_remote_prefill":true}',
    b'"stream":"stream":true' * 2000,
]


@pytest.mark.parametrize("body", SCAN_CASES)
def test_the_quote_walk_finds_what_one_regex_pass_finds(body: bytes) -> None:
    by_regex: dict[bytes, int] = {}
    for match in cheap_worker._MARK.finditer(body):
        cheap_worker._note(by_regex, match)
    assert marks(body) == by_regex
    assert len(body) < QUOTE_WALK_FROM or marks(body) == by_regex  # large ones took the walk


def test_escaped_members_inside_a_string_do_not_count() -> None:
    body = b'{"prompt":"' + b"y" * QUOTE_WALK_FROM + b' \\"stream\\": true \\"do_remote_decode\\":true"}'
    assert marks(body) == {}
