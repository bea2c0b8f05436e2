"""Run the Alembic migrations that ship inside the package, and say where the database stands.

Where it stands is read without Alembic, which only `migrate` imports: the database's
`alembic_version` row, against the revisions shipped in migrations/versions, whose files are
named after their revision (`0010_several_accounts.py` holds "0010", each revising the one
before; tests/test_migrations.py checks both). `serve` and every command check the schema as
they start (docs/adr/0008-schema-check-without-alembic.md).
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import re
from collections.abc import Iterator
from typing import TYPE_CHECKING

from sqlalchemy import Select, column, inspect, select, table
from sqlalchemy.engine import make_url
from sqlalchemy.exc import ArgumentError, DBAPIError, IntegrityError

from app.cli_errors import CommandFailed
from app.config_sources import ConfigError, env_variable
from app.resources import resource_dir

if TYPE_CHECKING:
    from alembic.config import Config

DRIVERS = {"sqlite": "aiosqlite", "postgresql": "asyncpg", "postgres": "asyncpg"}
MIGRATION_FILE = re.compile(r"(\d{4})_\w+\.py")
VERSION_TABLE = "alembic_version"
SCHEMA_VERSION: Select[str] = select(column("version_num")).select_from(table(VERSION_TABLE))


class DatabaseUnreachable(CommandFailed):
    """The configured database did not answer; the message says which and what to check."""

    def __init__(self, problem: str) -> None:
        super().__init__(
            f"database.url: {problem}; check that the database is running and reachable, "
            f"and the URL ([database] url or {env_variable('database.url')})"
        )
        self.problem = problem


def alembic_config(url: str) -> Config:
    from alembic.config import Config

    config = Config()
    config.set_main_option("script_location", str(resource_dir("migrations")))
    config.attributes["url"] = url
    return config


def upgrade(url: str) -> str:
    """Bring the database at `url` to the newest schema (idempotent); say what was done.

    One transaction under a lock (migrations/env.py): runs at the same time take turns, and one
    that fails leaves the database as it was. Where the database stood is read under that lock.

    Raises:
        ConfigError: the URL is not one the broker can use, or the database is at a revision
            this version does not ship.
        DatabaseUnreachable: the database did not answer.
        MigrationFailed: the database answered, and refused a migration's statement.
    """
    from alembic import command

    problem = url_problem(url)
    if problem:
        raise ConfigError(f"database.url: {problem}")
    config = alembic_config(url)
    with _migration_errors(url, config):
        command.upgrade(config, "head")
    before, head = config.attributes["before"], head_revision()
    if before == head:
        return f"database schema already current at revision {head}"
    if before is None:
        return f"created database schema at revision {head}"
    return f"upgraded database schema from revision {before} to {head}"


class MigrationFailed(CommandFailed):
    """The database answered, and refused a statement of a migration: the run was rolled back."""


@contextlib.contextmanager
def _migration_errors(url: str, config: Config) -> Iterator[None]:
    """A database error before the database answered (`config.attributes["connected"]`, set by
    migrations/env.py), or from a connection that went away, is DatabaseUnreachable; any other
    is the migration's, MigrationFailed. Either in one line."""
    try:
        yield
    except (OSError, DBAPIError) as error:
        lost = isinstance(error, OSError) or error.connection_invalidated
        if lost or not config.attributes.get("connected"):
            raise _unreachable(url, error) from None
        raise MigrationFailed(
            f"database.url: migrating the schema failed: {_reason(error)}; nothing of it was "
            f"kept{_where_it_stays(config)}. Fix what the database names, then run "
            "`connect-broker migrate` again"
        ) from None


def _where_it_stays(config: Config) -> str:
    if "before" not in config.attributes:  # failed before the revision was read
        return ""
    before = config.attributes["before"]
    return f" (the schema stays at revision {before})" if before else " (there is no schema yet)"


