"""Erasing a user: `connect-broker users erase` and `DELETE /api/v1/admin/users`, one function
(app/connect/erasure.py). Grants are revoked upstream (queued, then made by the housekeeping);
connections, account choices, flows, browser sessions and the user's audit events older than the
hold go, also a connection that a flow completion in progress stores meanwhile."""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import AsyncIterator, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import httpx2
import pytest
from sqlalchemy import event, func, insert, select, text
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession

from app import credentials
from app.audit import CLI, Actor
from app.auth.principal import Principal
from app.clock import utcnow
from app.connect import service as flows
from app.connect.erasure import Erased, erase_user
from app.crypto import Keyring
from app.db import create_engine, create_sessionmaker
from app.main import Shared
from app.models import (
    AccountChoice,
    AuditEvent,
    Connection,
    Flow,
    FlowStatus,
    LoginSession,
    PendingRevocation,
)

from .conftest import DEMO_PROVIDER
from .oauth.flows import connect, elicit
from .oauth.helpers import unique as fresh_user
from .oauth.test_refresh_revoke import at_fake, github_received_revocations
from .oauth.test_revocation_retries import close_runtime, open_runtime
from .support.broker import BrokerConfig, BrokerProcess, cli, running_broker
from .support.clients import Browser, McpHttp
from .support.fake_github import FakeGitHub
from .support.http import local_client
from .support.idp import IdpProcess, mint_token

pytestmark = pytest.mark.both_databases

ADMIN_TOKEN = "admin-token-" + "a" * 40
PROBLEM = "application/problem+json"


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


async def count_of(db: AsyncEngine, model: Any, user: str) -> int:
    statement = select(func.count()).select_from(model).where(model.subject == user)
    async with db.connect() as connection:
        return int((await connection.execute(statement)).scalar_one())


async def events_of(db: AsyncEngine, user: str) -> list[Any]:
    statement = select(AuditEvent).where(AuditEvent.subject == user).order_by(AuditEvent.id)
    async with db.connect() as connection:
        return list((await connection.execute(statement)).all())


async def add_old_event(db: AsyncEngine, issuer: str, user: str, days: int) -> None:
    async with db.begin() as connection:
        await connection.execute(
            insert(AuditEvent).values(
                occurred_at=utcnow() - timedelta(days=days),
                event=f"test.{days}_days_ago",
                actor_kind="broker",
                actor_id="broker",
                issuer=issuer,
                subject=user,
            )
        )


async def test_erase_revokes_the_grants_and_deletes_all_but_the_held_events(
    broker: BrokerProcess,
    mcp: McpHttp,
    token_for: Any,
    browser: Browser,
    fake_github: FakeGitHub,
    db: AsyncEngine,
    runtime: Shared,
) -> None:
    user = fresh_user("erase")
    issuer = broker.config.issuer
    token = token_for(user)
    await connect(mcp, browser, token, user)  # a GitHub grant, a completed flow, a session
    github_token = fake_github.issued_access_tokens[-1]
    await elicit(mcp, token, {"provider": "acme"})  # an open flow
    await add_old_event(db, issuer, user, days=40)  # past the 30-day hold
    bystander = fresh_user("erase-bystander")
    await elicit(mcp, token_for(bystander))

    erased = cli(
        "users", "erase", "--issuer", issuer, "--subject", user, config_path=broker.config_path
    )

    assert erased.returncode == 0, erased.stderr
    assert erased.stdout.strip().endswith(
        "connections=1 revocations_queued=1 account_choices=0 flows=2 sessions=1 audit_events=1"
    )
    for model in (Connection, Flow, LoginSession):
        assert await count_of(db, model, user) == 0
    assert await count_of(db, Flow, bystander) == 1
    # queued for the broker's revocation worker, unless the worker has already revoked it upstream
    assert await count_of(db, PendingRevocation, user) == 1 or not fake_github.is_live(github_token)
    events = await events_of(db, user)
    assert "test.40_days_ago" not in [row.event for row in events]
    assert [row.event for row in events][:3] == [
        "flow.created",
        "flow.completed",
        "credential.stored",
    ]
    names = [row.event for row in events]
    erased_at = names.index("user.erased")
    erasure = events[erased_at]
    assert (erasure.event, erasure.actor_kind, erasure.actor_id) == (
        "user.erased",
        "operator",
        "cli",
    )
    assert erasure.detail == (
        "connections=1 revocations_queued=1 account_choices=0 flows=2 sessions=1 audit_events=1"
    )
    # the erasure is the last event, unless the revocation worker has since revoked the grant
    after = names[erased_at + 1 :]
    assert after in ([], ["revocation.confirmed"]), after
    assert not after or not fake_github.is_live(github_token)
    assert github_token not in erased.stdout + erased.stderr

    await runtime.revoker.sweep()  # the housekeeping's next round (or the broker's own)
    await github_received_revocations(fake_github, 1)
    gone = await at_fake(
        fake_github, "GET", "/user", headers={"Authorization": f"Bearer {github_token}"}
    )
    assert gone.status_code == 401
    page = await browser.get("/connections")
    assert page.status_code == 303  # the browser session is gone: sign in again


