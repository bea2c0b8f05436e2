"""How far a revocation reaches, decided when it is made (app/connect/revocations.py `reach`).

At a provider whose revocation of any token ends the user's whole grant (RFC 7009 at Google), a
token of an upstream account that another connection still holds must not be revoked: the other
connection would stop working at its next refresh. GitHub tells a token from the grant, so there
the token alone is revoked while the account is held, and the grant once it is not. The
providers are fakes at the HTTP boundary (httpx's MockTransport) that record what they were
asked; the broker's side (disconnect, queue, sweep, discard) is the real code on a real database.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from urllib.parse import parse_qs

import httpx2
import pytest
from sqlalchemy import select, update
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from app import credentials
from app.audit import Actor
from app.auth.principal import Principal
from app.clock import utcnow
from app.connect.disconnect import Disconnected, disconnect
from app.connect.removal import remove_connection
from app.connect.revocations import Issued, Reach, Revoker
from app.crypto import Keyring, generate_key
from app.db import create_engine, create_sessionmaker
from app.migrate import upgrade
from app.models import NO_ACCOUNT_ID, AuditEvent, Connection, PendingRevocation
from app.providers import oauth
from app.providers.settings import OAuthProviderSettings

from ..support.broker import drop_database, fresh_database
from .helpers import security_log

pytestmark = pytest.mark.both_databases

ALICE = Principal("https://idp.example", "alice")
BOB = Principal("https://idp.example", "bob")
KEYS = Keyring.parse((generate_key("k1"),))
ACCOUNT = "upstream-42"
# revokes by RFC 7009: revoking any token may end the whole grant (the broker assumes it does)
GOOGLISH = OAuthProviderSettings(
    kind="oauth2",
    display_name="Googlish",
    client_id="broker-googlish",
    client_secret="googlish-client-secret",
    authorize_url="https://googlish.test/authorize",
    token_url="https://googlish.test/token",
    revocation_url="https://googlish.test/revoke",
)
GITHUB = OAuthProviderSettings(
    kind="oauth2",
    display_name="GitHub",
    client_id="broker-gh",
    client_secret="gh-client-secret",
    authorize_url="https://gh.test/login/oauth/authorize",
    token_url="https://gh.test/login/oauth/access_token",
    api_base_url="https://api.gh.test",
    revocation="github",
)
PROVIDERS = {"googlish": GOOGLISH, "github": GITHUB}


@dataclass
class Upstream:
    """Both providers: each request that revokes is recorded as (provider, what, token); while
    `failing`, each is answered 503 (and still recorded)."""

    asked: list[tuple[str, str, str]] = field(default_factory=list)
    failing: bool = False

    async def handle(self, request: httpx2.Request) -> httpx2.Response:
        body = (await request.aread()).decode()
        status = 503 if self.failing else 200
        if request.url.host == "googlish.test":
            token = parse_qs(body)["token"][0]
            self.asked.append(("googlish", "token", token))
        else:  # DELETE /applications/{client_id}/grant or …/token
            what = request.url.path.rsplit("/", 1)[1]
            self.asked.append(("github", what, json.loads(body)["access_token"]))
        # read as it arrives, as the broker does
        return httpx2.Response(status, stream=httpx2.ByteStream(b""))


@dataclass
class Broker:
    sessions: async_sessionmaker[AsyncSession]
    upstream: Upstream
    revoker: Revoker

    async def connect(
        self, who: Principal, provider: str, audience: str, token: str, account_id: str = ACCOUNT
    ) -> None:
        """`who` holds the upstream account `account_id` through `audience`, with `token`."""
        async with self.sessions.begin() as session:
            await credentials.store(
                session,
                keys=KEYS,
                principal=who,
                provider=provider,
                audience=audience,
                secret={"access_token": token, "refresh_token": f"r-{token}"},
                account_label="someone@example.com",
                account_id=account_id,
                expires_at=utcnow() + timedelta(hours=1),
            )

    async def disconnect(self, who: Principal, provider: str, audience: str) -> Disconnected:
        async with self.sessions() as session:
            return await disconnect(
                session,
                self.revoker,
                principal=who,
                provider=provider,
                audience=audience,
                actor=Actor.user(who),
            )

    async def remove_queued(self, who: Principal, provider: str, audience: str) -> None:
        """An operator's removal: the revocation is queued, due at once, for the sweep."""
        async with self.sessions.begin() as session:
            statement = select(Connection).where(
                Connection.subject == who.subject,
                Connection.provider == provider,
                Connection.audience == audience,
            )
            row = (await session.execute(statement)).scalar_one()
            await remove_connection(
                session,
                row,
                sealing=KEYS,
                providers=PROVIDERS,
                actor=Actor.operator("cli"),
                event="connection.revoked",
            )

    async def events(self, name: str) -> list[str | None]:
        async with self.sessions() as session:
            rows = await session.execute(select(AuditEvent.detail).where(AuditEvent.event == name))
            return list(rows.scalars())

    async def queued(self) -> int:
        async with self.sessions() as session:
            return len((await session.execute(select(PendingRevocation.id))).all())


