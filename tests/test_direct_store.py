"""The direct store (app/direct/): the hot-path statements straight through asyncpg or sqlite3,
on the same tables SQLAlchemy reads and writes. Run on the suite's database kind
(`BROKER_TEST_DB`); the lock-waiting and group-commit cases are SQLite's own."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import secrets
import sqlite3
import subprocess
import sys
import threading
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import asyncpg
import pytest
from sqlalchemy import func, select, text, update
from sqlalchemy.dialects import sqlite
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from app import credentials
from app.auth.principal import McpCaller, Principal
from app.clock import utcnow
from app.connect import service as flows
from app.connect.service import MAX_OPEN_FLOWS, TooManyOpenFlows
from app.crypto import Keyring, generate_key
from app.db import create_engine, create_sessionmaker
from app.direct import (
    ConnectionRecord,
    DirectStore,
    NewFlow,
    StoreUnavailable,
    open_direct_store,
)
from app.direct import postgres as postgres_store
from app.direct import sqlite as sqlite_store
from app.direct.records import OPEN_CHECK_CHUNK, insert_values
from app.integration_api import services
from app.migrate import upgrade
from app.models import BROKER_AUDIENCE, OPEN_FLOW_STATUSES, AuditEvent, Flow, FlowStatus
from app.tables import connections as connections_table

from .support.broker import database_kind, drop_database, fresh_database

pytestmark = pytest.mark.both_databases

ISSUER = "https://idp.example"
KEYS = Keyring.parse((generate_key("k1"),))


@dataclass
class Database:
    url: str
    sessions: async_sessionmaker[AsyncSession]
    store: DirectStore


@contextlib.asynccontextmanager
async def migrated(url: str) -> AsyncIterator[Database]:
    """The schema built at `url`, with an ORM session maker and a direct store on it."""
    await asyncio.to_thread(upgrade, url)  # it runs its own event loop
    engine = create_engine(url, pool_size=2)
    store = open_direct_store(url, pool_size=2)
    try:
        yield Database(url, create_sessionmaker(engine), store)
    finally:
        await store.close()
        await engine.dispose()


@pytest.fixture
async def database(tmp_path: Path) -> AsyncIterator[Database]:
    url = await asyncio.to_thread(fresh_database, tmp_path, "direct")
    async with migrated(url) as opened:
        yield opened
    await asyncio.to_thread(drop_database, url)


def caller(subject: str, client_id: str = "c1") -> McpCaller:
    return McpCaller(principal=Principal(ISSUER, subject), client_id=client_id, scopes=frozenset())


async def start_flow(
    store: DirectStore,
    subject: str,
    ttl_seconds: int = 600,
    audience: str = BROKER_AUDIENCE,
    *,
    args_digest: str | None = None,
    client_id: str = "c1",
) -> flows.FlowView:
    """A round 1 of `subject`: a call of its own (arguments never seen before) unless
    `args_digest` is given."""
    return await flows.create(
        store,
        caller=caller(subject, client_id),
        client_name="Client",
        provider="demo",
        scopes=("repo",),
        tool_name="connect_account",
        args_digest=args_digest or secrets.token_hex(32),
        ttl_seconds=ttl_seconds,
        audience=audience,
    )


async def test_a_connection_stored_by_the_orm_is_found_with_its_fields(database: Database) -> None:
    alice = Principal(ISSUER, "alice")
    expires = utcnow() + timedelta(hours=1)
    async with database.sessions.begin() as session:
        await credentials.store(
            session,
            keys=KEYS,
            principal=alice,
            provider="demo",
            audience="mcp",
            secret={"api_key": "sk_direct_1"},
            scopes=frozenset({"b", "a"}),
            account_label="alice@demo",
            expires_at=expires,
        )

    found = await database.store.find_connection(ISSUER, "alice", "demo", "mcp")

    assert found is not None
    assert (found.provider, found.audience, found.status) == ("demo", "mcp", "active")
    assert (found.scopes, found.account_label, found.expires_at) == ("a b", "alice@demo", expires)
    assert credentials.open_row(found, keys=KEYS) == {"api_key": "sk_direct_1"}
    assert await database.store.find_connection(ISSUER, "alice", "demo", "svc") is None
    assert await database.store.find_connection(ISSUER, "bob", "demo", "mcp") is None


async def test_a_flow_written_directly_reads_the_same_through_the_orm_and_back(
    database: Database,
) -> None:
    created = await start_flow(database.store, "alice")
    async with database.sessions() as session:
        through_orm = await flows.get(session, flow_id=created.id)
    read = await flows.read_for(database.store, flow_id=created.id, principal=created.principal)

    assert read is not None
    direct = read.flow
    assert through_orm == direct
    assert direct.status == FlowStatus.pending
    assert direct.expires_at == created.expires_at  # microseconds and UTC survive both ways
    assert direct.scopes == ("repo",)
    assert direct.client_name == "Client"

    async with database.sessions.begin() as session:
        moved = await flows.transition(
            session,
            flow_id=created.id,
            principal=created.principal,
            from_statuses=(FlowStatus.pending,),
            to_status=FlowStatus.completed,
            account_label="alice@demo",
        )
    after = await flows.read_for(database.store, flow_id=created.id, principal=created.principal)

    assert moved
    assert after is not None
    assert (after.flow.status, after.flow.account_label) == (FlowStatus.completed, "alice@demo")


async def test_a_flow_is_read_with_its_owners_connection_for_its_provider_and_audience(
    database: Database,
) -> None:
    """What a retry of a finished flow uses instead of reading the connection again."""
    created = await start_flow(database.store, "alice")  # provider demo, audience mcp
    before = await flows.read_for(database.store, flow_id=created.id, principal=created.principal)
    assert before is not None and before.connection is None

    expires = utcnow() + timedelta(hours=1)
    async with database.sessions.begin() as session:
        for owner, provider, audience, key in (
            ("bob", "demo", "mcp", "sk_bob_1"),  # another user's
            ("alice", "other", "mcp", "sk_other_1"),  # another provider's
            ("alice", "demo", "svc", "sk_svc_1"),  # another audience's
        ):
            await credentials.store(
                session,
                keys=KEYS,
                principal=Principal(ISSUER, owner),
                provider=provider,
                audience=audience,
                secret={"api_key": key},
            )
    unrelated = await flows.read_for(
        database.store, flow_id=created.id, principal=created.principal
    )
    assert unrelated is not None and unrelated.connection is None

    async with database.sessions.begin() as session:
        await credentials.store(
            session,
            keys=KEYS,
            principal=created.principal,
            provider="demo",
            audience="mcp",
            secret={"api_key": "sk_alice_1"},
            scopes=frozenset({"repo"}),
            account_label="alice@demo",
            expires_at=expires,
        )
    read = await flows.read_for(database.store, flow_id=created.id, principal=created.principal)

    assert read is not None and read.connection is not None
    assert read.connection == await database.store.find_connection(ISSUER, "alice", "demo", "mcp")
    assert read.connection.expires_at == expires
    assert credentials.open_row(read.connection, keys=KEYS) == {"api_key": "sk_alice_1"}
    assert read.flow == before.flow


async def test_a_flow_is_not_read_for_another_principal_or_a_bad_id(database: Database) -> None:
    created = await start_flow(database.store, "alice")

    bob = Principal(ISSUER, "bob")
    assert await flows.read_for(database.store, flow_id=created.id, principal=bob) is None
    other_issuer = Principal("https://other.example", "alice")
    assert await flows.read_for(database.store, flow_id=created.id, principal=other_issuer) is None
    assert await flows.read_for(database.store, flow_id="x" * 65, principal=bob) is None
    assert await flows.read_for(database.store, flow_id="", principal=bob) is None


async def test_still_open_names_the_open_flows_among_any_number_of_ids(
    database: Database,
) -> None:
    opened = {
        status: (await start_flow(database.store, f"still-{status}")).id for status in FlowStatus
    }
    past_expiry = (await start_flow(database.store, "still-expired-pending", ttl_seconds=1)).id
    async with database.sessions.begin() as session:
        for status, flow_id in opened.items():
            await session.execute(update(Flow).where(Flow.id == flow_id).values(status=status))
        await session.execute(
            update(Flow)
            .where(Flow.id == past_expiry)
            .values(expires_at=utcnow() - timedelta(seconds=1))
        )
    unknown = [f"unknown-{n}" for n in range(2 * OPEN_CHECK_CHUNK + 1)]  # three statements
    asked = [
        *unknown[:OPEN_CHECK_CHUNK],
        *opened.values(),
        past_expiry,
        *unknown[OPEN_CHECK_CHUNK:],
    ]

    found = await database.store.still_open(asked)

    assert found == {opened[status] for status in OPEN_FLOW_STATUSES}
    assert await database.store.still_open([]) == set()


async def test_the_open_flow_cap_counts_every_open_status_and_only_unexpired_flows(
    database: Database,
) -> None:
    started = [await start_flow(database.store, "carol") for _ in range(MAX_OPEN_FLOWS)]
    async with database.sessions.begin() as session:  # an open flow further along still counts
        assert await flows.transition(
            session,
            flow_id=started[0].id,
            principal=started[0].principal,
            from_statuses=(FlowStatus.pending,),
            to_status=FlowStatus.authorizing,
        )

    with pytest.raises(TooManyOpenFlows):
        await start_flow(database.store, "carol")
    await start_flow(database.store, "dave")  # another user's flows do not count

    async with database.sessions.begin() as session:  # a finished flow frees a place
        assert await flows.end_by_client(
            session,
            flow_id=started[1].id,
            principal=started[1].principal,
            status=FlowStatus.declined,
        )
    await start_flow(database.store, "carol")
    with pytest.raises(TooManyOpenFlows):
        await start_flow(database.store, "carol")


async def test_the_open_flow_cap_is_per_audience(database: Database) -> None:
    """A sibling service that leaves a user's links open uses up its own places only."""
    for _ in range(MAX_OPEN_FLOWS):
        await start_flow(database.store, "fay", audience="sibling")
    with pytest.raises(TooManyOpenFlows):
        await start_flow(database.store, "fay", audience="sibling")

    mine = await start_flow(database.store, "fay")
    other = await start_flow(database.store, "fay", audience="another-sibling")

    assert (mine.audience, other.audience) == (BROKER_AUDIENCE, "another-sibling")


