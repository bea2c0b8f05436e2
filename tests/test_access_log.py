"""The access log: one line per request, never the query string, through the standard logging
machinery (levels, filters and handlers configured by the operator still apply)."""

from __future__ import annotations

import contextlib
import io
import logging
import re
from collections.abc import Iterator
from typing import Any

import pytest
from starlette.types import Receive, Scope, Send

from app.logsetup import LineFormatter, TurnFlushedHandler
from app.middleware import AccessLog, access_logger

LINE = re.compile(r"^GET /items/7 204 \d+\.\dms rid=[0-9a-f]{16}$")
TIMESTAMP = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}$")


class Collect(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@pytest.fixture
def collected() -> Iterator[Collect]:
    handler = Collect()
    level = access_logger.level
    access_logger.addHandler(handler)
    access_logger.setLevel(logging.INFO)
    try:
        yield handler
    finally:
        access_logger.removeHandler(handler)
        access_logger.setLevel(level)


async def no_content(scope: Scope, receive: Receive, send: Send) -> None:
    await send({"type": "http.response.start", "status": 204, "headers": []})
    await send({"type": "http.response.body", "body": b""})


async def request(query: bytes = b"code=SECRETCODE&state=s") -> None:
    scope = {"type": "http", "method": "GET", "path": "/items/7", "query_string": query}

    async def receive() -> dict[str, object]:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(_message: object) -> None:
        return None

    await AccessLog(no_content)(scope, receive, send)


async def test_one_line_per_request_with_status_and_without_the_query(collected: Collect) -> None:
    await request()

    (record,) = collected.records
    assert LINE.match(record.getMessage()), record.getMessage()
    assert "SECRETCODE" not in record.getMessage()
    assert (record.name, record.levelname, record.levelno) == ("broker.access", "INFO", 20)


async def test_a_level_above_info_silences_it(collected: Collect) -> None:
    access_logger.setLevel(logging.WARNING)

    await request()

    assert collected.records == []


async def test_logger_filters_still_apply(collected: Collect) -> None:
    def drop_all(_record: logging.LogRecord) -> bool:
        return False

    access_logger.addFilter(drop_all)
    try:
        await request()
    finally:
        access_logger.removeFilter(drop_all)

    assert collected.records == []


@contextlib.contextmanager
def served_logging() -> Iterator[io.StringIO]:
    """Logging as `serve` configures it (configure_logging: one TurnFlushedHandler with a
    LineFormatter), on the access logger itself, into a string; restored afterwards. Entered in
    the test's body: pytest adds handlers of its own to the root and to non-propagating loggers
    when a test starts."""
    saved = (access_logger.handlers[:], access_logger.level, access_logger.propagate)
    stream = io.StringIO()
    handler = TurnFlushedHandler(stream)
    handler.setFormatter(LineFormatter())
    access_logger.handlers = [handler]
    access_logger.setLevel(logging.INFO)
    access_logger.propagate = False
    try:
        yield stream
    finally:
        access_logger.handlers, level, access_logger.propagate = saved
        access_logger.setLevel(level)


async def test_as_served_the_line_is_written_without_a_record() -> None:
    """With `serve`'s logging, the line skips the record (logsetup.write_plain) and reads as
    the record's line would; a filter added on the handler sends it the standard way again."""
    with served_logging() as stream:
        made: list[logging.LogRecord] = []
        factory = logging.getLogRecordFactory()

        def counting_factory(*args: Any, **kwargs: Any) -> logging.LogRecord:
            record = factory(*args, **kwargs)
            made.append(record)
            return record

        logging.setLogRecordFactory(counting_factory)
        try:
            await request()
            assert made == []
            (line,) = stream.getvalue().splitlines()
            date, clock, level, name, message = line.split(" ", 4)
            assert TIMESTAMP.match(f"{date} {clock}"), line
            assert (level, name) == ("INFO", "broker.access")
            assert LINE.match(message), line
            assert "SECRETCODE" not in line

            seen: list[str] = []

            def note(record: logging.LogRecord) -> bool:
                seen.append(record.getMessage())
                return False

            (handler,) = access_logger.handlers
            handler.addFilter(note)
            await request()
            assert len(made) == 1 and len(seen) == 1 and LINE.match(seen[0])
            assert len(stream.getvalue().splitlines()) == 1  # the filter dropped the second
        finally:
            logging.setLogRecordFactory(factory)