@pytest.fixture
async def broker(tmp_path: Path) -> AsyncIterator[Broker]:
    url = await asyncio.to_thread(fresh_database, tmp_path, "revocation-reach")
    await asyncio.to_thread(upgrade, url)
    engine = create_engine(url, pool_size=3)
    upstream = Upstream()
    async with httpx2.AsyncClient(transport=httpx2.MockTransport(upstream.handle)) as http:
        sessions = create_sessionmaker(engine)
        revoker = Revoker(
            providers=PROVIDERS,
            http=http,
            sealing=KEYS,
            sessionmaker=sessions,
            security=security_log(),
        )
        yield Broker(sessions, upstream, revoker)
    await engine.dispose()
    await asyncio.to_thread(drop_database, url)


async def test_a_disconnect_leaves_alone_a_grant_another_connection_holds(broker: Broker) -> None:
    """Alice holds one upstream account through her MCP client and a sibling service: revoking
    the token she disconnects would end the sibling's grant too. It is not revoked, and the
    audit says why; the last connection of the account revokes it."""
    await broker.connect(ALICE, "googlish", "mcp", "t-mcp")
    await broker.connect(ALICE, "googlish", "svc", "t-svc")

    first = await broker.disconnect(ALICE, "googlish", "mcp")

    assert first.existed and not first.revoked_upstream and not first.upstream_failed
    assert broker.upstream.asked == []
    assert await broker.queued() == 0
    assert await broker.events("revocation.skipped") == ["attempts=1 reason=account_held_elsewhere"]

    last = await broker.disconnect(ALICE, "googlish", "svc")

    assert last.revoked_upstream
    assert broker.upstream.asked == [("googlish", "token", "r-t-svc")]
    assert await broker.events("revocation.confirmed") == ["attempts=1"]


async def test_another_users_connection_of_the_account_keeps_its_grant_too(
    broker: Broker,
) -> None:
    await broker.connect(ALICE, "googlish", "mcp", "t-alice")
    await broker.connect(BOB, "googlish", "mcp", "t-bob")

    await broker.disconnect(BOB, "googlish", "mcp")

    assert broker.upstream.asked == []


async def test_revocations_queued_while_the_account_was_shared_are_made_once_it_is_not(
    broker: Broker,
) -> None:
    """Both connections of the account removed before either revocation is made (two
    concurrent disconnects, an erasure): each attempt sees no holder left, so neither is lost
    because the other connection existed when it was queued."""
    await broker.connect(ALICE, "googlish", "mcp", "t-mcp")
    await broker.connect(ALICE, "googlish", "svc", "t-svc")
    await broker.remove_queued(ALICE, "googlish", "mcp")
    await broker.remove_queued(ALICE, "googlish", "svc")

    assert await broker.revoker.sweep() == 2

    assert sorted(broker.upstream.asked) == [
        ("googlish", "token", "r-t-mcp"),
        ("googlish", "token", "r-t-svc"),
    ]
    assert await broker.queued() == 0


async def test_at_github_a_grant_queued_whole_revokes_the_token_alone_once_the_account_is_held(
    broker: Broker,
) -> None:
    """Queued as the account's last connection, then the account connected again (through
    another service) before the attempt: GitHub's grant revocation would end the new
    connection, so the attempt revokes the queued token alone."""
    await broker.connect(ALICE, "github", "mcp", "gho-old")
    await broker.remove_queued(ALICE, "github", "mcp")
    await broker.connect(ALICE, "github", "svc", "gho-new")

    await broker.revoker.sweep()

    assert broker.upstream.asked == [("github", "token", "gho-old")]


async def test_at_github_the_account_s_last_connection_revokes_the_whole_grant(
    broker: Broker,
) -> None:
    await broker.connect(ALICE, "github", "mcp", "gho-only")

    outcome = await broker.disconnect(ALICE, "github", "mcp")

    assert outcome.revoked_upstream
    assert broker.upstream.asked == [("github", "grant", "gho-only")]