async def test_a_repeated_call_gets_its_open_flow_again(database: Database) -> None:
    """The same call (owner, client, audience, provider, scopes, tool, arguments) while its flow
    is open and lasts at least half as long as a new one: that flow, no new row, no new event."""
    first = await start_flow(database.store, "rae", args_digest="a" * 64)
    again = await start_flow(database.store, "rae", args_digest="a" * 64)
    async with database.sessions.begin() as session:  # one that ends too soon is not handed out
        await session.execute(
            update(Flow)
            .where(Flow.id == first.id)
            .values(expires_at=utcnow() + timedelta(seconds=200))
        )
    short = await start_flow(database.store, "rae", args_digest="a" * 64)

    assert again == first
    assert short.id != first.id
    async with database.sessions() as session:
        flows_made = await session.scalar(select(func.count()).where(Flow.subject == "rae"))
        events = await session.scalar(
            select(func.count()).where(
                AuditEvent.subject == "rae", AuditEvent.event == "flow.created"
            )
        )
    assert (flows_made, events) == (2, 2)


@pytest.mark.parametrize(
    "change",
    ["arguments", "client", "audience", "finished"],
)
async def test_another_call_or_a_finished_flow_gets_a_new_flow(
    change: str, database: Database
) -> None:
    first = await start_flow(database.store, "sol", args_digest="a" * 64)
    same: dict[str, Any] = {"args_digest": "a" * 64}
    if change == "arguments":
        same["args_digest"] = "b" * 64
    elif change == "client":
        same["client_id"] = "c2"
    elif change == "audience":
        same["audience"] = "sibling"
    else:
        async with database.sessions.begin() as session:
            assert await flows.end_by_client(
                session, flow_id=first.id, principal=first.principal, status=FlowStatus.declined
            )

    second = await start_flow(database.store, "sol", **same)

    assert second.id != first.id
    assert second.status == FlowStatus.pending


