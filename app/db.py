"""Engine and session factories for SQLite (embedded default) and PostgreSQL.

Plain URLs (`sqlite:///path`, `postgresql://user@host/db`) get their async driver here. Waits are
bounded: a pool timeout, a connect timeout and a statement timeout, so an outage turns into a quick
503 instead of a hang. SQL parameters are never logged (`hide_parameters`).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from sqlalchemy import event
from sqlalchemy.engine import URL, make_url
from sqlalchemy.ext.asyncio import (
    AsyncEngine,
    AsyncSession,
    async_sessionmaker,
    create_async_engine,
)
from sqlalchemy.pool import ConnectionPoolEntry
from starlette.requests import Request

POOL_TIMEOUT_SECONDS = 3
CONNECT_TIMEOUT_SECONDS = 3
STATEMENT_TIMEOUT_MS = 5000


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
        return parsed.set(drivername="postgresql+asyncpg")
    raise ValueError(f"unsupported database {backend!r} (use sqlite:/// or postgresql://)")


def is_sqlite(url: str) -> bool:
    return make_url(url).get_backend_name() == "sqlite"


def create_engine(url: str, *, pool_size: int = 10) -> AsyncEngine:
    target = async_url(url)
    if target.get_backend_name() == "sqlite":
        if target.database and target.database != ":memory:":
            Path(target.database).parent.mkdir(parents=True, exist_ok=True)
        engine = create_async_engine(
            target,
            hide_parameters=True,
            pool_size=pool_size,
            max_overflow=pool_size,
            pool_timeout=POOL_TIMEOUT_SECONDS,
            connect_args={"timeout": CONNECT_TIMEOUT_SECONDS},
        )
        event.listen(engine.sync_engine, "connect", _sqlite_pragmas)
        return engine
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
            "command_timeout": STATEMENT_TIMEOUT_MS / 1000,
            "server_settings": {"statement_timeout": str(STATEMENT_TIMEOUT_MS)},
        },
    )


def _sqlite_pragmas(dbapi_connection: Any, _record: ConnectionPoolEntry) -> None:
    cursor = dbapi_connection.cursor()
    cursor.execute("PRAGMA journal_mode=WAL")
    cursor.execute("PRAGMA synchronous=NORMAL")
    cursor.execute("PRAGMA busy_timeout=5000")
    cursor.execute("PRAGMA foreign_keys=ON")
    cursor.close()


def create_sessionmaker(engine: AsyncEngine) -> async_sessionmaker[AsyncSession]:
    return async_sessionmaker(engine, expire_on_commit=False)


async def get_session(request: Request) -> AsyncIterator[AsyncSession]:
    """This request's session; committed once if the handler finished without raising."""
    maker: async_sessionmaker[AsyncSession] = request.app.state.runtime.sessionmaker
    async with maker() as session:
        try:
            yield session
        except BaseException:
            await session.rollback()
            raise
        else:
            await session.commit()
