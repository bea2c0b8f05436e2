"""Expected failures of the commands that work on the database or a port: one line saying what
happened and what to do, a non-zero exit code, never a traceback; `migrate` says what it did."""

from __future__ import annotations

import asyncio
import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from alembic import command
from alembic.script import ScriptDirectory
from sqlalchemy import text

from app.db import create_engine
from app.migrate import alembic_config

from .support import forked
from .support.broker import BrokerConfig, cli, drop_database, fresh_database
from .support.idp import free_port


@pytest.fixture
def database(tmp_path: Path) -> Iterator[str]:
    url = fresh_database(tmp_path, "cli")
    yield url
    drop_database(url)


def config_file(tmp_path: Path, database_url: str, port: int = 0) -> Path:
    path = tmp_path / "broker.toml"
    path.write_text(BrokerConfig(issuer="http://127.0.0.1:1", port=port).render(database_url))
    return path


def revisions(url: str) -> tuple[str, str]:
    """(the revision before the newest, the newest)."""
    script = ScriptDirectory.from_config(alembic_config(url))
    head = script.get_revision(str(script.get_current_head()))
    assert head is not None and isinstance(head.down_revision, str)
    return head.down_revision, head.revision


@pytest.mark.both_databases  # uses the run's database
def test_migrate_says_what_it_did(tmp_path: Path, database: str) -> None:
    path = config_file(tmp_path, database)
    previous, head = revisions(database)

    created = cli("migrate", config_path=path)
    again = cli("migrate", config_path=path)
    command.downgrade(alembic_config(database), previous)
    upgraded = cli("migrate", config_path=path)

    assert [created.stdout, again.stdout, upgraded.stdout] == [
        f"created database schema at revision {head}\n",
        f"database schema already current at revision {head}\n",
        f"upgraded database schema from revision {previous} to {head}\n",
    ]
    assert [created.returncode, again.returncode, upgraded.returncode] == [0, 0, 0]


UNREACHABLE = "postgresql://broker:pw@127.0.0.1:{port}/broker"


@pytest.mark.parametrize(
    "args",
    [
        ("migrate",),
        ("serve",),
        ("keys", "rotate"),
        ("service", "list"),
        ("service", "create", "svc"),
        ("service", "revoke", "svc"),
        ("revocations", "list"),
        ("audit", "list"),
        ("users", "erase", "--issuer", "https://idp", "--subject", "alice"),
        ("connections", "list"),
        ("connections", "revoke", "--issuer", "https://idp", "--subject", "a", "--provider", "p"),
    ],
)
def test_an_unreachable_database_is_one_line(args: tuple[str, ...], tmp_path: Path) -> None:
    port = free_port()
    path = config_file(tmp_path, UNREACHABLE.format(port=port))

    result = cli(*args, config_path=path)

    assert result.returncode == 1
    assert result.stderr == (
        f"error: database.url: cannot use the database at postgresql://broker:***@127.0.0.1:"
        f"{port}/broker: Connect call failed ('127.0.0.1', {port}); check that the database is "
        "running and reachable, and the URL ([database] url or BROKER_DATABASE_URL)\n"
    )


def test_a_database_file_that_cannot_be_created_is_one_line(tmp_path: Path) -> None:
    blocker = tmp_path / "not-a-directory"
    blocker.write_text("")
    path = config_file(tmp_path, f"sqlite:///{blocker}/broker.db")

    result = cli("migrate", config_path=path)

    assert result.returncode == 1
    assert result.stderr == (
        f"error: database.url: cannot use the database at sqlite:///{blocker}/broker.db: "
        "File exists; check that the database is running and reachable, and the URL "
        "([database] url or BROKER_DATABASE_URL)\n"
    )