async def test_a_repeated_call_is_not_refused_at_the_cap(database: Database) -> None:
    """A call repeated by a user at the cap gets its own flow, and a new call is refused."""
    started = [await start_flow(database.store, "ugo") for _ in range(MAX_OPEN_FLOWS)]
    last = started[-1]

    again = await flows.create(
        database.store,
        caller=caller("ugo"),
        client_name="Client",
        provider="demo",
        scopes=("repo",),
        tool_name="connect_account",
        args_digest=await args_digest_of(database, last.id),
        ttl_seconds=600,
    )

    assert again.id == last.id
    with pytest.raises(TooManyOpenFlows):
        await start_flow(database.store, "ugo")


async def args_digest_of(database: Database, flow_id: str) -> str:
    async with database.sessions() as session:
        digest = await session.scalar(select(Flow.args_digest).where(Flow.id == flow_id))
    assert digest is not None
    return digest


async def test_expired_flows_do_not_count_against_the_cap(database: Database) -> None:
    for _ in range(MAX_OPEN_FLOWS):
        await start_flow(database.store, "erin", ttl_seconds=-1)

    fresh = await start_flow(database.store, "erin")

    assert fresh.status == FlowStatus.pending


async def test_a_state_digest_is_unique_and_flows_without_one_are_not_indexed(
    database: Database,
) -> None:
    first, second, third = [await start_flow(database.store, "sam") for _ in range(3)]
    async with database.sessions.begin() as session:
        await session.execute(update(Flow).where(Flow.id == first.id).values(state_digest="e" * 64))
    with pytest.raises(IntegrityError):
        async with database.sessions.begin() as session:
            await session.execute(
                update(Flow).where(Flow.id == second.id).values(state_digest="e" * 64)
            )

    async with database.sessions.begin() as session:
        if database.url.startswith("sqlite"):
            found = await session.execute(
                text("SELECT sql FROM sqlite_master WHERE name = 'uq_flows_state_digest'")
            )
        else:
            found = await session.execute(
                text("SELECT indexdef FROM pg_indexes WHERE indexname = 'uq_flows_state_digest'")
            )
        definition = found.scalar_one()
        with_digest = await session.execute(select(Flow.id).where(Flow.state_digest.is_not(None)))
    assert "UNIQUE" in definition.upper()
    assert "state_digest IS NOT NULL" in definition
    assert with_digest.scalars().all() == [first.id]
    assert third.status == FlowStatus.pending  # any number of flows without a digest


async def test_a_live_service_is_found_by_its_digest_and_a_revoked_one_is_not(
    database: Database,
) -> None:
    async with database.sessions.begin() as session:
        secret = await services.create(session, keys=KEYS, name="svc", providers=("github",))

    found = await services.authenticate(database.store, services.digests(KEYS, secret))
    assert found == services.Service(name="svc", providers=frozenset({"github"}))
    assert await services.authenticate(database.store, services.digests(KEYS, secret + "x")) is None

    async with database.sessions.begin() as session:
        assert await services.revoke(session, name="svc")
    assert await services.authenticate(database.store, services.digests(KEYS, secret)) is None