async def test_erase_deletes_every_account_choice_of_the_user(
    broker: BrokerProcess, db: AsyncEngine
) -> None:
    """A choice of an account that no connection has any more goes too: here one made for a
    connection of old (no upstream account id), which a new grant of the same account adopted."""
    issuer = broker.config.issuer
    user, bystander = fresh_user("erase-choices"), fresh_user("erase-choices-bystander")
    keys = Keyring.parse(tuple(broker.config.encryption))
    maker = create_sessionmaker(db)
    for subject in (user, bystander):
        principal = Principal(issuer, subject)
        async with maker.begin() as session:  # no upstream account id
            await store_api_key(session, keys, principal, "sk_old_one")
        async with maker.begin() as session:  # chosen for a client
            row = await credentials.find(
                session, principal=principal, provider="demo", audience="mcp"
            )
            assert row is not None
            await credentials.choose_account(session, principal=principal, client_id="c", row=row)
        async with maker.begin() as session:  # granted again, now with its id: adopts the row
            await store_api_key(session, keys, principal, "sk_new_one", account_id="42")
    assert await count_of(db, AccountChoice, user) == 1

    erased = cli(
        "users", "erase", "--issuer", issuer, "--subject", user, config_path=broker.config_path
    )

    assert erased.returncode == 0, erased.stderr
    assert "connections=1 revocations_queued=0 account_choices=1 flows=0" in erased.stdout
    assert await count_of(db, AccountChoice, user) == 0
    assert await count_of(db, Connection, user) == 0
    assert await count_of(db, AccountChoice, bystander) == 1


async def test_a_choice_of_a_connection_removed_meanwhile_is_not_written(
    broker: BrokerProcess, db: AsyncEngine
) -> None:
    """A client's choice made while the connection is being removed (an erasure, a disconnect)
    would outlive the erasure of its user: the choice is written only if the connection is
    still there, after it (the order removals lock them in)."""
    principal = Principal(broker.config.issuer, fresh_user("choice-late"))
    keys = Keyring.parse(tuple(broker.config.encryption))
    maker = create_sessionmaker(db)
    async with maker.begin() as session:
        await store_api_key(session, keys, principal, "sk_soon_gone", account_id="7")
    async with maker.begin() as session:
        row = await credentials.find(session, principal=principal, provider="demo", audience="mcp")
        assert row is not None
    async with maker.begin() as session:
        assert await credentials.remove(session, row)

    async with maker.begin() as session:
        await credentials.choose_account(session, principal=principal, client_id="c", row=row)

    assert await count_of(db, AccountChoice, principal.subject) == 0


async def store_api_key(
    session: AsyncSession, keys: Keyring, principal: Principal, key: str, account_id: str = ""
) -> None:
    await credentials.store(
        session,
        keys=keys,
        principal=principal,
        provider="demo",
        audience="mcp",
        secret={"api_key": key},
        account_label="@octo",
        account_id=account_id,
    )


async def erasure_blocked(engine: AsyncEngine, backend: int | None, first_write: Any) -> None:
    """Until the erasure has sent its first writing statement and, on PostgreSQL, its backend
    (`backend`) waits on a lock."""
    await asyncio.wait_for(first_write.wait(), timeout=10)
    if backend is None:  # SQLite: the write waits for the completion's turn (app/sqlite_gate.py)
        return
    waiting = text("SELECT wait_event_type FROM pg_stat_activity WHERE pid = :pid")
    async with asyncio.timeout(10):
        while True:
            async with engine.connect() as connection:
                if await connection.scalar(waiting, {"pid": backend}) == "Lock":
                    return
            await asyncio.sleep(0.02)


async def test_erase_during_a_flow_completion_removes_the_connection_it_stores(
    broker: BrokerProcess,
) -> None:
    """A completion moves its flow to completed and stores the connection in one transaction.
    The erasure starting meanwhile waits for it (the flow's row lock on PostgreSQL, the write
    lock on SQLite), then removes the connection it stored, instead of deleting the flow only
    and leaving a usable credential with no revocation queued."""
    principal = Principal(broker.config.issuer, fresh_user("erase-race"))
    keys = Keyring.parse(tuple(broker.config.encryption))
    engine = create_engine(broker.database_url, pool_size=3)
    maker = create_sessionmaker(engine)
    now = utcnow()
    flow_id = secrets.token_hex(16)
    try:
        async with maker.begin() as session:
            session.add(
                Flow(
                    id=flow_id,
                    issuer=principal.issuer,
                    subject=principal.subject,
                    client_id="c",
                    provider="demo",
                    tool_name="t",
                    args_digest="d",
                    created_at=now,
                    updated_at=now,
                    expires_at=now + timedelta(minutes=10),
                )
            )
        async with maker() as completion, maker() as erasing:
            # the API-key form's transaction (app/pages/connect.py), not committed yet
            won = await flows.transition(
                completion,
                flow_id=flow_id,
                principal=principal,
                from_statuses=(FlowStatus.pending,),
                to_status=FlowStatus.completed,
                event="flow.completed",
                actor=Actor.user(principal),
            )
            assert won
            await store_api_key(completion, keys, principal, "sk_stored_meanwhile")
            backend = None
            if engine.dialect.name == "postgresql":
                backend = await erasing.scalar(text("SELECT pg_backend_pid()"))
            first_write = asyncio.Event()

            def note(_connection: Any, statement: Any, *_: Any) -> None:
                if getattr(statement, "is_dml", False):
                    first_write.set()

            # before the statement waits for its turn (the gate listens before_cursor_execute)
            event.listen(engine.sync_engine, "before_execute", note)

            async def erase() -> Erased:
                erased = await erase_user(
                    erasing, principal=principal, sealing=keys, providers={}, hold_days=0, actor=CLI
                )
                await erasing.commit()
                return erased

            erasure = asyncio.create_task(erase())
            await erasure_blocked(engine, backend, first_write)
            assert not erasure.done()
            await completion.commit()
            erased = await asyncio.wait_for(erasure, timeout=20)

        assert (erased.connections, erased.flows) == (1, 1)
        for model in (Connection, Flow):
            assert await count_of(engine, model, principal.subject) == 0
    finally:
        await engine.dispose()


