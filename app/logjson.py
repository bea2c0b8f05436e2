"""`[logging] format = "json"`: each log line one JSON object, with stable field names.

    time        UTC, ISO 8601 with milliseconds: "2026-12-06T05:13:39.123Z"
    level       "INFO", "WARNING", "ERROR", …
    logger      "broker.access", "broker.security", "uvicorn.error", …
    message     the line the plain format shows after the logger name
    event       the message's leading event name ("auth.invalid_token"), when it has one
    request_id  the request being served (the access line's `rid`), when there is one
    method, path, status, duration_ms
                access lines only (`broker.access`): path without the query string
    exception, stack
                a traceback, when the record carries one (as the plain format prints it)

Non-ASCII and control characters are escaped, so a value from outside cannot break a line.
"""

from __future__ import annotations

import json
import logging
import re
import time
from typing import Any

from app import request_id

EVENT = re.compile(r"[a-z][a-z0-9_]*(?:\.[a-z0-9_]+)+")
ACCESS_FIELDS = ("method", "path", "status", "duration_ms", "request_id")


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        message = record.getMessage()
        document: dict[str, Any] = {
            "time": _utc(record.created),
            "level": record.levelname,
            "logger": record.name,
            "message": message,
        }
        first = message.split(" ", 1)[0]
        if EVENT.fullmatch(first):
            document["event"] = first
        current = request_id.current.get()
        if current is not None:
            document["request_id"] = current
        access = getattr(record, "access", None)
        if isinstance(access, dict):
            document.update((key, access[key]) for key in ACCESS_FIELDS if key in access)
        if record.exc_info:
            document["exception"] = self.formatException(record.exc_info)
        elif record.exc_text:
            document["exception"] = record.exc_text
        if record.stack_info:
            document["stack"] = self.formatStack(record.stack_info)
        return json.dumps(document, ensure_ascii=True, separators=(",", ":"), default=str)


def _utc(created: float) -> str:
    milliseconds = int((created - int(created)) * 1000)
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(created)) + f".{milliseconds:03d}Z"