async def test_a_service_is_read_with_its_own_connection_only(database: Database) -> None:
    alice, bob = Principal(ISSUER, "alice"), Principal(ISSUER, "bob")
    expires = utcnow() + timedelta(hours=1)
    async with database.sessions.begin() as session:
        secret = await services.create(session, keys=KEYS, name="svc", providers=())
        for audience, key in (("svc", "sk_own_1"), ("mcp", "sk_broker_1")):
            await credentials.store(
                session,
                keys=KEYS,
                principal=alice,
                provider="demo",
                audience=audience,
                secret={"api_key": key},
                scopes=frozenset({"read"}),
                account_label="alice@demo",
                expires_at=expires,
            )
        await credentials.store(
            session,
            keys=KEYS,
            principal=bob,
            provider="demo",
            audience="mcp",  # bob's only connection belongs to another audience
            secret={"api_key": "sk_broker_2"},
            scopes=frozenset(),
            account_label=None,
            expires_at=None,
        )

    def read(
        secret: str, principal: Principal, provider: str = "demo"
    ) -> Awaitable[tuple[services.Service, ConnectionRecord | None] | None]:
        return services.authenticate_with_own_connection(
            database.store, services.digests(KEYS, secret), principal=principal, provider=provider
        )

    found = await read(secret, alice)
    assert found is not None
    service, own = found
    assert service == services.Service(name="svc", providers=frozenset())
    assert own is not None
    assert (own.issuer, own.subject, own.provider, own.audience) == (ISSUER, "alice", "demo", "svc")
    assert (own.status, own.scopes, own.account_label, own.expires_at) == (
        "active",
        "read",
        "alice@demo",
        expires,
    )
    assert credentials.open_row(own, keys=KEYS) == {"api_key": "sk_own_1"}
    assert own == await database.store.find_connection(ISSUER, "alice", "demo", "svc")

    assert await read(secret, bob) == (service, None)
    assert await read(secret, alice, provider="other") == (service, None)
    assert await read(secret + "x", alice) is None
    assert await read("not-a-service-secret", alice) is None
    async with database.sessions.begin() as session:
        assert await services.revoke(session, name="svc")
    assert await read(secret, alice) is None


async def test_concurrent_reads_each_get_their_own_row(database: Database) -> None:
    """Calls of one loop turn may share a statement (PostgreSQL): each still gets its own row."""
    async with database.sessions.begin() as session:
        secrets = {
            name: await services.create(session, keys=KEYS, name=name, providers=())
            for name in ("svc-a", "svc-b")
        }
        for subject, audience in (("kim", "mcp"), ("kim", "svc-a"), ("lee", "svc-b")):
            await credentials.store(
                session,
                keys=KEYS,
                principal=Principal(ISSUER, subject),
                provider="demo",
                audience=audience,
                secret={"api_key": f"sk_{subject}_{audience}"},
            )
    started = [await start_flow(database.store, subject) for subject in ("kim", "lee", "kim")]

    def key_of(row: ConnectionRecord | None) -> str | None:
        if row is None:
            return None
        secret = credentials.open_row(row, keys=KEYS)
        assert secret is not None
        return secret["api_key"]

    lookups = [("kim", "mcp"), ("lee", "mcp"), ("kim", "svc-a"), ("lee", "svc-b"), ("max", "mcp")]
    found = await asyncio.gather(
        *(database.store.find_connection(ISSUER, s, "demo", a) for s, a in lookups)
    )
    assert [key_of(row) for row in found] == [
        "sk_kim_mcp",
        None,
        "sk_kim_svc-a",
        "sk_lee_svc-b",
        None,
    ]

    reads = await asyncio.gather(
        *(database.store.get_flow_and_connection(flow.id) for flow in started),
        database.store.get_flow_and_connection("no-such-flow"),
    )
    assert [(read[0].id, read[0].subject) if read else None for read in reads] == [
        (started[0].id, "kim"),
        (started[1].id, "lee"),
        (started[2].id, "kim"),
        None,
    ]
    assert [key_of(read[1]) if read else None for read in reads] == [
        "sk_kim_mcp",
        None,
        "sk_kim_mcp",
        None,
    ]

    def fetch(
        secret: str, subject: str
    ) -> Awaitable[tuple[services.Service, ConnectionRecord | None] | None]:
        return services.authenticate_with_own_connection(
            database.store,
            services.digests(KEYS, secret),
            principal=Principal(ISSUER, subject),
            provider="demo",
        )

    fetched = await asyncio.gather(
        fetch(secrets["svc-a"], "kim"),
        fetch(secrets["svc-b"], "kim"),
        fetch(secrets["svc-b"], "lee"),
        fetch("not-a-service-secret", "lee"),
        fetch(secrets["svc-a"], "lee"),
    )
    assert [(got[0].name, key_of(got[1])) if got else None for got in fetched] == [
        ("svc-a", "sk_kim_svc-a"),
        ("svc-b", None),
        ("svc-b", "sk_lee_svc-b"),
        None,
        ("svc-a", None),
    ]


# Values one database or the other refuses to bind or store: a lone surrogate, a NUL.
POISON = ("bad\ud800", "bad\x00")


