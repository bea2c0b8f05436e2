"""How long the broker's engines wait for the database (app/db.py), on SQLite and PostgreSQL.

An engine made for requests gives up on a statement after STATEMENT_WAIT_SECONDS (PostgreSQL: a
slow statement; SQLite: a write lock held elsewhere); the migrations' engine waits it out. The
bound is lowered for these tests so that they run in about a second.
"""

from __future__ import annotations

import asyncio
import sqlite3
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import text
from sqlalchemy.exc import DBAPIError, OperationalError

from app import db
from app.migrate import upgrade

from .support.broker import database_kind, drop_database, fresh_database

pytestmark = pytest.mark.both_databases

BOUND_SECONDS = 0.5
BLOCKED_SECONDS = 1.5  # how long the statement or the lock holds: three times the bound


@pytest.fixture
def database_url(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    monkeypatch.setattr(db, "STATEMENT_WAIT_SECONDS", BOUND_SECONDS)
    url = fresh_database(tmp_path, "bounds")
    upgrade(url)
    try:
        yield url
    finally:
        drop_database(url)


async def _blocked_statement(url: str, *, bounded: bool) -> tuple[bool, float]:
    """Run one statement that finds the database blocked for BLOCKED_SECONDS: (done, seconds)."""
    engine = db.create_engine(url, pool_size=1, bounded=bounded)
    started = time.monotonic()
    try:
        async with engine.begin() as connection:
            if database_kind() == "sqlite":  # a write while another connection holds the lock
                await connection.execute(text("DELETE FROM flows WHERE id = 'none'"))
            else:
                await connection.execute(text(f"SELECT pg_sleep({BLOCKED_SECONDS})"))
        return True, time.monotonic() - started
    except (OperationalError, DBAPIError, TimeoutError):
        return False, time.monotonic() - started
    finally:
        await engine.dispose()


def _hold_sqlite_lock(url: str) -> threading.Thread:
    """Take SQLite's write lock now, release it BLOCKED_SECONDS later."""
    holder = sqlite3.connect(url.removeprefix("sqlite:///"), check_same_thread=False)
    holder.execute("BEGIN EXCLUSIVE")

    def release() -> None:
        time.sleep(BLOCKED_SECONDS)
        holder.execute("ROLLBACK")
        holder.close()

    thread = threading.Thread(target=release)
    thread.start()
    return thread


@pytest.mark.parametrize("bounded", [True, False], ids=["requests", "migrations"])
def test_a_request_engine_gives_up_at_its_bound_and_the_migration_engine_waits(
    database_url: str, bounded: bool
) -> None:
    holder = _hold_sqlite_lock(database_url) if database_kind() == "sqlite" else None
    try:
        done, seconds = asyncio.run(_blocked_statement(database_url, bounded=bounded))
    finally:
        if holder is not None:
            holder.join()
    if bounded:
        assert not done
        assert BOUND_SECONDS * 0.9 < seconds < BLOCKED_SECONDS, seconds
    else:
        assert done
        assert seconds >= BLOCKED_SECONDS * 0.9, seconds
