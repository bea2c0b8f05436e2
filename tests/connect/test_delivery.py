"""Marking a delivered flow consumed is bookkeeping: a write the database cannot take now leaves
the flow completed (which answers the same) and never fails the client's request."""

from __future__ import annotations

import contextlib
import logging
import sqlite3
from collections.abc import AsyncIterator
from datetime import timedelta
from typing import cast

import pytest
from sqlalchemy.exc import OperationalError
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from app.auth.principal import Principal
from app.clock import utcnow
from app.config import Settings
from app.connect.context import RoundContext
from app.connect.notify import FlowNotifier
from app.connect.refresh import UsableCredentials
from app.connect.rounds import mark_delivered
from app.connect.service import FlowRead, FlowView
from app.direct import DirectStore
from app.models import FlowStatus


class RefusingSessions:
    """A sessionmaker whose every write is refused as SQLite refuses one past its lock wait."""

    def __init__(self) -> None:
        self.attempts = 0

    @contextlib.asynccontextmanager
    async def begin(self) -> AsyncIterator[AsyncSession]:
        self.attempts += 1
        raise OperationalError("UPDATE flows", {}, sqlite3.OperationalError("database is locked"))
        yield cast(AsyncSession, None)  # pragma: no cover - never reached


def read_of(status: str) -> FlowRead:
    flow = FlowView(
        id="f" * 43,
        principal=Principal("https://idp.example", "alice"),
        client_id="client",
        client_name=None,
        audience="mcp",
        provider="demo",
        scopes=(),
        status=status,
        account_label=None,
        failure=None,
        expires_at=utcnow() + timedelta(minutes=5),
    )
    return FlowRead(flow, None)


def context_with(sessions: RefusingSessions) -> RoundContext:
    """Only the sessionmaker is used by `mark_delivered`; the other parts are never touched."""
    return RoundContext(
        settings=cast(Settings, None),
        store=cast(DirectStore, None),
        sessionmaker=cast(async_sessionmaker[AsyncSession], sessions),
        notifier=cast(FlowNotifier, None),
        credentials=cast(UsableCredentials, None),
    )


async def test_a_refused_consume_write_is_logged_and_does_not_fail_the_answer(
    caplog: pytest.LogCaptureFixture,
) -> None:
    sessions = RefusingSessions()
    with caplog.at_level(logging.WARNING, logger="broker"):
        await mark_delivered(context_with(sessions), read_of(FlowStatus.completed))
    assert sessions.attempts == 1
    assert "flow.consume_deferred error=OperationalError" in caplog.text


async def test_a_flow_consumed_already_is_not_written_again() -> None:
    sessions = RefusingSessions()
    await mark_delivered(context_with(sessions), read_of(FlowStatus.consumed))
    assert sessions.attempts == 0
