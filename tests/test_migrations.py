"""The Alembic migrations build exactly the models' schema, on SQLite and PostgreSQL."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import inspect

from app.db import create_engine
from app.migrate import alembic_config, is_current, upgrade
from app.models import Base

from .support.broker import drop_database, fresh_database

pytestmark = pytest.mark.both_databases


def _schema_diff(url: str) -> list[Any]:
    async def diff() -> list[Any]:
        engine = create_engine(url, pool_size=1)
        try:
            async with engine.connect() as connection:
                return await connection.run_sync(
                    lambda sync: compare_metadata(MigrationContext.configure(sync), Base.metadata)
                )
        finally:
            await engine.dispose()

    return asyncio.run(diff())


def _tables(url: str) -> set[str]:
    async def tables() -> set[str]:
        engine = create_engine(url, pool_size=1)
        try:
            async with engine.connect() as connection:
                names = await connection.run_sync(lambda sync: inspect(sync).get_table_names())
                return set(names)
        finally:
            await engine.dispose()

    return asyncio.run(tables())


def test_upgrade_head_matches_the_models_and_downgrade_removes_everything(
    tmp_path: Path,
) -> None:
    url = fresh_database(tmp_path, "migrations")
    try:
        upgrade(url)
        diff = _schema_diff(url)
        current = is_current(url)
        command.downgrade(alembic_config(url), "base")
        left = _tables(url) - {"alembic_version"}
    finally:
        drop_database(url)

    assert diff == []
    assert current
    assert left == set()