async def test_a_value_the_database_refuses_fails_only_its_own_call(database: Database) -> None:
    """The calls of one loop turn share a statement or a transaction: a value the database
    refuses in one of them must not fail the others (nor be reported as the store being down)."""
    async with database.sessions.begin() as session:
        secret = await services.create(session, keys=KEYS, name="svc-p", providers=())
        for subject in ("kim", "lee"):
            await credentials.store(
                session,
                keys=KEYS,
                principal=Principal(ISSUER, subject),
                provider="demo",
                audience="svc-p",
                secret={"api_key": f"sk_{subject}_poison"},
            )

    def refused_or_absent(outcome: object) -> bool:
        return outcome is None or (
            isinstance(outcome, Exception) and not isinstance(outcome, StoreUnavailable)
        )

    found = await asyncio.gather(
        database.store.find_connection(ISSUER, "kim", "demo", "svc-p"),
        *(database.store.find_connection(ISSUER, bad, "demo", "svc-p") for bad in POISON),
        database.store.find_connection(ISSUER, "lee", "demo", "svc-p"),
        return_exceptions=True,
    )
    assert [isinstance(row, ConnectionRecord) for row in (found[0], found[3])] == [True, True]
    assert all(refused_or_absent(outcome) for outcome in found[1:3])

    fetched = await asyncio.gather(
        *(
            services.authenticate_with_own_connection(
                database.store,
                services.digests(KEYS, secret),
                principal=Principal(ISSUER, subject),
                provider="demo",
            )
            for subject in ("kim", *POISON, "lee")
        ),
        return_exceptions=True,
    )
    assert [type(fetched[i]) for i in (0, 3)] == [tuple, tuple]
    assert all(refused_or_absent(outcome) or isinstance(outcome, tuple) for outcome in fetched)

    created = await asyncio.gather(
        start_flow(database.store, "kim"),
        *(start_flow(database.store, bad) for bad in POISON),
        start_flow(database.store, "lee"),
        return_exceptions=True,
    )
    assert [type(created[i]) for i in (0, 3)] == [flows.FlowView, flows.FlowView]
    reads = await asyncio.gather(
        *(database.store.get_flow_and_connection(created[i].id) for i in (0, 3))  # type: ignore[union-attr]
    )
    assert [read[0].subject if read else None for read in reads] == ["kim", "lee"]


async def test_the_open_flow_cap_holds_among_concurrent_inserts(database: Database) -> None:
    attempts = [
        *([("nina", BROKER_AUDIENCE)] * (MAX_OPEN_FLOWS + 5)),
        *([("nina", "sibling")] * 3),  # in the same batch, under another audience
        *([("omar", BROKER_AUDIENCE)] * 3),
    ]

    results = await asyncio.gather(
        *(start_flow(database.store, subject, audience=audience) for subject, audience in attempts),
        return_exceptions=True,
    )

    nina, others = results[: MAX_OPEN_FLOWS + 5], results[MAX_OPEN_FLOWS + 5 :]
    assert sum(isinstance(result, flows.FlowView) for result in nina) == MAX_OPEN_FLOWS
    assert sum(isinstance(result, TooManyOpenFlows) for result in nina) == 5
    assert all(isinstance(result, flows.FlowView) for result in others)
    for result in results:
        if isinstance(result, flows.FlowView):
            assert await flows.read_for(
                database.store, flow_id=result.id, principal=result.principal
            )


@pytest.fixture
async def postgresql_url(tmp_path: Path) -> AsyncIterator[str]:
    """A migrated PostgreSQL database, whichever kind the suite runs on (the pool is its own)."""
    url = await asyncio.to_thread(fresh_database, tmp_path, "pool", kind="postgresql")
    await asyncio.to_thread(upgrade, url)
    yield url
    await asyncio.to_thread(drop_database, url)


