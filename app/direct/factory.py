"""Pick the direct store for a database URL."""

from __future__ import annotations

from sqlalchemy.engine import make_url

from app.direct.records import DirectStore


def open_direct_store(url: str, *, pool_size: int) -> DirectStore:
    """A store for `url`; connections are opened on first use, not here."""
    parsed = make_url(url)
    if parsed.get_backend_name() == "sqlite":
        from app.direct.sqlite import SqliteStore

        if not parsed.database or parsed.database == ":memory:":
            raise ValueError("SQLite needs a database file, not an in-memory database")
        return SqliteStore(parsed.database)
    from app.direct.postgres import PostgresStore

    dsn = parsed.set(drivername="postgresql").render_as_string(hide_password=False)
    return PostgresStore(dsn, pool_size=pool_size)
