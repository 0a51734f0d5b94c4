from __future__ import annotations

import io
import logging
import threading
from collections.abc import Iterator

import orjson
import pytest

from extproc.observability import logs

FIELDS = {"request_id": "abc-1", "adapter": "vllm_nixl", "outcome": "ok", "status": 200, "prefill_status": 200,
          "prefill_ms": 1.25, "total_ms": 2.5, "body_bytes": 804}


@pytest.fixture
def stream() -> Iterator[io.StringIO]:
    root = logging.getLogger()
    saved = root.handlers[:], root.level
    sink = io.StringIO()
    logs.configure("info", sink)
    yield sink
    root.handlers[:] = saved[0]
    root.setLevel(saved[1])


def _lines(sink: io.StringIO) -> list[dict[str, object]]:
    logs.flush()
    return [orjson.loads(line) for line in sink.getvalue().splitlines()]


def test_the_request_line_is_the_formatter_line_without_its_cost(stream: io.StringIO) -> None:
    logger = logging.getLogger("extproc.request")
    logger.info("pd_request", extra=dict(FIELDS))
    logs.info(logger, "pd_request", FIELDS)
    through_logging, direct = _lines(stream)
    assert list(direct) == list(through_logging)  # same keys, same order
    assert {k: v for k, v in direct.items() if k != "ts"} == {k: v for k, v in through_logging.items() if k != "ts"}
    assert isinstance(direct["ts"], str) and direct["ts"].endswith("Z") and len(direct["ts"]) == len(
        str(through_logging["ts"]))


def test_a_level_above_info_writes_nothing(stream: io.StringIO) -> None:
    logging.getLogger().setLevel("WARNING")
    logs.info(logging.getLogger("extproc.request"), "pd_request", FIELDS)
    logs.flush()
    assert stream.getvalue() == ""


def test_any_other_set_up_gets_an_ordinary_record(stream: io.StringIO) -> None:
    records: list[logging.LogRecord] = []

    class Capture(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    capture = Capture()
    logging.getLogger().addHandler(capture)
    try:
        logs.info(logging.getLogger("extproc.request"), "pd_request", FIELDS)
    finally:
        logging.getLogger().removeHandler(capture)
    assert [(r.getMessage(), r.__dict__["outcome"]) for r in records] == [("pd_request", "ok")]
    assert len(_lines(stream)) == 1  # and the JSON handler still wrote its line


class _RecordingStream(io.StringIO):
    """Records the thread each write happens on."""

    def __init__(self) -> None:
        super().__init__()
        self.threads: list[int] = []

    def write(self, text: str) -> int:
        self.threads.append(threading.get_ident())
        return super().write(text)


def test_lines_are_written_by_the_writer_thread_not_the_caller() -> None:
    """A blocked stderr must not hold the event loop: the caller only queues its line."""
    root = logging.getLogger()
    saved = root.handlers[:], root.level
    sink = _RecordingStream()
    logs.configure("info", sink)
    try:
        logs.info(logging.getLogger("extproc.request"), "pd_request", FIELDS)
        logging.getLogger("extproc.server").warning("something", extra={"reason": "x"})
        lines = _lines(sink)
    finally:
        logs.stop()
        root.handlers[:] = saved[0]
        root.setLevel(saved[1])
    assert [line["msg"] for line in lines] == ["pd_request", "something"]
    assert sink.threads and threading.get_ident() not in sink.threads


def test_a_full_queue_drops_lines_and_reports_how_many() -> None:
    lines = logs.LineQueue(limit=2)
    for index in range(4):
        lines.put(f'{{"n":{index}}}')
    assert lines.dropped == 2
    assert lines.take() == ['{"n":0}', '{"n":1}']
    lines.put('{"n":4}')
    note, line = lines.take()
    assert (orjson.loads(note)["msg"], orjson.loads(note)["dropped"], line) == ("log lines dropped", 2, '{"n":4}')
    assert lines.queued == 4  # what flush() waits for: the lines kept and the note


def test_the_writer_is_woken_once_per_batch_not_per_line() -> None:
    lines = logs.LineQueue()
    lines.put("a")
    assert lines.arrived.is_set()
    lines.arrived.clear()
    lines.put("b")  # the writer has not taken "a" yet: already woken, not woken again
    assert not lines.arrived.is_set()
    assert lines.take() == ["a", "b"]
    lines.put("c")  # the first line after a take wakes it again
    assert lines.arrived.is_set()


def test_lines_queued_while_a_batch_waits_go_out_in_one_write() -> None:
    """Lines that arrive within the batch window share one write; flush cuts the window short."""
    sink = _RecordingStream()
    lines = logs.LineQueue()
    writer = logs.LineWriter(lines, sink, batch_seconds=3600)
    writer.start()
    try:
        for n in range(5):
            lines.put(f"line-{n}")
        writer.flush()
        assert sink.getvalue() == "".join(f"line-{n}\n" for n in range(5))
        assert len(sink.threads) == 1  # one write
    finally:
        writer.stop()
    assert not writer.is_alive()


class _GatedStream(io.StringIO):
    """Records each write; the first one waits for ``gate``."""

    def __init__(self) -> None:
        super().__init__()
        self.gate, self.writing, self.writes = threading.Event(), threading.Event(), list[str]()

    def write(self, text: str) -> int:
        self.writing.set()
        if not self.writes:
            assert self.gate.wait(10)
        self.writes.append(text)
        return super().write(text)


def test_lines_queued_during_a_write_go_out_together_and_none_is_left_held() -> None:
    root = logging.getLogger()
    saved = root.handlers[:], root.level
    sink = _GatedStream()
    logs.configure("info", sink)
    try:
        logger = logging.getLogger("extproc.request")
        logs.info(logger, "first", {})
        assert sink.writing.wait(10)  # the writer is inside the first write
        for n in range(4):
            logs.info(logger, f"queued-{n}", {})
        sink.gate.set()
        logs.flush()
        assert [[orjson.loads(line)["msg"] for line in text.splitlines()] for text in sink.writes] == [
            ["first"], ["queued-0", "queued-1", "queued-2", "queued-3"]]
        logs.info(logger, "last", {})
        logs.stop()  # written before the thread ends, though the stop sentinel queued behind it
        assert orjson.loads(sink.getvalue().splitlines()[-1])["msg"] == "last"
    finally:
        logs.stop()
        root.handlers[:] = saved[0]
        root.setLevel(saved[1])