@pytest.mark.parametrize("command_name", ["migrate", "serve"])
def test_a_wrong_database_scheme_is_a_configuration_error(
    command_name: str, tmp_path: Path
) -> None:
    path = config_file(tmp_path, "mysql://db.example/broker")

    result = cli(command_name, config_path=path)

    assert result.returncode == 2
    assert result.stderr == (
        "configuration error: database.url: unsupported database 'mysql' "
        "(use sqlite:///path or postgresql://user@host/db)\n"
    )


@pytest.mark.both_databases  # uses the run's database
def test_serve_on_a_database_without_schema_says_to_migrate(tmp_path: Path, database: str) -> None:
    result = cli("serve", config_path=config_file(tmp_path, database))

    assert result.returncode == 2
    assert result.stderr == (
        "configuration error: database.url: the database has no schema yet; "
        "run `connect-broker migrate`\n"
    )


@pytest.mark.both_databases  # uses the run's database
def test_serve_on_a_busy_port_is_one_line(tmp_path: Path, database: str) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        path = config_file(tmp_path, database, port=port)
        assert cli("migrate", config_path=path).returncode == 0

        result = cli("serve", "--port", str(port), config_path=path)

    assert result.returncode == 1
    assert result.stderr == (
        f"error: cannot listen on 127.0.0.1:{port}: Address already in use; stop what is using "
        "it or choose another --port/--host\n"
    )


@pytest.mark.parametrize("args", [("migrate",), ("serve",), ("keys", "rotate"), ("check-config",)])
def test_an_unreadable_config_file_is_one_line(args: tuple[str, ...], tmp_path: Path) -> None:
    missing = tmp_path / "missing.toml"

    result = cli(*args, config_path=missing)

    assert result.returncode == 2
    assert result.stderr == (
        f"configuration error: cannot read config file {missing}: No such file or directory "
        "(give the right path with --config or BROKER_CONFIG)\n"
    )


def cli_in(directory: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """`connect-broker ARGS` run in `directory` with no configuration file."""
    return forked.run(args, cwd=directory)


def test_a_file_the_command_needs_is_one_line(tmp_path: Path) -> None:
    """`dev` keeps the playground's state under ./data; here ./data is a file."""
    (tmp_path / "data").write_text("")

    result = cli_in(tmp_path, "dev", "--port", str(free_port()))

    assert result.returncode == 1
    assert result.stderr == "error: data: File exists; check the path and its permissions\n"


@pytest.mark.both_databases  # uses the run's database
@pytest.mark.parametrize("command_name", ["migrate", "serve"])
def test_a_schema_from_a_newer_version_is_named(
    command_name: str, tmp_path: Path, database: str
) -> None:
    path = config_file(tmp_path, database)
    assert cli("migrate", config_path=path).returncode == 0

    async def stamp_unknown() -> None:
        engine = create_engine(database, pool_size=1)
        async with engine.begin() as connection:
            await connection.execute(text("UPDATE alembic_version SET version_num = 'f00dfeed'"))
        await engine.dispose()

    asyncio.run(stamp_unknown())
    result = cli(command_name, config_path=path)

    assert result.returncode == 2
    assert result.stderr == (
        "configuration error: database.url: the database is at schema revision 'f00dfeed', "
        "which this version of connect-broker does not know (a newer version migrated it?); "
        "run that version, or upgrade this one\n"
    )


@pytest.mark.parametrize(
    ("command_name", "port"),
    [("serve", "99999"), ("serve", "0"), ("dev", "70000"), ("dev", "-1")],
)
def test_a_port_out_of_range_is_an_argument_error(
    command_name: str, port: str, tmp_path: Path
) -> None:
    """Not an OverflowError from the socket: argparse's own error, before anything is done."""
    result = cli_in(tmp_path, command_name, "--port", port)

    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    assert result.stderr.splitlines()[-1] == (
        f"connect-broker {command_name}: error: argument --port: invalid port {port}: ports are "
        "1 to 65535"
    )
    assert list(tmp_path.iterdir()) == []  # `dev` made no data directory