async def test_waiting_for_a_busy_postgresql_pool_is_bounded(
    postgresql_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(postgres_store, "POOL_TIMEOUT_SECONDS", 0.2)
    store = open_direct_store(postgresql_url, pool_size=1)
    try:
        assert await store.find_connection(ISSUER, "alice", "demo", "mcp") is None  # idle: taken
        assert isinstance(store, postgres_store.PostgresStore)
        holder = asyncio.create_task(store._run(lambda c: c.execute("SELECT pg_sleep(1)")))
        await asyncio.sleep(0.1)  # the only connection is now busy
        with pytest.raises(StoreUnavailable):
            await store.find_connection(ISSUER, "alice", "demo", "mcp")
        assert not holder.done()  # it gave up while the connection was still busy
        await holder
        assert await store.find_connection(ISSUER, "alice", "demo", "mcp") is None
    finally:
        await store.close()


def new_flow(flow_id: str, subject: str) -> NewFlow:
    now = utcnow()
    return NewFlow(
        id=flow_id,
        issuer=ISSUER,
        subject=subject,
        client_id="c1",
        client_name=None,
        audience="mcp",
        provider="demo",
        scopes="",
        tool_name="connect_account",
        args_digest="d" * 64,
        created_at=now,
        expires_at=now + timedelta(minutes=10),
    )


async def test_postgresql_sends_the_calls_of_one_loop_turn_as_one_statement(
    postgresql_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = open_direct_store(postgresql_url, pool_size=2)
    assert isinstance(store, postgres_store.PostgresStore)
    statements: list[str] = []

    async def counting_fetch(connection: Any, query: str, *args: Any) -> Any:
        statements.append(query)
        return await original_fetch(connection, query, *args)

    original_fetch = asyncpg.Connection.fetch
    monkeypatch.setattr(asyncpg.Connection, "fetch", counting_fetch)
    try:
        inserted = await asyncio.gather(
            *(store.insert_flow(new_flow(f"flow-{i}", f"u{i}"), max_open=20) for i in range(8))
        )
        flows, connections = await asyncio.gather(  # one gather: all 16 in the same turn
            asyncio.gather(*(store.get_flow_and_connection(f"flow-{i}") for i in range(8))),
            asyncio.gather(
                *(store.find_connection(ISSUER, f"u{i}", "demo", "mcp") for i in range(8))
            ),
        )
    finally:
        await store.close()

    assert inserted == [True] * 8
    assert [item[0].id if item else None for item in flows] == [f"flow-{i}" for i in range(8)]
    assert connections == [None] * 8
    assert statements == [
        postgres_store.INSERT_FLOWS.sql,
        postgres_store.GET_FLOWS_AND_CONNECTIONS.sql,
        postgres_store.FIND_CONNECTIONS.sql,
    ]


async def test_postgresql_fails_only_the_insert_at_fault_in_its_batch(postgresql_url: str) -> None:
    """Flow ids are 256-bit random, so a duplicate is a bug. It makes PostgreSQL refuse the whole
    batch's statement, which writes nothing; each insert is then tried alone, and only the
    duplicate fails."""
    store = open_direct_store(postgresql_url, pool_size=2)
    try:
        results = await asyncio.gather(
            store.insert_flow(new_flow("same-id", "pat"), max_open=20),
            store.insert_flow(new_flow("same-id", "quin"), max_open=20),
            store.insert_flow(new_flow("other-id", "rae"), max_open=20),
            return_exceptions=True,
        )
        assert results[0] is True
        assert isinstance(results[1], asyncpg.UniqueViolationError)
        assert results[2] is True
        same = await store.get_flow_and_connection("same-id")
        assert same is not None and same[0].subject == "pat"
        assert await store.get_flow_and_connection("other-id") is not None
    finally:
        await store.close()


async def test_an_unreachable_database_is_store_unavailable(tmp_path: Path) -> None:
    if database_kind() == "sqlite":
        url = f"sqlite:///{tmp_path / 'missing-dir' / 'broker.db'}"
    else:
        url = "postgresql://postgres@127.0.0.1:1/nothing"  # nothing listens on port 1
    store = open_direct_store(url, pool_size=1)
    try:
        with pytest.raises(StoreUnavailable):
            await store.find_connection(ISSUER, "alice", "demo", "mcp")
    finally:
        await store.close()


# ------------------------------------------------------------------------------------------------
# SQLite: the event loop never waits for the write lock, and inserts are group-committed
# ------------------------------------------------------------------------------------------------

# (whatever database the suite runs on: these are SQLite's own behaviours)


@pytest.fixture
async def sqlite_database(tmp_path: Path) -> AsyncIterator[Database]:
    async with migrated(f"sqlite:///{tmp_path / 'direct.db'}") as opened:
        yield opened


def sqlite_path(url: str) -> str:
    return url.removeprefix("sqlite:///")


def test_the_open_flow_cap_is_counted_from_the_owner_index_alone(sqlite_database: Database) -> None:
    """Every round 1 inserts a flow after counting the user's open ones, and looking among them
    for one of the same call: the count must not read a table row per flow, and the look reads
    the rows of the user's open flows for the audience only (at most the cap's)."""
    insert = sqlite_store.INSERT_FLOW
    values = insert.values(dict.fromkeys(insert_values(new_flow("f", "u"), 20, str), "x"))
    with contextlib.closing(sqlite3.connect(sqlite_path(sqlite_database.url))) as connection:
        plan = connection.execute("EXPLAIN QUERY PLAN " + insert.sql, values)
        details = [row[3] for row in plan.fetchall()]
    searches = [detail for detail in details if detail.startswith(("SEARCH flows", "SCAN flows"))]
    owner_open = (
        "ix_flows_owner_open (issuer=? AND subject=? AND audience=? AND status=? AND expires_at>?)"
    )
    assert searches == [
        f"SEARCH flows USING COVERING INDEX {owner_open}",
        f"SEARCH flows USING INDEX {owner_open}",
    ], details


def test_a_connection_of_an_account_is_found_from_an_index(
    sqlite_database: Database,
) -> None:
    """Every revocation asks whether a connection holds its upstream account (how far it may
    reach): that must not read the whole table."""
    statement = connections_table.holds_account("github", "123")
    sql = str(statement.compile(dialect=sqlite.dialect(), compile_kwargs={"literal_binds": True}))
    with contextlib.closing(sqlite3.connect(sqlite_path(sqlite_database.url))) as connection:
        details = [row[3] for row in connection.execute("EXPLAIN QUERY PLAN " + sql)]
    assert (
        "SEARCH connections USING COVERING INDEX ix_connections_provider_account "
        "(provider=? AND account_id=?)"
    ) in details, details


async def test_an_insert_waits_for_a_held_write_lock_off_the_event_loop(
    sqlite_database: Database,
) -> None:
    holder = sqlite3.connect(sqlite_path(sqlite_database.url), isolation_level=None)
    holder.execute("BEGIN IMMEDIATE")  # another writer (say, the CLI) holds the lock
    ticks = 0

    async def tick() -> None:
        nonlocal ticks
        while True:
            ticks += 1
            await asyncio.sleep(0.01)

    ticker = asyncio.create_task(tick())
    insert = asyncio.create_task(start_flow(sqlite_database.store, "frank"))
    await asyncio.sleep(0.3)
    assert not insert.done()  # still waiting for the lock…
    ticks_while_locked = ticks
    holder.execute("COMMIT")
    holder.close()
    created = await asyncio.wait_for(insert, 5)
    ticker.cancel()

    assert ticks_while_locked >= 10  # …while the event loop kept running
    assert await flows.read_for(
        sqlite_database.store, flow_id=created.id, principal=created.principal
    )


async def test_inserts_of_one_loop_turn_share_one_commit(
    sqlite_database: Database, monkeypatch: pytest.MonkeyPatch
) -> None:
    batches: list[int] = []
    apply = sqlite_store._apply

    def counting(connection: sqlite3.Connection, writes: list[sqlite_store._Statement]) -> object:
        batches.append(len(writes))
        return apply(connection, writes)

    monkeypatch.setattr(sqlite_store, "_apply", counting)

    created = await asyncio.gather(*(start_flow(sqlite_database.store, f"g{i}") for i in range(32)))

    assert batches == [32]
    for flow in created:
        assert await flows.read_for(
            sqlite_database.store, flow_id=flow.id, principal=flow.principal
        )


async def test_reads_of_one_loop_turn_share_one_read_transaction(
    sqlite_database: Database, monkeypatch: pytest.MonkeyPatch
) -> None:
    batches: list[int] = []
    read_all = sqlite_store._read_all

    def counting(connection: sqlite3.Connection, reads: list[sqlite_store._Statement]) -> object:
        batches.append(len(reads))
        return read_all(connection, reads)

    monkeypatch.setattr(sqlite_store, "_read_all", counting)
    store = sqlite_database.store
    started = await start_flow(sqlite_database.store, "nina")

    flow, connection, service = await asyncio.gather(
        store.get_flow_and_connection(started.id),
        store.find_connection(ISSUER, "nina", "demo", "mcp"),
        store.find_service(["no-such-digest"]),
    )

    assert batches == [3]
    assert flow is not None
    assert flow[0].id == started.id
    assert (connection, service) == (None, None)


def test_a_batch_of_reads_runs_in_one_transaction_and_leaves_none_open_on_error(
    sqlite_database: Database,
) -> None:
    def statement(sql: str) -> sqlite_store._Statement:
        return sqlite_store._Statement(sql, ())

    with contextlib.closing(
        sqlite3.connect(sqlite_path(sqlite_database.url), isolation_level=None)
    ) as connection:
        traced: list[str] = []
        connection.set_trace_callback(traced.append)
        rows = sqlite_store._read_all(
            connection, [statement("SELECT count(*) FROM flows"), statement("SELECT 2")]
        )
        assert rows == [(0,), (2,)]
        assert traced == ["BEGIN", "SELECT count(*) FROM flows", "SELECT 2", "COMMIT"]

        with pytest.raises(sqlite3.OperationalError, match="no such table"):
            sqlite_store._read_all(
                connection, [statement("SELECT 1"), statement("SELECT * FROM no_such_table")]
            )
        assert not connection.in_transaction
        assert sqlite_store._read_all(connection, [statement("SELECT 3")]) == [(3,)]


async def test_a_failing_insert_fails_alone_in_its_batch(sqlite_database: Database) -> None:
    results = await asyncio.gather(
        sqlite_database.store.insert_flow(new_flow("same-id", "hank"), max_open=20),
        sqlite_database.store.insert_flow(new_flow("same-id", "ivan"), max_open=20),
        sqlite_database.store.insert_flow(new_flow("other-id", "judy"), max_open=20),
        return_exceptions=True,
    )

    assert results[0] is True
    assert isinstance(results[1], sqlite3.IntegrityError)
    assert results[2] is True
    judy = await sqlite_database.store.get_flow_and_connection("other-id")
    assert judy is not None
    assert judy[0].subject == "judy"


async def test_a_flow_whose_event_is_refused_is_not_stored_and_fails_alone(
    sqlite_database: Database,
) -> None:
    """A flow and its `flow.created` event are one change: when the event's insert fails, the
    flow must not stay behind without it, and the other flows of the same commit still land."""
    with contextlib.closing(sqlite3.connect(sqlite_path(sqlite_database.url))) as connection:
        connection.execute(
            "CREATE TRIGGER refuse_poison BEFORE INSERT ON audit_events "
            "WHEN NEW.request_id = 'poison' BEGIN SELECT RAISE(ABORT, 'refused'); END"
        )
        connection.commit()
    poisoned = dataclasses.replace(new_flow("poisoned", "kate"), request_id="poison")

    results = await asyncio.gather(
        sqlite_database.store.insert_flow(new_flow("before", "hank"), max_open=20),
        sqlite_database.store.insert_flow(poisoned, max_open=20),
        sqlite_database.store.insert_flow(new_flow("after", "judy"), max_open=20),
        return_exceptions=True,
    )

    assert results[0] is True and results[2] is True
    assert isinstance(results[1], sqlite3.IntegrityError)
    assert await sqlite_database.store.get_flow_and_connection("poisoned") is None
    async with sqlite_database.sessions() as session:
        events = await session.execute(text("SELECT subject FROM audit_events ORDER BY subject"))
        assert events.scalars().all() == ["hank", "judy"]


async def test_the_wal_is_checkpointed_off_the_event_loop_after_writes(
    sqlite_database: Database, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A checkpoint syncs the database file: the loop's connection never runs one itself."""
    monkeypatch.setattr(sqlite_store, "CHECKPOINT_DELAY_SECONDS", 0.05)
    threads: list[str] = []
    checkpoint = sqlite_store.SqliteStore._checkpoint_wal

    def recording(store: sqlite_store.SqliteStore) -> None:
        threads.append(threading.current_thread().name)
        checkpoint(store)

    monkeypatch.setattr(sqlite_store.SqliteStore, "_checkpoint_wal", recording)

    await asyncio.gather(*(start_flow(sqlite_database.store, f"k{i}") for i in range(3)))
    await asyncio.sleep(0.3)

    assert len(threads) == 1
    assert threads[0].startswith("sqlite-wait")
    store = sqlite_database.store
    assert isinstance(store, sqlite_store.SqliteStore)
    loop_connection = store._on_loop()
    assert loop_connection.execute("PRAGMA wal_autocheckpoint").fetchone() == (0,)


def wal_header(path: str) -> tuple[int, int]:
    """The WAL file's size and its checkpoint sequence number, which counts how often SQLite
    has started the file over (bytes 12-15 of the WAL header, big-endian)."""
    with open(path + "-wal", "rb") as wal:
        header = wal.read(16)
    return Path(path + "-wal").stat().st_size, int.from_bytes(header[12:16], "big")


async def test_a_flood_of_new_flows_keeps_the_wal_file_bounded(
    sqlite_database: Database, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Writes that never pause: each checkpoint has a commit beside it, so SQLite could never start
    the WAL over by itself (it grew without end). The store's second checkpoint, in its write turn,
    lets it: the file starts over again and again and is cut back to the limit."""
    limit = 256 * 1024
    monkeypatch.setattr(sqlite_store, "CHECKPOINT_DELAY_SECONDS", 0.05)
    monkeypatch.setattr(sqlite_store, "WAL_LIMIT_BYTES", limit)
    store = open_direct_store(sqlite_database.url, pool_size=1)  # opened with the lower limit
    path = sqlite_path(sqlite_database.url)
    flood_ends = asyncio.get_running_loop().time() + 3.0
    written = 0

    async def writer(number: int) -> None:
        nonlocal written
        while asyncio.get_running_loop().time() < flood_ends:
            assert await store.insert_flow(
                new_flow(f"w{number}-{written}", f"u{number}-{written}"), max_open=20
            )
            written += 1

    try:
        await asyncio.gather(*(writer(number) for number in range(16)))
        _, restarts = wal_header(path)
        await asyncio.sleep(0.3)  # the flood is over: a checkpoint copies the rest
        assert await store.insert_flow(new_flow("after", "after-the-flood"), max_open=20)
        size_after, _ = wal_header(path)
    finally:
        await store.close()

    assert written > 2000, written  # a flood: far more than the limit's worth of WAL frames
    assert restarts >= 3, restarts  # started over during the flood, again and again
    assert size_after <= limit, size_after  # and cut back to the limit when it starts over


LEAVE_WAL_MODE = """
import sqlite3, sys
connection = sqlite3.connect(sys.argv[1], timeout=0)
try:
    print(connection.execute("PRAGMA journal_mode = DELETE").fetchone()[0])
except sqlite3.OperationalError as exc:
    print(exc)
"""


def another_process_leaving_wal_mode(path: str) -> str:
    """What another process gets when it tries to take the database out of WAL mode: SQLite
    refuses while any connection (holding its shared lock on the file) is open."""
    done = subprocess.run(
        [sys.executable, "-c", LEAVE_WAL_MODE, path],
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    )
    return done.stdout.strip()


async def test_syncing_the_files_for_the_wal_bound_keeps_sqlite_s_locks(
    sqlite_database: Database,
) -> None:
    """Closing any descriptor of a file drops all the process's POSIX locks on it, SQLite's own
    included: after the store syncs the files (more than once), another process must still find
    the database locked."""
    store = sqlite_database.store
    assert isinstance(store, sqlite_store.SqliteStore)
    flow = await start_flow(store, "lock-holder")  # the store's connection is open, in WAL mode
    path = sqlite_path(sqlite_database.url)
    assert another_process_leaving_wal_mode(path) == "database is locked"

    store._sync_files()
    store._sync_files()

    assert another_process_leaving_wal_mode(path) == "database is locked"
    assert await flows.read_for(store, flow_id=flow.id, principal=flow.principal)


async def test_a_file_that_is_not_a_database_is_store_unavailable(tmp_path: Path) -> None:
    """What a replaced or corrupted file gives reads and writes: a 503, not a 500."""
    path = tmp_path / "broker.db"
    path.write_bytes(b"this is not a database" * 100)
    store = open_direct_store(f"sqlite:///{path}", pool_size=1)
    try:
        with pytest.raises(StoreUnavailable):
            await store.get_flow_and_connection("some-flow")
        with pytest.raises(StoreUnavailable):
            await start_flow(store, "leo")
    finally:
        await store.close()
