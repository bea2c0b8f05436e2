"""The access log: one line per request, never the query string, through the standard logging
machinery (levels, filters and handlers configured by the operator still apply)."""

from __future__ import annotations

import logging
import re
from collections.abc import Iterator

import pytest
from starlette.types import Receive, Scope, Send

from app.middleware import AccessLog, access_logger

LINE = re.compile(r"^GET /items/7 204 \d+\.\dms rid=[0-9a-f]{16}$")


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
