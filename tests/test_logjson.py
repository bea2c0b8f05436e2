"""`[logging] format = "json"` (app/logjson.py): every line, access lines included, is one JSON
object with the documented field names; a value from outside cannot break a line."""

from __future__ import annotations

import contextlib
import io
import json
import logging
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from starlette.types import Receive, Scope, Send

from app.config import ConfigError, load_settings
from app.logjson import JsonFormatter
from app.logsetup import TurnFlushedHandler
from app.middleware import AccessLog, access_logger

from .support.broker import BrokerConfig, running_broker
from .support.http import local_client
from .support.idp import IdpProcess

TIME = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z$")
RID = re.compile(r"^[0-9a-f]{16}$")
BASE_FIELDS = {"time", "level", "logger", "message"}
ACCESS_FIELDS = BASE_FIELDS | {"method", "path", "status", "duration_ms", "request_id"}


@contextlib.contextmanager
def json_logging(*loggers: logging.Logger) -> Iterator[io.StringIO]:
    """`loggers` written as `serve` writes them with format = "json", into a string; restored
    afterwards (entered in the test's body: pytest adds handlers of its own when a test
    starts)."""
    stream = io.StringIO()
    handler = TurnFlushedHandler(stream)
    handler.setFormatter(JsonFormatter())
    saved = [(lg, lg.handlers[:], lg.level, lg.propagate) for lg in loggers]
    for logger in loggers:
        logger.handlers = [handler]
        logger.setLevel(logging.INFO)
        logger.propagate = False
    try:
        yield stream
    finally:
        for logger, handlers, level, propagate in saved:
            logger.handlers, logger.propagate = handlers, propagate
            logger.setLevel(level)


def documents(stream: io.StringIO) -> list[dict[str, Any]]:
    lines = stream.getvalue().splitlines()
    parsed = [json.loads(line) for line in lines]
    assert all(isinstance(document, dict) for document in parsed)
    return parsed


def test_a_plain_record_is_one_object_with_time_level_logger_message_and_event() -> None:
    logger = logging.getLogger("test.logjson.plain")
    with json_logging(logger) as stream:
        logger.warning("auth.invalid_token reason=%s", "expired")
        logger.info("no event here")

    event, plain = documents(stream)
    assert set(event) == BASE_FIELDS | {"event"}
    assert TIME.match(event["time"]), event
    assert (event["level"], event["logger"]) == ("WARNING", "test.logjson.plain")
    assert event["message"] == "auth.invalid_token reason=expired"
    assert event["event"] == "auth.invalid_token"
    assert set(plain) == BASE_FIELDS
    assert plain["level"] == "INFO"


def test_a_value_from_outside_cannot_break_or_forge_a_line() -> None:
    logger = logging.getLogger("test.logjson.hostile")
    hostile = 'x"}\n{"level":"ERROR","message":"forged"}\r\u2028\x00é'
    with json_logging(logger) as stream:
        logger.info("host.refused host=%s", hostile)

    raw = stream.getvalue()
    assert raw.count("\n") == 1 and raw.isascii()
    (document,) = documents(stream)
    assert document["message"] == f"host.refused host={hostile}"
    assert document["level"] == "INFO"


def test_a_traceback_is_a_field_of_the_same_line() -> None:
    logger = logging.getLogger("test.logjson.exception")
    with json_logging(logger) as stream:
        try:
            raise ValueError("boom")
        except ValueError:
            logger.exception("request.failed rid=abc")

    (document,) = documents(stream)
    assert document["event"] == "request.failed"
    assert "Traceback" in document["exception"]
    assert "ValueError" in document["exception"]


async def inner_app(scope: Scope, receive: Receive, send: Send) -> None:
    logging.getLogger("broker.flows").info("flow.noted inside=%s", "request")
    await send({"type": "http.response.start", "status": 204, "headers": []})
    await send({"type": "http.response.body", "body": b""})


async def test_the_access_line_has_its_own_fields_and_the_request_s_lines_its_id() -> None:
    flows = logging.getLogger("broker.flows")
    scope = {
        "type": "http",
        "method": "GET",
        "path": "/oauth/github/callback",
        "query_string": b"code=SECRETCODE&state=SECRETSTATE",
    }

    async def receive() -> dict[str, object]:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(_message: object) -> None:
        return None

    with json_logging(access_logger, flows) as stream:
        await AccessLog(inner_app)(scope, receive, send)
        inner, access = documents(stream)

    assert set(access) == ACCESS_FIELDS
    assert (access["logger"], access["method"], access["path"], access["status"]) == (
        "broker.access",
        "GET",
        "/oauth/github/callback",
        204,
    )
    assert isinstance(access["duration_ms"], float)
    assert RID.match(access["request_id"])
    assert inner["request_id"] == access["request_id"]
    assert inner["event"] == "flow.noted"
    assert "SECRET" not in stream.getvalue()


def test_the_format_is_plain_unless_configured_and_only_plain_or_json() -> None:
    assert load_settings(environ={}).logging.format == "plain"
    assert load_settings(environ={"BROKER_LOGGING_FORMAT": "json"}).logging.format == "json"
    with pytest.raises(ConfigError, match=r"logging\.format"):
        load_settings(environ={"BROKER_LOGGING_FORMAT": "xml"})


async def test_serve_with_json_writes_every_line_as_json(idp: IdpProcess, tmp_path: Path) -> None:
    """The real `serve`: start-up lines, uvicorn's own and the access lines all parse."""
    config = BrokerConfig(issuer=idp.issuer, extra={"logging": {"format": "json"}})
    with running_broker(config, tmp_path, name="json-logs") as broker:
        async with local_client(timeout=10) as http:
            assert (await http.get(f"{broker.url}/healthz?code=SECRETCODE")).status_code == 200
            await http.get(f"{broker.url}/no/such/page")
        await broker.wait_for_log('"path":"/no/such/page"')
        log = broker.log()

    lines = [line for line in log.splitlines() if line.strip()]
    parsed = [json.loads(line) for line in lines]
    access = [doc for doc in parsed if doc["logger"] == "broker.access"]
    assert [(doc["path"], doc["status"]) for doc in access][-2:] == [
        ("/healthz", 200),
        ("/no/such/page", 404),
    ]
    assert all(set(doc) >= BASE_FIELDS for doc in parsed)
    assert any(doc["logger"].startswith("uvicorn") for doc in parsed)
    assert "SECRETCODE" not in log