def require_current(url: str) -> None:
    """Refuse to work on a database that `connect-broker migrate` has not brought up to date.

    Raises:
        ConfigError: naming `database.url` and the command to run.
        DatabaseUnreachable: the database did not answer.
    """
    problem = schema_problem(url)
    if problem:
        raise ConfigError(f"database.url: {problem}")


def schema_problem(url: str) -> str | None:
    """Why the database at `url` is not ready for `serve`, or None.

    Raises:
        ConfigError: the URL is not one the broker can use.
        DatabaseUnreachable: the database did not answer.
    """
    current, head = current_revision(url), head_revision()
    if current == head:
        return None
    require_known(current)
    if current is None:
        return "the database has no schema yet; run `connect-broker migrate`"
    return (
        f"the schema is not current (at revision {current}, newest {head}); "
        "run `connect-broker migrate`"
    )


def is_current(url: str) -> bool:
    """True when the database at `url` is at the newest revision."""
    return current_revision(url) == head_revision()


def require_known(revision: str | None) -> None:
    """Refuse a database at a revision this version does not ship (a newer version's).

    Raises:
        ConfigError: saying which revision and what to run.
    """
    if revision is not None and revision not in shipped_revisions():
        raise ConfigError(
            f"database.url: the database is at schema revision {revision!r:.40}, which this "
            "version of connect-broker does not know (a newer version migrated it?); run that "
            "version, or upgrade this one"
        )


def shipped_revisions() -> list[str]:
    """The revisions of the migrations shipped, oldest first (read from their file names)."""
    names = (path.name for path in (resource_dir("migrations") / "versions").iterdir())
    return sorted(found[1] for name in names if (found := MIGRATION_FILE.fullmatch(name)))


@functools.cache  # read by every readiness probe
def head_revision() -> str:
    """The newest revision shipped: the one `migrate` brings a database to."""
    return shipped_revisions()[-1]


def url_problem(url: str) -> str | None:
    """Why `url` is not a database URL the broker can use (scheme, driver), or None."""
    try:
        parsed = make_url(url)
    except ArgumentError:
        return "not a database URL (use sqlite:///path or postgresql://user@host/db)"
    backend = parsed.get_backend_name()
    driver = DRIVERS.get(backend)
    if driver is None:
        return f"unsupported database {backend!r} (use sqlite:///path or postgresql://user@host/db)"
    if importlib.util.find_spec(driver) is None:
        return f"the {driver} driver for {backend} is not installed (pip install {driver})"
    return None


def current_revision(url: str) -> str | None:
    """The database's schema revision, None for a database without one.

    Raises:
        ConfigError: the URL is not one the broker can use.
        DatabaseUnreachable: the database did not answer.
    """
    import asyncio

    from app.db import create_engine

    problem = url_problem(url)
    if problem:
        raise ConfigError(f"database.url: {problem}")

    async def current() -> str | None:
        engine = create_engine(url, pool_size=1)
        try:
            async with engine.connect() as connection:
                has_version = await connection.run_sync(
                    lambda sync: inspect(sync).has_table(VERSION_TABLE)
                )
                return await connection.scalar(SCHEMA_VERSION) if has_version else None
        finally:
            await engine.dispose()

    with translated_errors(url):
        return asyncio.run(current())


@contextlib.contextmanager
def translated_errors(url: str) -> Iterator[None]:
    """Turn the errors of a database that does not answer into DatabaseUnreachable."""
    try:
        yield
    except IntegrityError:
        raise  # the database answered: a constraint refused the change
    except (OSError, DBAPIError) as error:
        raise _unreachable(url, error) from None


def _unreachable(url: str, error: OSError | DBAPIError) -> DatabaseUnreachable:
    where = make_url(url).render_as_string(hide_password=True)
    return DatabaseUnreachable(f"cannot use the database at {where}: {_reason(error)}")


def _reason(error: OSError | DBAPIError) -> str:
    """What the operating system, the database or its driver said, first line only."""
    if isinstance(error, OSError):
        return error.strerror or type(error).__name__
    return str(error.orig).splitlines()[0] if error.orig else type(error).__name__
