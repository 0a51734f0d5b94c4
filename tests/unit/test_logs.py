from __future__ import annotations

import io
import logging
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
    logs.configure("info")
    sink = io.StringIO()
    handler = root.handlers[0]
    assert isinstance(handler, logging.StreamHandler)
    handler.setStream(sink)
    yield sink
    root.handlers[:] = saved[0]
    root.setLevel(saved[1])


def _lines(sink: io.StringIO) -> list[dict[str, object]]:
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
