"""Run the Alembic migrations that ship inside the package."""

from __future__ import annotations

from alembic import command
from alembic.config import Config

from app.resources import resource_dir


def alembic_config(url: str) -> Config:
    config = Config()
    config.set_main_option("script_location", str(resource_dir("migrations")))
    config.attributes["url"] = url
    return config


def upgrade(url: str) -> None:
    """Bring the database at `url` to the newest schema (idempotent)."""
    command.upgrade(alembic_config(url), "head")


def require_current(url: str) -> None:
    """Refuse to work on a database that `connect-broker migrate` has not brought up to date.

    Raises:
        ConfigError: naming `database.url` and the command to run.
    """
    from app.config_sources import ConfigError

    if not is_current(url):
        raise ConfigError("database.url: the schema is not current; run `connect-broker migrate`")


def is_current(url: str) -> bool:
    """True when the database at `url` is at the newest revision."""
    import asyncio

    from alembic.runtime.migration import MigrationContext
    from alembic.script import ScriptDirectory

    from app.db import create_engine

    head = ScriptDirectory.from_config(alembic_config(url)).get_current_head()

    async def current() -> str | None:
        engine = create_engine(url, pool_size=1)
        try:
            async with engine.connect() as connection:
                return await connection.run_sync(
                    lambda sync: MigrationContext.configure(sync).get_current_revision()
                )
        finally:
            await engine.dispose()

    return asyncio.run(current()) == head
