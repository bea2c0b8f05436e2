"""A refresh meets the rest of a connection's life while its provider answers: a key rotation,
a disconnect, an outage, an answer without a lifetime. The provider is a fake at the HTTP
boundary (httpx's MockTransport) that rotates refresh tokens and knows which ones still work;
everything on the broker's side (refresh, disconnect, revocation, key rotation) is the real code
on a real database."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs

import httpx2
import pytest
from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from app import credentials
from app.audit import Actor
from app.auth.jwks import ProviderIssuers
from app.auth.principal import Principal
from app.clock import utcnow
from app.connect.disconnect import disconnect
from app.connect.notify import FlowNotifier
from app.connect.oauth_service import OAuthGrants
from app.connect.refresh import (
    MAX_LIFETIME,
    MIN_LIFETIME,
    RefreshUnavailable,
    UsableCredentials,
    _RowLocks,
)
from app.connect.revocations import Revoker
from app.credentials import Credential
from app.crypto import Keyring, Keys, generate_key
from app.db import create_engine, create_sessionmaker
from app.migrate import upgrade
from app.models import NO_ACCOUNT_ID, Connection, ConnectionStatus
from app.providers.settings import OAuthProviderSettings
from app.security_log import SecurityLog

from ..support.broker import database_kind, drop_database, fresh_database
from .helpers import security_log

pytestmark = pytest.mark.both_databases

ALICE = Principal("https://idp.example", "alice")
OLD_KEY, NEW_KEY = generate_key("k-old"), generate_key("k-new")
PROVIDER = "acme"
SETTINGS = OAuthProviderSettings(
    kind="oauth2",
    display_name="Acme",
    client_id="broker-acme",
    client_secret="acme-client-secret",
    authorize_url="https://acme.test/authorize",
    token_url="https://acme.test/token",
    revocation_url="https://acme.test/revoke",
)
WAIT = 10.0


class Acme:
    """The provider: a refresh spends its refresh token and issues the next pair; a revocation
    ends the token sent. `live` holds the refresh tokens that still work. While `held`, the
    token endpoint waits for `release`."""

    def __init__(self, answer: tuple[int, dict[str, Any]] | None = None) -> None:
        self.live = {"rt1"}
        self.revoked: list[str] = []
        self.refreshes = 0
        self.answer = answer
        self.held = False
        self.entered = asyncio.Event()
        self.release = asyncio.Event()

    async def handle(self, request: httpx2.Request) -> httpx2.Response:
        form = {k: v[0] for k, v in parse_qs((await request.aread()).decode()).items()}
        if request.url.path == "/revoke":
            self.revoked.append(form["token"])
            self.live.discard(form["token"])
            return _json(200, {})
        self.refreshes += 1
        answer = self.answer or self._refresh(form.get("refresh_token"))
        self.entered.set()
        if self.held:  # decided on arrival, answered on release
            await self.release.wait()
        return _json(*answer)

    def _refresh(self, spent: str | None) -> tuple[int, dict[str, Any]]:
        if spent not in self.live:
            return 400, {"error": "invalid_grant"}
        self.live.discard(spent)
        issued = f"rt{self.refreshes + 1}"
        self.live.add(issued)
        body = {"access_token": f"at{self.refreshes + 1}", "refresh_token": issued}
        return 200, body | {"token_type": "bearer", "expires_in": 3600}


def _json(status: int, body: dict[str, Any]) -> httpx2.Response:
    stream = httpx2.ByteStream(json.dumps(body).encode())  # read as it arrives, as the broker does
    return httpx2.Response(status, headers={"Content-Type": "application/json"}, stream=stream)


@dataclass
class Broker:
    sessions: async_sessionmaker[AsyncSession]
    acme: Acme
    http: httpx2.AsyncClient

    def security(self) -> SecurityLog:
        return security_log()

    def usable(self, sealing: Keyring) -> UsableCredentials:
        grants = OAuthGrants(
            public_url="https://broker.test",
            keys=Keys(Keyring.parse((generate_key("s1"),)), sealing),
            issuers=ProviderIssuers(self.http),
            http=self.http,
            notifier=FlowNotifier(poll_interval=1.0),
            security=self.security(),
        )
        return UsableCredentials(
            store=None,  # type: ignore[arg-type]  # `use` is given the row: nothing is looked up
            sessionmaker=self.sessions,
            sealing=sealing,
            providers={PROVIDER: SETTINGS},
            grants=grants,
            revoker=self.revoker(sealing),
            call_slots=asyncio.Semaphore(2),
            security=self.security(),
        )

    def revoker(self, sealing: Keyring) -> Revoker:
        return Revoker(
            providers={PROVIDER: SETTINGS},
            http=self.http,
            sealing=sealing,
            sessionmaker=self.sessions,
            security=self.security(),
        )

    async def connect(
        self, *, expires_in: timedelta, sealing: Keyring, account_id: str = NO_ACCOUNT_ID
    ) -> Connection:
        secret = {"access_token": "at1", "refresh_token": "rt1"}
        await self.grant(secret, expires_in, sealing, account_id=account_id)
        return await self.row()

    async def grant(
        self,
        secret: dict[str, str],
        expires_in: timedelta,
        sealing: Keyring,
        *,
        account_id: str = NO_ACCOUNT_ID,
    ) -> None:
        """Alice's account connected (again) with `secret`, as a completed connect flow does
        (`account_id`: the account's identity at the provider; not known by default)."""
        async with self.sessions.begin() as session:
            await credentials.store(
                session,
                keys=sealing,
                principal=ALICE,
                provider=PROVIDER,
                audience="mcp",
                secret=secret,
                account_label="alice@acme.test" if account_id else None,
                account_id=account_id,
                expires_at=utcnow() + expires_in,
            )

    async def row(self) -> Connection:
        async with self.sessions() as session:
            return (await session.execute(select(Connection))).scalar_one()

    async def rows(self) -> int:
        async with self.sessions() as session:
            return len((await session.execute(select(Connection))).all())


@pytest.fixture
async def broker(tmp_path: Path) -> AsyncIterator[Broker]:
    url = await asyncio.to_thread(fresh_database, tmp_path, "refresh-races")
    await asyncio.to_thread(upgrade, url)
    engine = create_engine(url, pool_size=3)
    acme = Acme()
    async with httpx2.AsyncClient(transport=httpx2.MockTransport(acme.handle)) as http:
        yield Broker(create_sessionmaker(engine), acme, http)
    await engine.dispose()
    await asyncio.to_thread(drop_database, url)


async def refresh_held_at_the_provider(
    broker: Broker, sealing: Keyring, *, account_id: str = NO_ACCOUNT_ID
) -> asyncio.Task[Any]:
    """A due connection's refresh, started and waiting for the provider's answer."""
    row = await broker.connect(
        expires_in=timedelta(minutes=1), sealing=Keyring.parse((OLD_KEY,)), account_id=account_id
    )
    broker.acme.held = True
    refresh = asyncio.create_task(broker.usable(sealing).use(row))
    async with asyncio.timeout(WAIT):
        await broker.acme.entered.wait()
    return refresh


async def test_a_key_rotation_during_a_refresh_keeps_the_refreshed_tokens(broker: Broker) -> None:
    """`keys rotate` while a refresh waits for the provider: the rotation must not write back
    the spent refresh token it read (the next refresh would be refused and the user asked to
    connect again), and the refresh must not give up its new tokens for a row only re-sealed."""
    serving = Keyring.parse((NEW_KEY, OLD_KEY))  # the new key first, every process restarted
    refresh = await refresh_held_at_the_provider(broker, serving)

    async def rotate() -> int:
        async with broker.sessions.begin() as session:
            return (await credentials.reseal_all(session, keys=serving)).resealed

    rotation = asyncio.create_task(rotate())
    await asyncio.sleep(0.3)  # PostgreSQL: the rotation waits for the refresh's row lock
    broker.acme.release.set()
    handed_out = await asyncio.wait_for(refresh, WAIT)
    await asyncio.wait_for(rotation, WAIT)
    row = await broker.row()

    assert isinstance(handed_out, Credential) and handed_out.secret == "at2"
    assert credentials.open_row(row, keys=Keyring.parse((NEW_KEY,))) == {
        "access_token": "at2",
        "refresh_token": "rt2",
    }
    assert broker.acme.live == {"rt2"} and broker.acme.revoked == []


async def test_a_disconnect_during_a_refresh_leaves_no_token_valid(broker: Broker) -> None:
    """The user disconnects while a refresh waits for the provider. Whichever finishes first,
    the provider is left holding no valid token: PostgreSQL's disconnect waits for the refresh
    and revokes the refreshed tokens (not the spent ones it read before the lock); SQLite's
    deletes the row first, and the refresh, finding it gone, revokes what it was just given."""
    keys = Keyring.parse((OLD_KEY,))
    refresh = await refresh_held_at_the_provider(broker, keys)

    async def leave() -> Any:
        async with broker.sessions() as session:
            return await disconnect(
                session,
                broker.revoker(keys),
                principal=ALICE,
                provider=PROVIDER,
                audience="mcp",
                actor=Actor.user(ALICE),
            )

    leaving = asyncio.create_task(leave())
    await asyncio.sleep(0.3)
    broker.acme.release.set()
    refreshed, left = await asyncio.wait_for(asyncio.gather(refresh, leaving), WAIT)

    assert left.existed and left.revoked_upstream
    assert broker.acme.live == set(), broker.acme.revoked
    assert await broker.rows() == 0
    if database_kind() == "postgresql":
        assert broker.acme.revoked == ["rt2"]
        assert isinstance(refreshed, Credential)
    else:
        assert broker.acme.revoked == ["rt1", "rt2"]
        assert refreshed is None


async def test_an_expired_token_whose_provider_is_down_asks_to_retry_not_to_reconnect(
    broker: Broker,
) -> None:
    """Answered as "not connected", an outage sent the user into a new connect flow (MCP) or
    told a sibling the connection did not exist (404)."""
    keys = Keyring.parse((OLD_KEY,))
    row = await broker.connect(expires_in=-timedelta(minutes=1), sealing=keys)
    broker.acme.answer = (503, {"message": "down"})

    with pytest.raises(RefreshUnavailable):
        await broker.usable(keys).use(row)

    assert (await broker.row()).status == ConnectionStatus.active
    broker.acme.answer = None
    refreshed = await broker.usable(keys).use(await broker.row())
    assert refreshed is not None and refreshed.secret == "at3"


async def test_a_token_refreshed_without_a_lifetime_keeps_its_predecessors(
    broker: Broker,
) -> None:
    """Without `expires_in`, the row stored no expiry and was never refreshed again: the expired
    access token was handed out until the user connected again by hand."""
    keys = Keyring.parse((OLD_KEY,))
    row = await broker.connect(expires_in=timedelta(minutes=1), sealing=keys)
    broker.acme.answer = (200, {"access_token": "at2", "token_type": "bearer"})

    refreshed = await broker.usable(keys).use(row)
    stored = await broker.row()

    assert refreshed is not None and refreshed.secret == "at2"
    assert stored.expires_at is not None
    lifetime = stored.expires_at - utcnow()
    assert MIN_LIFETIME - timedelta(seconds=5) <= lifetime <= MAX_LIFETIME
    assert credentials.open_row(stored, keys=keys) == {
        "access_token": "at2",
        "refresh_token": "rt1",
    }


async def test_a_new_grant_stored_during_a_refresh_is_not_overwritten(broker: Broker) -> None:
    """The user connects the same account again while a refresh waits for the provider: the
    connection ends up with the new grant's tokens, not with the refresh's answer for the grant
    they replaced."""
    keys = Keyring.parse((OLD_KEY,))
    refresh = await refresh_held_at_the_provider(broker, keys)

    new_grant = {"access_token": "at-new", "refresh_token": "rt-new"}
    granting = asyncio.create_task(broker.grant(new_grant, timedelta(hours=1), keys))
    await asyncio.sleep(0.3)  # PostgreSQL: the new grant waits for the refresh's row lock
    broker.acme.release.set()
    await asyncio.wait_for(asyncio.gather(refresh, granting), WAIT)

    row = await broker.row()
    assert credentials.open_row(row, keys=keys) == {
        "access_token": "at-new",
        "refresh_token": "rt-new",
    }


async def test_a_refresh_that_lost_to_a_new_grant_of_the_account_leaves_that_grant_alone(
    broker: Broker,
) -> None:
    """The same, with the account known. SQLite's refresh finds the row replaced and discards
    what it was given; PostgreSQL's new grant waits for the refresh and replaces its tokens.
    Neither is revoked: at a provider whose revocation of any token ends the user's whole
    grant (RFC 7009 at Google), that would end the new grant of the same account too."""
    keys = Keyring.parse((OLD_KEY,))
    refresh = await refresh_held_at_the_provider(broker, keys, account_id="acme-7")

    new_grant = {"access_token": "at-new", "refresh_token": "rt-new"}
    granting = asyncio.create_task(
        broker.grant(new_grant, timedelta(hours=1), keys, account_id="acme-7")
    )
    await asyncio.sleep(0.3)
    broker.acme.release.set()
    await asyncio.wait_for(asyncio.gather(refresh, granting), WAIT)

    assert credentials.open_row(await broker.row(), keys=keys) == new_grant
    assert broker.acme.revoked == []


async def test_the_row_lock_is_kept_while_a_refresh_still_waits_for_it() -> None:
    """A released lock may have a waiter about to take it: a caller coming then must wait for
    that waiter, not get a lock of its own (two refreshes of one row would spend one refresh
    token twice). The lock is dropped once nobody holds or awaits it."""
    locks = _RowLocks()
    held: list[str] = []
    overlaps: list[tuple[str, ...]] = []
    late: list[asyncio.Task[None]] = []

    async def refresh(name: str, then: str | None = None) -> None:
        async with locks.hold(7):
            held.append(name)
            overlaps.append(tuple(held))
            await asyncio.sleep(0.02)
            if then is not None:  # comes in as this one lets go, before the waiter runs
                late.append(asyncio.create_task(refresh(then)))
            held.remove(name)

    first = asyncio.create_task(refresh("first", then="late"))
    await asyncio.sleep(0)
    waiting = asyncio.create_task(refresh("waiting"))
    await asyncio.wait_for(asyncio.gather(first, waiting), WAIT)
    await asyncio.wait_for(late[0], WAIT)

    assert all(len(names) == 1 for names in overlaps), overlaps
    assert sorted(names[0] for names in overlaps) == ["first", "late", "waiting"]
    assert locks._locks == {}
