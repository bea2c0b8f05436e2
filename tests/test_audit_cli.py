"""`connect-broker audit list`, the operator commands' own events, and the retention sweep."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
from sqlalchemy import insert, select
from sqlalchemy.ext.asyncio import AsyncEngine, async_sessionmaker

from app import audit
from app.clock import utcnow
from app.models import AuditEvent

from .integration_api.test_api import fresh_name, register
from .oauth.flows import connect, elicit
from .oauth.helpers import unique as fresh_user
from .support.broker import BrokerProcess, cli
from .support.clients import Browser, McpHttp

pytestmark = pytest.mark.both_databases

COLUMNS = 11  # time, event, actor kind, actor, issuer, subject, provider, audience, account,
# detail, request id


def listed(broker: BrokerProcess, *args: str) -> list[list[str]]:
    result = cli("audit", "list", *args, config_path=broker.config_path)
    assert result.returncode == 0, result.stderr
    lines = [line.split("\t") for line in result.stdout.splitlines()]
    assert all(len(line) == COLUMNS for line in lines), lines
    return lines


async def service_events(db: AsyncEngine, name: str) -> list[tuple[Any, ...]]:
    statement = (
        select(AuditEvent.event, AuditEvent.actor_kind, AuditEvent.detail)
        .where(AuditEvent.audience == name)
        .order_by(AuditEvent.id)
    )
    async with db.connect() as connection:
        return [tuple(row) for row in await connection.execute(statement)]


async def test_a_user_s_events_are_listed_one_per_line_oldest_first(
    broker: BrokerProcess, mcp: McpHttp, token_for: Any, browser: Browser
) -> None:
    user = fresh_user("audit-list")
    token = token_for(user)
    await connect(mcp, browser, token, user)
    issuer = broker.config.issuer

    lines = listed(broker, "--issuer", issuer, "--subject", user)

    assert [line[1] for line in lines] == ["flow.created", "flow.completed", "credential.stored"]
    created = lines[0]
    assert created[2:8] == ["user", f"{issuer}|{user}", issuer, user, "github", "mcp"]
    assert created[8:10] == ["-", "-"]  # no account label yet, no detail
    assert created[10] != "-"
    assert lines[1][8] == "@octocat"
    assert [line[0] for line in lines] == sorted(line[0] for line in lines)
    assert token not in repr(lines)


async def test_the_provider_and_since_filters_narrow_the_list(
    broker: BrokerProcess, mcp: McpHttp, token_for: Any
) -> None:
    user = fresh_user("audit-filter")
    token = token_for(user)
    await elicit(mcp, token)
    await elicit(mcp, token, {"provider": "acme"})
    mine = ("--issuer", broker.config.issuer, "--subject", user)

    github = listed(broker, *mine, "--provider", "github")
    recent = listed(broker, *mine, "--since", "1h")
    future = (utcnow() + timedelta(days=1)).strftime("%Y-%m-%dT%H:%M:%S")
    none_yet = listed(broker, *mine, "--since", future)
    offset = listed(broker, *mine, "--since", "2020-01-01T00:00:00+02:00")

    assert [line[6] for line in github] == ["github"]
    assert sorted(line[6] for line in recent) == ["acme", "github"]
    assert none_yet == []
    assert len(offset) == 2


@pytest.mark.parametrize(
    ("args", "argument", "says"),
    [
        (("--since", "yesterday"), "--since", "neither an ISO-8601 time"),
        (("--since", "7w"), "--since", "a duration (30m, 12h, 7d)"),
        (("--subject", "alice"), "--issuer/--subject", "both --issuer and --subject"),
        (("--provider", "p" * 300), "--provider", "1 to 255 characters"),
        (("--issuer", "", "--subject", "alice"), "--issuer", "1 to 255 characters"),
    ],
)
def test_a_bad_filter_is_refused_with_a_message_naming_it(
    broker: BrokerProcess, args: tuple[str, ...], argument: str, says: str
) -> None:
    result = cli("audit", "list", *args, config_path=broker.config_path)

    assert result.returncode == 2
    assert result.stdout == ""
    assert f"connect-broker audit list: error: argument {argument}: " in result.stderr
    assert says in result.stderr
    assert "Traceback" not in result.stderr


async def test_creating_and_revoking_a_service_and_rotating_keys_are_operator_events(
    broker: BrokerProcess, db: AsyncEngine
) -> None:
    name = fresh_name("audit-svc")
    service = register(broker, name, ("demo", "github"))
    revoked = cli("service", "revoke", name, config_path=broker.config_path)
    again = cli("service", "revoke", name, config_path=broker.config_path)  # nothing to revoke
    since = utcnow()
    rotated = cli("keys", "rotate", config_path=broker.config_path)

    assert (revoked.returncode, again.returncode, rotated.returncode) == (0, 1, 0)
    assert await service_events(db, name) == [
        ("service.created", "operator", "providers=demo,github"),
        ("service.revoked", "operator", None),
    ]
    statement = select(AuditEvent).where(
        AuditEvent.event == "keys.rotated", AuditEvent.occurred_at >= since
    )
    async with db.connect() as connection:
        (rotation,) = (await connection.execute(statement)).all()
    assert (rotation.actor_kind, rotation.actor_id) == ("operator", "cli")
    assert rotation.detail.startswith("key=")
    assert "resealed=" in rotation.detail
    assert service.secret not in repr(await service_events(db, name))


async def test_the_retention_sweep_deletes_only_events_past_the_retention(
    unserved_db: AsyncEngine,
) -> None:
    db = unserved_db  # no broker's own sweep can take the old event first
    user = fresh_user("audit-retention")
    now = utcnow()
    ages = {"old": 91, "kept": 89, "new": 0}
    async with db.begin() as connection:
        await connection.execute(
            insert(AuditEvent),
            [
                {
                    "occurred_at": now - timedelta(days=days),
                    "event": f"test.{label}",
                    "actor_kind": "broker",
                    "actor_id": "broker",
                    "subject": user,
                }
                for label, days in ages.items()
            ],
        )

    deleted = await audit.sweep(async_sessionmaker(db), retention_days=90)

    statement = select(AuditEvent.event).where(AuditEvent.subject == user).order_by(AuditEvent.id)
    async with db.connect() as connection:
        left = list((await connection.execute(statement)).scalars())
    assert left == ["test.kept", "test.new"]
    assert deleted == 1


def test_the_retention_is_configured_in_days_with_a_sane_range() -> None:
    from app.config import ConfigError, load_settings

    assert load_settings(environ={}).audit.retention_days == 90
    assert load_settings(environ={"BROKER_AUDIT_RETENTION_DAYS": "30"}).audit.retention_days == 30
    with pytest.raises(ConfigError, match=r"audit\.retention_days"):
        load_settings(environ={"BROKER_AUDIT_RETENTION_DAYS": "0"})