async def test_a_connection_made_before_accounts_were_told_apart_revokes_its_token(
    broker: Broker,
) -> None:
    await broker.connect(ALICE, "googlish", "mcp", "t-legacy", account_id=NO_ACCOUNT_ID)
    await broker.connect(ALICE, "googlish", "svc", "t-other")

    await broker.disconnect(ALICE, "googlish", "mcp")

    assert broker.upstream.asked == [("googlish", "token", "r-t-legacy")]


TOKENS = oauth.TokenSet(
    access_token="t-discarded",
    refresh_token="r-t-discarded",
    expires_at=None,
    scopes=frozenset(),
    extra={},
)


@pytest.mark.parametrize(
    ("provider", "account_id", "held", "asked"),
    [
        # the account is free: the discarded grant is nobody's, and is ended
        ("googlish", ACCOUNT, False, [("googlish", "token", "r-t-discarded")]),
        # a connection holds the account: revoking would end its grant
        ("googlish", ACCOUNT, True, []),
        # never identified (ID token refused): it may be the account a connection holds
        ("googlish", None, False, []),
        # GitHub revokes the token alone, whoever holds the account
        ("github", None, True, [("github", "token", "t-discarded")]),
        ("github", ACCOUNT, True, [("github", "token", "t-discarded")]),
    ],
)
async def test_tokens_the_broker_will_not_keep_are_revoked_only_where_that_ends_no_connection(
    broker: Broker,
    provider: str,
    account_id: str | None,
    held: bool,
    asked: list[tuple[str, str, str]],
) -> None:
    if held:
        await broker.connect(ALICE, provider, "mcp", "t-held")

    issued = Issued(ALICE, provider, "mcp", account_id)
    await broker.revoker.discard(issued, TOKENS, why="flow_moved_on", about="flow_id=f1")

    assert broker.upstream.asked == asked


async def test_reach_is_read_from_the_connections_now(broker: Broker) -> None:
    assert await broker.revoker.reach(GOOGLISH, "googlish", ACCOUNT) is Reach.GRANT
    await broker.connect(ALICE, "googlish", "mcp", "t-1")
    assert await broker.revoker.reach(GOOGLISH, "googlish", ACCOUNT) is Reach.NOTHING
    assert await broker.revoker.reach(GOOGLISH, "googlish", "another") is Reach.GRANT
    assert await broker.revoker.reach(GOOGLISH, "googlish", NO_ACCOUNT_ID) is Reach.TOKEN
    await broker.connect(ALICE, "github", "mcp", "gho-1")
    assert await broker.revoker.reach(GITHUB, "github", ACCOUNT) is Reach.TOKEN


async def test_a_revocation_queued_before_revocations_named_their_account_is_made_as_queued(
    broker: Broker,
) -> None:
    """A row from before migration 0013 names no account; it keeps the reach it was queued with
    (here GitHub's whole grant, decided then)."""
    await broker.connect(ALICE, "github", "mcp", "gho-queued-long-ago")
    await broker.remove_queued(ALICE, "github", "mcp")
    async with broker.sessions.begin() as session:
        await session.execute(
            update(PendingRevocation).values(account_id=NO_ACCOUNT_ID, whole_grant=True)
        )
    await broker.connect(BOB, "github", "mcp", "gho-bob")  # not looked for: the row names none

    await broker.revoker.sweep()

    assert broker.upstream.asked == [("github", "grant", "gho-queued-long-ago")]


async def test_a_discarded_token_the_provider_did_not_revoke_is_queued_and_revoked_later(
    broker: Broker,
) -> None:
    """GitHub tokens never expire: a discarded one whose revocation failed stayed valid with
    nobody holding it. It is queued, sealed, and the sweep revokes it once GitHub answers."""
    broker.upstream.failing = True
    issued = Issued(ALICE, "github", "mcp", ACCOUNT)

    await broker.revoker.discard(issued, TOKENS, why="flow_moved_on", about="flow_id=f2")

    async with broker.sessions() as session:
        queued = (await session.execute(select(PendingRevocation))).scalar_one()
    assert (queued.attempts, queued.last_error) == (1, "revocation_status_503")
    assert (queued.account_id, queued.whole_grant) == (ACCOUNT, False)
    assert "t-discarded" not in queued.sealed_credential
    async with broker.sessions.begin() as session:  # its retry is due
        await session.execute(update(PendingRevocation).values(next_attempt_at=utcnow()))
    broker.upstream.failing = False

    assert await broker.revoker.sweep() == 1

    assert broker.upstream.asked == [("github", "token", "t-discarded")] * 2
    assert await broker.queued() == 0
    assert await broker.events("revocation.confirmed") == ["attempts=2"]
