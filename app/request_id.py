"""The id of the request being served (app/middleware.py sets it), for what records it beside the
access line: audit rows, JSON log lines. None outside a request (housekeeping, the CLI)."""

from __future__ import annotations

from contextvars import ContextVar

current: ContextVar[str | None] = ContextVar("request_id", default=None)
