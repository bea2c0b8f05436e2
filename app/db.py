"""Engine and session factories for SQLite (embedded default) and PostgreSQL.

Plain URLs (`sqlite:///path`, `postgresql://user@host/db`) get their async driver here. Waits are
bounded: a pool timeout, a connect timeout and a statement timeout, so an outage turns into a quick
503 instead of a hang. SQL parameters are never logged (`hide_parameters`).

Each connection's settings (SQLite's PRAGMAs, PostgreSQL's session settings) are set here for
the engine and the direct store alike. The bounds, shared with the direct stores (app/direct/):
while the database hangs or another connection holds SQLite's write lock, a request gets its
answer within 5 s (SECURITY.md R5).
Migrations run unbounded: building an index on a large table may take longer than a request.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from sqlalchemy import event
from sqlalchemy.dialects import registry
from sqlalchemy.dialects.postgresql.asyncpg import PGDialect_asyncpg
from sqlalchemy.engine import URL, make_url
from sqlalchemy.ext.asyncio import (
    AsyncEngine,
    AsyncSession,
    async_sessionmaker,
    create_async_engine,
)
from sqlalchemy.pool import ConnectionPoolEntry
from starlette.requests import Request

from app.sqlite_gate import gate_for, gate_transactions

POOL_TIMEOUT_SECONDS = 3
CONNECT_TIMEOUT_SECONDS = 3
STATEMENT_WAIT_SECONDS = 4  # the client stops waiting for a statement, or for SQLite's lock
# SQLite cuts its WAL file back to this size whenever it starts the file over
# (app/direct/sqlite.py makes sure it does under a flood too)
WAL_LIMIT_BYTES = 64 * 1024 * 1024
SERVER_STATEMENT_TIMEOUT_MS = 5000  # PostgreSQL's own bound, for what the client gave up on
MIGRATION_LOCK_WAIT_SECONDS = 60  # SQLite: a migration waits this long for a running broker
SQLITE_CACHE_KIB = -32000  # SQLite's page cache per connection: negative means KiB, not pages
APPLICATION_NAME = "connect-broker"  # what PostgreSQL's pg_stat_activity shows


def async_url(url: str) -> URL:
    """Pick the async driver for a plain database URL.

    Raises:
        ValueError: for a scheme other than SQLite or PostgreSQL.
    """
    parsed = make_url(url)
    backend = parsed.get_backend_name()
    if backend == "sqlite":
        return parsed.set(drivername="sqlite+aiosqlite")
    if backend in ("postgresql", "postgres"):
        return parsed.set(drivername=f"postgresql+{ASYNCPG_DIALECT}")
    raise ValueError(f"unsupported database {backend!r} (use sqlite:/// or postgresql://)")


class DroppingAsyncpgDialect(PGDialect_asyncpg):
    """asyncpg, whose hard close of a connection drops it at once.

    SQLAlchemy hard-closes a connection it invalidates (a statement timed out, the server went
    away) or finds stale at checkout; its asyncpg dialect first tries a polite close and waits up
    to 2 s for the server's answer. A server that hangs never answers: the request would wait
    those 2 s on top of its statement timeout, and miss its 5 s bound.
    """

    supports_statement_cache = True  # compiles as its parent does

    def do_terminate(self, dbapi_connection: Any) -> None:
        dbapi_connection.driver_connection.terminate()


ASYNCPG_DIALECT = "asyncpg_dropping"
registry.register(f"postgresql.{ASYNCPG_DIALECT}", __name__, DroppingAsyncpgDialect.__name__)


def is_sqlite(url: str) -> bool:
    return make_url(url).get_backend_name() == "sqlite"


def private_sqlite_file(file: str) -> None:
    """Create a missing database directory 0700 and database file 0600 (SQLite gives its -wal
    and -shm files the database file's mode): they hold the sealed credentials. Existing ones
    keep the mode their owner gave them."""
    path = Path(file)
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    with contextlib.suppress(FileExistsError):
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))


def create_engine(url: str, *, pool_size: int = 10, bounded: bool = True) -> AsyncEngine:
    """An engine whose statements wait at most STATEMENT_WAIT_SECONDS, unless not `bounded`."""
    target = async_url(url)
    if target.get_backend_name() == "sqlite":
        file = target.database if target.database != ":memory:" else None
        if file:
            private_sqlite_file(file)
        lock_wait = STATEMENT_WAIT_SECONDS if bounded else MIGRATION_LOCK_WAIT_SECONDS
        engine = create_async_engine(
            target,
            hide_parameters=True,
            pool_size=pool_size,
            max_overflow=pool_size,
            pool_timeout=POOL_TIMEOUT_SECONDS,
            connect_args={"timeout": lock_wait},  # sqlite3's `timeout` is its busy timeout
        )
        event.listen(engine.sync_engine, "connect", _sqlite_pragmas)
        if bounded and file:
            gate = gate_for(file, STATEMENT_WAIT_SECONDS)
            gate_transactions(engine, gate, busy_timeout=lock_wait)
        return engine
    statement_bounds = {"command_timeout": STATEMENT_WAIT_SECONDS} if bounded else {}
    return create_async_engine(
        target,
        hide_parameters=True,
        # no pre-ping (a round trip per checkout on the hot path): a connection found dead
        # fails that request with a 503 and SQLAlchemy invalidates the whole pool at once
        pool_recycle=1800,
        pool_size=pool_size,
        max_overflow=pool_size,
        pool_timeout=POOL_TIMEOUT_SECONDS,
        connect_args={
            "timeout": CONNECT_TIMEOUT_SECONDS,
            "server_settings": postgres_server_settings(bounded=bounded),
            **statement_bounds,
        },
    )


def set_sqlite_options(
    connection: Any, *, busy_timeout_ms: int | None = None, wal_limit_bytes: int = WAL_LIMIT_BYTES
) -> None:
    """Every SQLite connection's settings, the engine's and the direct store's (a sqlite3
    connection or cursor). `busy_timeout_ms`: how long a statement waits for another writer's
    lock (None: as the connection was opened)."""
    if busy_timeout_ms is not None:
        connection.execute(f"PRAGMA busy_timeout = {int(busy_timeout_ms)}")
    connection.execute("PRAGMA journal_mode = WAL")
    connection.execute("PRAGMA synchronous = NORMAL")
    connection.execute("PRAGMA foreign_keys = ON")
    connection.execute(f"PRAGMA cache_size = {SQLITE_CACHE_KIB}")
    connection.execute(f"PRAGMA journal_size_limit = {int(wal_limit_bytes)}")


def postgres_server_settings(*, bounded: bool = True) -> dict[str, str]:
    """Every PostgreSQL connection's session settings, the engine's and the direct store's."""
    settings = {"application_name": APPLICATION_NAME}
    if bounded:
        settings["statement_timeout"] = str(SERVER_STATEMENT_TIMEOUT_MS)
    return settings


def _sqlite_pragmas(dbapi_connection: Any, _record: ConnectionPoolEntry) -> None:
    cursor = dbapi_connection.cursor()
    set_sqlite_options(cursor)
    cursor.close()


def create_sessionmaker(engine: AsyncEngine) -> async_sessionmaker[AsyncSession]:
    return async_sessionmaker(engine, expire_on_commit=False)


async def get_session(request: Request) -> AsyncIterator[AsyncSession]:
    """This request's session; committed once if the handler finished without raising."""
    maker: async_sessionmaker[AsyncSession] = request.app.state.sessionmaker
    async with maker() as session:
        try:
            yield session
        except BaseException:
            await session.rollback()
            raise
        else:
            await session.commit()
