"""Connections for operators: `connections list` and `connections revoke`, the days of use the
housekeeping writes, and `[connections] max_idle_days` (app/connect/idle.py)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from sqlalchemy import select, update
from sqlalchemy.ext.asyncio import AsyncEngine, async_sessionmaker

from app.auth.principal import Principal
from app.clock import utcnow
from app.config import ConfigError, load_settings
from app.connect.idle import UsageLog, revoke_idle, today
from app.main import Shared
from app.mcp.accounts import NEW_ACCOUNT
from app.models import AuditEvent, Connection, PendingRevocation

from .oauth.flows import connect
from .oauth.helpers import connection_row
from .oauth.helpers import unique as fresh_user
from .oauth.test_revocation_retries import close_runtime, open_runtime
from .support.broker import BrokerProcess, cli
from .support.clients import Browser, McpHttp
from .support.fake_github import FakeGitHub

pytestmark = pytest.mark.both_databases

LIST_COLUMNS = 11


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
    # the connect round's last retry read the connection: its use is written by the broker's
    # housekeeping within the minute, as the day (midnight UTC), or not yet
    assert line[10] in ("-", datetime.now(UTC).date().isoformat()), line
    issued = fake_github.issued_access_tokens[-1]
    for secret in (row["sealed_credential"], issued):
        assert secret not in listed.stdout
    assert user not in by_provider.stdout
    assert revoked.returncode == 0, revoked.stderr
    assert "revocation is queued" in revoked.stdout
    assert again.returncode == 1
    assert "no 'github' connection" in again.stderr
    assert (await count(db, user)) == 0
    # queued for the broker's revocation worker, unless the worker has already revoked it upstream
    assert await queued_for(db, user) == 1 or not fake_github.is_live(issued)
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


async def test_a_credential_handed_out_is_written_as_used_once_a_day(
    mcp: McpHttp,
    token_for: Any,
    browser: Browser,
    db: AsyncEngine,
    runtime: Shared,
    broker: BrokerProcess,
) -> None:
    user = fresh_user("ops-used")
    await connect(mcp, browser, token_for(user), user)
    usable = runtime.connect_api.rounds.credentials
    principal = Principal(broker.config.issuer, user)

    for _ in range(3):
        assert await usable.usable(principal=principal, provider="github", audience="mcp")
    written = await runtime.usage.flush(runtime.sessionmaker)
    assert await usable.usable(principal=principal, provider="github", audience="mcp")
    written_again = await runtime.usage.flush(runtime.sessionmaker)

    assert (written, written_again) == (1, 0)  # noted once for the day
    assert (await connection_row(db, user))["last_used_at"] == today()


class Nowhere:
    """A sessionmaker whose database is down."""

    def begin(self) -> Any:
        raise ConnectionError("no database in this test")


async def test_a_failed_write_keeps_the_notes_and_a_new_day_notes_again() -> None:
    usage = UsageLog()
    usage.note(7)
    usage.note(7)

    with pytest.raises(ConnectionError):
        await usage.flush(Nowhere())  # type: ignore[arg-type]
    assert usage._pending == {7}  # written by the next flush

    usage._pending.clear()  # as if written
    usage.note(7)
    assert usage._pending == set()  # once a day
    usage._day -= timedelta(days=1)
    assert await usage.flush(Nowhere()) == 0  # type: ignore[arg-type]
    usage.note(7)
    assert usage._pending == {7}


async def test_connections_idle_past_the_limit_are_revoked_with_an_event(
    mcp: McpHttp,
    token_for: Any,
    broker: BrokerProcess,
    db: AsyncEngine,
    runtime: Shared,
) -> None:
    idle, used, new, again = (fresh_user(f"ops-idle-{n}") for n in ("a", "b", "c", "d"))

    async def connect_in_own_browser(user: str, account: str | None = None) -> None:
        arguments = {"provider": "github"} | ({"account": account} if account else {})
        browser = Browser(broker.url)  # one browser each: a sign-in is per browser
        try:
            # Not retried: the shared broker hands no credential out, so its housekeeping has
            # no use of these connections to write over the days of use set below.
            await connect(mcp, browser, token_for(user), user, arguments, retried=False)
        finally:
            await browser.aclose()

    for user in (idle, used, new, again):
        await connect_in_own_browser(user)
    long_ago = utcnow() - timedelta(days=10)
    async with db.begin() as connection:
        await connection.execute(
            update(Connection)
            .where(Connection.subject.in_([idle, used, again]))
            .values(
                created_at=long_ago,
                selected_at=long_ago,
                last_used_at=today() - timedelta(days=10),
            )
        )
        await connection.execute(
            update(Connection)
            .where(Connection.subject == used)
            .values(last_used_at=today() - timedelta(days=7))
        )

    await connect_in_own_browser(again, NEW_ACCOUNT)  # the same account granted again today

    revoked = await revoke_idle(
        async_sessionmaker(db, expire_on_commit=False),
        max_idle_days=7,
        sealing=runtime.keys.sealing,
        providers=runtime.settings.providers,
    )

    assert revoked >= 1
    assert await count(db, idle) == 0
    assert await count(db, used) == 1  # used on the first day of the seven
    assert await count(db, new) == 1
    assert await count(db, again) == 1  # granted again: not idle, whatever its last use
    assert (await connection_row(db, again))["created_at"] == long_ago  # the same row
    assert await queued_for(db, idle) == 1
    (event,) = await events(db, idle, "connection.idle_revoked")
    assert (event.actor_kind, event.provider, event.account_label) == (
        "broker",
        "github",
        "@octocat",
    )


def test_max_idle_days_is_off_unless_set_and_at_least_a_day() -> None:
    assert load_settings(environ={}).connections.max_idle_days is None
    settings = load_settings(environ={"BROKER_CONNECTIONS_MAX_IDLE_DAYS": "30"})
    assert settings.connections.max_idle_days == 30
    with pytest.raises(ConfigError, match=r"connections\.max_idle_days"):
        load_settings(environ={"BROKER_CONNECTIONS_MAX_IDLE_DAYS": "0"})
