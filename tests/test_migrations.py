"""The Alembic migrations build exactly the models' schema, on SQLite and PostgreSQL."""

from __future__ import annotations

import asyncio
import itertools
import json
import subprocess
import sys
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import inspect, text

from app.db import create_engine
from app.migrate import alembic_config, head_revision, is_current, shipped_revisions, upgrade
from app.models import Base

from .support.broker import cli, drop_database, fresh_database

pytestmark = pytest.mark.both_databases

NOW = datetime(2026, 12, 1, tzinfo=UTC)


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


def test_each_migration_is_named_after_its_revision_and_revises_the_one_before() -> None:
    """The schema check at start-up reads revisions from the file names (app/migrate.py); they
    must say what Alembic reads inside the files."""
    script = ScriptDirectory.from_config(alembic_config("sqlite://"))
    newest_first = list(script.walk_revisions())
    oldest_first = [revision.revision for revision in reversed(newest_first)]

    assert shipped_revisions() == oldest_first
    assert head_revision() == script.get_current_head()
    for revision in newest_first:
        assert Path(revision.path).name.startswith(f"{revision.revision}_"), revision.path
    for older, newer in itertools.pairwise(oldest_first):
        assert script.get_revision(newer).down_revision == older


def test_the_schema_check_at_start_up_does_not_import_alembic(tmp_path: Path) -> None:
    """What every `serve` and command pays for knowing the schema is current: no Alembic."""
    url = fresh_database(tmp_path, "startup")
    check = (
        "import sys\n"
        "from app.migrate import require_current\n"
        f"require_current({url!r})\n"
        "print(sorted(name for name in sys.modules if name.split('.')[0] == 'alembic'))\n"
    )
    try:
        upgrade(url)
        done = subprocess.run(
            [sys.executable, "-c", check], capture_output=True, text=True, timeout=60, check=False
        )
    finally:
        drop_database(url)

    assert (done.returncode, done.stdout, done.stderr) == (0, "[]\n", "")


def _rows(url: str, sql: str, **params: Any) -> list[dict[str, Any]]:
    async def run() -> list[dict[str, Any]]:
        engine = create_engine(url, pool_size=1)
        try:
            async with engine.begin() as connection:
                result = await connection.execute(text(sql), params)
                return [dict(row) for row in result.mappings()] if result.returns_rows else []
        finally:
            await engine.dispose()

    return asyncio.run(run())


def test_0010_keeps_connections_of_old_and_tells_several_accounts_apart(tmp_path: Path) -> None:
    """A connection made before 0010 keeps working (account id "" = not known, selected when it
    was last updated); afterwards a second account of the same provider is a second row."""
    url = fresh_database(tmp_path, "accounts")
    values = {"issuer": "https://idp", "subject": "alice", "provider": "github", "at": NOW}
    insert = (
        "INSERT INTO connections (issuer, subject, provider, audience, status, sealed_credential,"
        " key_id, scopes, account_label, created_at, updated_at) VALUES (:issuer, :subject,"
        " :provider, 'mcp', 'active', 'v1.k.n.c', 'k', '', '@old', :at, :at)"
    )
    try:
        command.upgrade(alembic_config(url), "0009")
        _rows(url, insert, **values)
        command.upgrade(alembic_config(url), "head")
        (kept,) = _rows(url, "SELECT account_id, selected_at, account_label FROM connections")
        _rows(
            url,
            insert.replace(
                "account_label, created_at", "account_label, account_id, selected_at, created_at"
            ).replace("'@old', :at", "'@new', '42', :at, :at"),
            **values,
        )
        both = _rows(url, "SELECT account_id FROM connections ORDER BY account_id")
        command.downgrade(alembic_config(url), "0009")
        after_downgrade = _rows(url, "SELECT account_label FROM connections")
    finally:
        drop_database(url)

    assert (kept["account_id"], kept["account_label"]) == ("", "@old")
    assert kept["selected_at"] is not None
    assert [row["account_id"] for row in both] == ["", "42"]
    assert len(after_downgrade) == 1  # one account per provider again: the latest selected


def _config(tmp_path: Path, url: str) -> Path:
    path = tmp_path / "broker.toml"
    path.write_text(f"[database]\nurl = {json.dumps(url)}\n")
    return path


def test_a_migrate_failing_part_way_keeps_nothing_and_the_next_one_completes(
    tmp_path: Path,
) -> None:
    """One transaction for the whole run: a failure in the last migration (here a table in the
    way of 0010's last statement) leaves the database as it was, with nothing to clean up, so
    that once the cause is gone `migrate` completes. The failure is one line, not taken for an
    unreachable database."""
    url = fresh_database(tmp_path, "partway")
    path = _config(tmp_path, url)
    try:
        _rows(url, "CREATE TABLE account_choices (id INTEGER)")
        failed = cli("migrate", config_path=path)
        left = _tables(url)
        _rows(url, "DROP TABLE account_choices")
        again = cli("migrate", config_path=path)
        diff = _schema_diff(url)
    finally:
        drop_database(url)

    assert failed.returncode == 1
    assert failed.stderr.startswith("error: database.url: migrating the schema failed: ")
    assert failed.stderr.endswith(
        "; nothing of it was kept (there is no schema yet). Fix what the database names, then "
        "run `connect-broker migrate` again\n"
    )
    assert "account_choices" in failed.stderr and failed.stderr.count("\n") == 1
    assert left == {"account_choices"}
    assert (again.returncode, again.stdout) == (
        0,
        f"created database schema at revision {head_revision()}\n",
    )
    assert diff == []


@pytest.mark.parametrize("start", [None, "0007"], ids=["empty", "from-0007"])
def test_migrate_runs_at_the_same_time_take_turns(tmp_path: Path, start: str | None) -> None:
    """Three `connect-broker migrate` at once (replicas starting, a deployment run twice): one
    migrates, the others find the schema current once it is."""
    url = fresh_database(tmp_path, "together")
    path = _config(tmp_path, url)
    head = head_revision()
    try:
        if start:
            command.upgrade(alembic_config(url), start)
        runs = [
            subprocess.Popen(
                [sys.executable, "-m", "app.cli", "--config", str(path), "migrate"],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            for _ in range(3)
        ]
        results = [(run.wait(120), *run.communicate()) for run in runs]
        diff = _schema_diff(url)
    finally:
        drop_database(url)

    current = f"database schema already current at revision {head}\n"
    done = (
        f"upgraded database schema from revision {start} to {head}\n"
        if start
        else f"created database schema at revision {head}\n"
    )
    assert sorted(results) == sorted([(0, done, ""), (0, current, ""), (0, current, "")])
    assert diff == []
