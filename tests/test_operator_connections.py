"""Connections for operators: `connections list` and `connections revoke`."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest
from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncEngine

from app.main import Shared
from app.models import AuditEvent, Connection, PendingRevocation

from .oauth.flows import connect
from .oauth.helpers import connection_row
from .oauth.helpers import unique as fresh_user
from .oauth.test_revocation_retries import close_runtime, open_runtime
from .support.broker import BrokerProcess, cli
from .support.clients import Browser, McpHttp
from .support.fake_github import FakeGitHub

pytestmark = pytest.mark.both_databases

LIST_COLUMNS = 10


@pytest.fixture(autouse=True)
def _fresh_fake(fake_github: FakeGitHub) -> Iterator[None]:
    fake_github.reset()
    yield
    fake_github.reset()


@pytest.fixture
async def runtime(broker: BrokerProcess) -> AsyncIterator[Shared]:
    opened = await open_runtime(broker)
    yield opened
    await close_runtime(opened)


async def events(db: AsyncEngine, user: str, name: str) -> list[Any]:
    statement = select(AuditEvent).where(AuditEvent.subject == user, AuditEvent.event == name)
    async with db.connect() as connection:
        return list((await connection.execute(statement)).all())


async def queued_for(db: AsyncEngine, user: str) -> int:
    statement = select(PendingRevocation.id).where(PendingRevocation.subject == user)
    async with db.connect() as connection:
        return len((await connection.execute(statement)).all())


async def test_an_operator_lists_connections_without_secrets_and_revokes_one(
    broker: BrokerProcess,
    mcp: McpHttp,
    token_for: Any,
    browser: Browser,
    fake_github: FakeGitHub,
    db: AsyncEngine,
) -> None:
    user = fresh_user("ops-conn")
    issuer = broker.config.issuer
    await connect(mcp, browser, token_for(user), user)
    row = await connection_row(db, user)
    mine = ("--issuer", issuer, "--subject", user)

    listed = cli("connections", "list", *mine, config_path=broker.config_path)
    by_provider = cli("connections", "list", "--provider", "slack", config_path=broker.config_path)
    revoked = cli(
        "connections", "revoke", *mine, "--provider", "github", config_path=broker.config_path
    )
    again = cli(
        "connections", "revoke", *mine, "--provider", "github", config_path=broker.config_path
    )

    assert listed.returncode == 0, listed.stderr
    (line,) = [line.split("\t") for line in listed.stdout.splitlines()]
    assert len(line) == LIST_COLUMNS
    assert line[:8] == [
        str(row["id"]),
        issuer,
        user,
        "github",
        "mcp",
        "active",
        "@octocat",
        "read:user",
    ]
    for secret in (row["sealed_credential"], fake_github.issued_access_tokens[-1]):
        assert secret not in listed.stdout
    assert user not in by_provider.stdout
    assert revoked.returncode == 0, revoked.stderr
    assert "revocation is queued" in revoked.stdout
    assert again.returncode == 1
    assert "no 'github' connection" in again.stderr
    assert (await count(db, user)) == 0
    assert await queued_for(db, user) == 1
    (event,) = await events(db, user, "connection.revoked")
    assert (event.actor_kind, event.actor_id, event.detail) == (
        "operator",
        "cli",
        "revocation queued",
    )


async def count(db: AsyncEngine, user: str) -> int:
    statement = select(Connection.id).where(Connection.subject == user)
    async with db.connect() as connection:
        return len((await connection.execute(statement)).all())


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (("list", "--subject", "s"), "argument --issuer/--subject"),
        (("list", "--service", "x" * 300), "argument --service: must be 1 to 255"),
        (("revoke", "--issuer", "i", "--subject", "s"), "--provider"),
    ],
)
def test_bad_connection_arguments_are_refused(
    broker: BrokerProcess, args: tuple[str, ...], says: str
) -> None:
    result = cli("connections", *args, config_path=broker.config_path)

    assert result.returncode == 2
    assert says in result.stderr
    assert "Traceback" not in result.stderr
