"""Alembic environment: async, URL from `config.attributes["url"]`, metadata from app.models.

Each run is one transaction, holding a lock for its whole length: a run that fails or is killed
part-way leaves the database as it was, and runs at the same time (two `migrate`, replicas
starting) take turns. The revision to start from is read under the lock, and left in
`config.attributes["before"]` for `connect-broker migrate` to report; `config.attributes
["connected"]` says the database answered (app/migrate.py tells failures apart by it).

- PostgreSQL's DDL is transactional; `pg_advisory_xact_lock` is the lock, held until the end.
- SQLite's DDL is transactional too, but Python's sqlite3 opens no transaction before DDL (each
  statement would commit on its own), and Alembic assumes none on SQLite. So the driver's own
  transaction handling is turned off and the run begins with `BEGIN IMMEDIATE`, SQLite's write
  lock (SQLAlchemy's pysqlite recipe "Serializable isolation / Savepoints / Transactional DDL").
"""

import asyncio
from typing import Any

from alembic import context
from sqlalchemy import event, text
from sqlalchemy.engine import Connection
from sqlalchemy.ext.asyncio import AsyncEngine
from sqlalchemy.pool import ConnectionPoolEntry

from app.db import create_engine
from app.migrate import require_known
from app.models import Base

config = context.config

# Any constant of the broker's own: `migrate` runs, whatever their version, wait for one another.
ADVISORY_LOCK_KEY = 0x636F6E6E656374  # "connect"


def run_migrations(connection: Connection) -> None:
    sqlite = connection.dialect.name == "sqlite"
    connection.begin()  # on SQLite `BEGIN IMMEDIATE` (`_transactional_sqlite`): its write lock
    if not sqlite:
        connection.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": ADVISORY_LOCK_KEY})
    context.configure(
        connection=connection,
        target_metadata=Base.metadata,
        compare_type=True,
        render_as_batch=sqlite,
        transactional_ddl=True,
    )
    before = context.get_context().get_current_revision()
    require_known(before)
    config.attributes["before"] = before
    with context.begin_transaction():
        context.run_migrations()


def _transactional_sqlite(engine: AsyncEngine) -> None:
    """SQLite: no transaction begun by the driver; SQLAlchemy's begin is `BEGIN IMMEDIATE`."""

    @event.listens_for(engine.sync_engine, "connect")
    def no_driver_transactions(dbapi_connection: Any, _record: ConnectionPoolEntry) -> None:
        dbapi_connection.isolation_level = None

    @event.listens_for(engine.sync_engine, "begin")
    def begin_immediate(connection: Connection) -> None:
        connection.exec_driver_sql("BEGIN IMMEDIATE")


async def run_online() -> None:
    engine = create_engine(config.attributes["url"], pool_size=1, bounded=False)
    if engine.dialect.name == "sqlite":
        _transactional_sqlite(engine)
    try:
        async with engine.connect() as connection:
            config.attributes["connected"] = True
            await connection.run_sync(run_migrations)
            await connection.commit()
    finally:
        await engine.dispose()


if context.is_offline_mode():
    raise SystemExit("offline migrations are not supported; run `connect-broker migrate`")
asyncio.run(run_online())