def test_erase_needs_both_issuer_and_subject(broker: BrokerProcess) -> None:
    missing = cli("users", "erase", "--issuer", "x", config_path=broker.config_path)
    empty = cli("users", "erase", "--issuer", "", "--subject", "s", config_path=broker.config_path)

    assert missing.returncode == 2
    assert "--subject" in missing.stderr
    assert empty.returncode == 2
    assert "argument --issuer: must be 1 to 255 characters" in empty.stderr


async def test_the_session_broker_has_no_admin_api_without_a_token(broker: BrokerProcess) -> None:
    async with local_client(timeout=10) as http:
        response = await http.delete(
            f"{broker.url}/api/v1/admin/users",
            params={"issuer": broker.config.issuer, "subject": "someone"},
            headers={"Authorization": f"Bearer {ADMIN_TOKEN}"},
        )

    assert response.status_code == 404
    assert response.headers["content-type"] == PROBLEM


@pytest.fixture(scope="module")
def admin_broker(idp: IdpProcess, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    token_file = tmp_path_factory.mktemp("admin") / "admin_token"
    token_file.write_text(ADMIN_TOKEN + "\n")
    config = BrokerConfig(
        issuer=idp.issuer,
        providers={"demo": DEMO_PROVIDER},
        extra={"admin": {"token_file": str(token_file)}, "audit": {"erase_hold_days": 0}},
    )
    with running_broker(config, Path(token_file.parent), name="admin") as process:
        yield process


async def admin_delete(
    broker: BrokerProcess, params: dict[str, str], token: str | None = ADMIN_TOKEN
) -> httpx2.Response:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    async with local_client(timeout=10) as http:
        return await http.delete(f"{broker.url}/api/v1/admin/users", params=params, headers=headers)


async def test_the_admin_api_erases_a_user_with_the_token(
    admin_broker: BrokerProcess, idp: IdpProcess
) -> None:
    user = f"api-erase-{secrets.token_hex(4)}"
    who = {"issuer": admin_broker.config.issuer, "subject": user}
    mcp = McpHttp(admin_broker.mcp_url)
    try:
        token = mint_token(
            idp.signing_jwk, issuer=idp.issuer, audience=admin_broker.mcp_url, subject=user
        )
        await elicit(mcp, token, {"provider": "demo"})
    finally:
        await mcp.aclose()

    erased = await admin_delete(admin_broker, who)
    again = await admin_delete(admin_broker, who)

    assert erased.status_code == 200, erased.text
    assert erased.json() == {
        "connections": 0,
        "revocations_queued": 0,
        "account_choices": 0,
        "flows": 1,
        "sessions": 0,
        "audit_events": 1,  # flow.created: a hold of 0 days keeps nothing
    }
    assert again.json()["audit_events"] == 1  # the first erasure's own event
    assert ADMIN_TOKEN not in admin_broker.log()


@pytest.mark.parametrize(
    ("token", "params", "status", "code"),
    [
        (None, {"issuer": "i", "subject": "s"}, 401, "invalid_admin_token"),
        ("wrong-" + "b" * 40, {"issuer": "i", "subject": "s"}, 401, "invalid_admin_token"),
        (ADMIN_TOKEN, {"issuer": "i"}, 422, "invalid_request"),
        (ADMIN_TOKEN, {"issuer": "i", "subject": "s\x00"}, 422, "invalid_request"),
        (ADMIN_TOKEN, {"issuer": "i", "subject": "s" * 256}, 422, "invalid_request"),
    ],
)
async def test_the_admin_api_refuses_in_problem_json(
    admin_broker: BrokerProcess,
    token: str | None,
    params: dict[str, str],
    status: int,
    code: str,
) -> None:
    response = await admin_delete(admin_broker, params, token)

    assert response.status_code == status, response.text
    assert response.headers["content-type"] == PROBLEM
    assert response.json()["type"] == f"urn:connect-broker:error:{code}"
    if status == 401:
        assert response.headers["www-authenticate"].startswith("Bearer")
