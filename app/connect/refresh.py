"""Usable credentials: refresh OAuth access tokens shortly before they expire.

One refresh at a time per connection across all processes: the connection row is locked
(`SELECT … FOR UPDATE` on PostgreSQL; SQLite is single-process, so an in-process lock suffices),
and the expiry is re-checked once the lock is held, so a process that waited uses the token the
winner stored. A rotated refresh token is committed before the new access token is handed out.
A refresh the provider rejects (`invalid_grant`) marks the connection `needs_reauth`; the next
tool call then elicits a new connect flow. A provider that cannot be reached leaves the
connection as it is: the token is used while it is valid, and once expired the caller is told to
retry shortly (`RefreshUnavailable`), never that the user is not connected.

The refreshed tokens are written only if the row is still as it was read (a compare-and-set;
SQLite takes no row lock, and a disconnect, a key rotation or a new grant may have changed it
meanwhile). A row re-sealed with another key, holding the same refresh token, takes them; a row
that went or holds another grant does not, and the new tokens are revoked at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Mapping
from dataclasses import replace
from datetime import datetime, timedelta

from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from app import audit, credentials
from app.auth.principal import Principal
from app.clock import utcnow
from app.connect.idle import UsageLog
from app.connect.oauth_service import OAuthGrants
from app.connect.revocations import Issued, Revoker
from app.credentials import Credential
from app.crypto import Keyring
from app.db import POOL_TIMEOUT_SECONDS
from app.direct import ConnectionRecord, DirectStore
from app.errors import ProviderUnavailable
from app.models import Connection, ConnectionStatus
from app.providers import oauth
from app.providers.settings import OAuthProviderSettings, ProviderSettings
from app.security_log import SecurityLog

logger = logging.getLogger("broker.providers")

REFRESH_MARGIN = timedelta(minutes=5)
# a refreshed token answered without a usable lifetime gets its predecessor's, within these bounds
MIN_LIFETIME = 2 * REFRESH_MARGIN
MAX_LIFETIME = timedelta(days=1)


class _RowLocks:
    """One lock per connection this process is refreshing, kept while anyone holds or awaits
    it (counted: a released lock may still have a waiter about to take it, and a second lock
    for the same row would let two refreshes spend one refresh token)."""

    def __init__(self) -> None:
        self._locks: dict[int, tuple[asyncio.Lock, int]] = {}

    @contextlib.asynccontextmanager
    async def hold(self, row_id: int) -> AsyncIterator[None]:
        lock, users = self._locks.get(row_id) or (asyncio.Lock(), 0)
        self._locks[row_id] = (lock, users + 1)
        try:
            async with lock:
                yield
        finally:
            lock, users = self._locks[row_id]
            if users == 1:
                del self._locks[row_id]
            else:
                self._locks[row_id] = (lock, users - 1)


_process_locks = _RowLocks()


class RefreshUnavailable(ProviderUnavailable):
    """The access token has expired and its provider could not refresh it now (unreachable,
    failing, or a refresh slot not free in time): a short unavailability on every surface
    (app/errors.py), never "not connected"."""


def _due(row: Connection | ConnectionRecord, secret: dict[str, str]) -> bool:
    return (
        row.expires_at is not None
        and "refresh_token" in secret
        and row.expires_at - utcnow() < REFRESH_MARGIN
    )


def _same_lifetime(row: Connection) -> datetime:
    """When a refreshed token answered without a lifetime expires: as long after now as its
    predecessor lived (from its last write to its expiry), within MIN_LIFETIME..MAX_LIFETIME, so
    that it is refreshed again in time rather than never."""
    before = (row.expires_at - row.updated_at) if row.expires_at else MAX_LIFETIME
    return utcnow() + min(max(before, MIN_LIFETIME), MAX_LIFETIME)


# Connection rows of one principal already read, by (provider, audience); None: read and absent.
KnownRows = Mapping[tuple[str, str], ConnectionRecord | None]


class UsableCredentials:
    """The caller's credential for a provider, refreshed first when it is about to expire.

    `call_slots` bounds the refreshes that hold a pooled connection while a provider answers:
    half the pool (pool_size of its pool_size + as many overflow), so a slow provider never
    takes it all.
    """

    def __init__(
        self,
        *,
        store: DirectStore,
        sessionmaker: async_sessionmaker[AsyncSession],
        sealing: Keyring,
        providers: Mapping[str, ProviderSettings],
        grants: OAuthGrants,
        revoker: Revoker,
        call_slots: asyncio.Semaphore,
        security: SecurityLog,
        usage: UsageLog | None = None,
    ) -> None:
        self._store = store
        self._sessionmaker = sessionmaker
        self._sealing = sealing
        self._providers = providers
        self._grants = grants
        self._revoker = revoker
        self._call_slots = call_slots
        self._security = security
        self._usage = usage if usage is not None else UsageLog()

    async def usable(
        self,
        *,
        principal: Principal,
        provider: str,
        audience: str,
        known: KnownRows | None = None,
    ) -> Credential | None:
        """The caller's credential, refreshed first when it expires within five minutes. A row in
        `known` (e.g. read with a finished flow, or with the calling service) is not read again."""
        if known is not None and (provider, audience) in known:
            row = known[provider, audience]
        else:
            row = await self._store.find_connection(
                principal.issuer, principal.subject, provider, audience
            )
        if row is None:
            return None
        return await self.use(row, accounts=row.accounts)

    async def use(
        self, row: ConnectionRecord | Connection, *, accounts: int = 1
    ) -> Credential | None:
        """The credential of the connection `row` (already read), refreshed first when it
        expires within five minutes; `accounts`: how many the user holds at its provider."""
        if row.status != ConnectionStatus.active:
            return None
        self._usage.note(row.id)  # in memory: written by the housekeeping (app/connect/idle.py)
        secret = credentials.open_row(row, keys=self._sealing)
        if secret is None:
            return None
        settings = self._providers.get(row.provider)
        if not isinstance(settings, OAuthProviderSettings) or not _due(row, secret):
            return credentials.as_credential(row, secret, accounts=accounts)
        async with _process_locks.hold(row.id):
            found = await self._refresh(settings, connection_id=row.id, provider=row.provider)
        return replace(found, accounts=accounts) if found is not None else None

    async def _refresh(
        self, settings: OAuthProviderSettings, *, connection_id: int, provider: str
    ) -> Credential | None:
        """Refresh under the row's lock, which holds a pooled connection while the provider answers
        (up to its deadline). At most `provider_call_slots` refreshes do so at once, half the pool,
        so a slow provider leaves the other half to everything else; a refresh that waits longer
        than a pooled connection would is answered like a pool timeout (503, retry shortly).
        """
        try:
            async with asyncio.timeout(POOL_TIMEOUT_SECONDS):
                await self._call_slots.acquire()
        except TimeoutError:
            logger.warning("oauth.refresh_busy provider=%s", provider)
            raise RefreshUnavailable() from None
        try:
            return await self._refresh_holding_a_slot(
                settings, connection_id=connection_id, provider=provider
            )
        finally:
            self._call_slots.release()

    async def _refresh_holding_a_slot(
        self, settings: OAuthProviderSettings, *, connection_id: int, provider: str
    ) -> Credential | None:
        async with self._sessionmaker.begin() as session:
            row = await credentials.find_by_id(session, connection_id, for_update=True)
            if row is None or row.status != ConnectionStatus.active:
                return None
            secret = credentials.open_row(row, keys=self._sealing)
            if secret is None:
                return None
            if not _due(row, secret):  # another process refreshed while we waited for the lock
                return credentials.as_credential(row, secret)
            try:
                target = await self._grants.endpoints(settings)
                tokens = await oauth.refresh(
                    settings,
                    self._grants.http,
                    token_url=target.token_url,
                    refresh_token=secret["refresh_token"],
                    current_scopes=frozenset(row.scopes.split()),
                )
            except oauth.InvalidGrant:
                if await credentials.mark_needs_reauth(session, row):
                    await self._record(session, "credential.refresh_rejected", row)
                    self._security.event("credential.refresh_rejected", provider=provider)
                return None
            except oauth.UpstreamError as exc:
                logger.warning("oauth.refresh_failed provider=%s reason=%s", provider, exc.reason)
                if row.expires_at is not None and row.expires_at > utcnow():
                    return credentials.as_credential(row, secret)
                raise RefreshUnavailable() from None
            new_secret = {**secret, **tokens.secret()}
            expires_at = tokens.expires_at or _same_lifetime(row)
            stored = await self._write_refreshed(
                session, row, secret, new_secret, tokens, expires_at
            )
            if stored is not None:
                await self._record(session, "credential.refreshed", stored)
                return credentials.as_credential(stored, new_secret)  # once committed
            issued = Issued(
                Principal(row.issuer, row.subject), provider, row.audience, row.account_id
            )
        # The connection changed meanwhile: its refreshed tokens are discarded once the row lock
        # and the pooled connection are given back, not while the provider answers.
        await self._revoker.discard(
            issued, tokens, why="connection_changed", about=f"connection={connection_id}"
        )
        return None

    async def _write_refreshed(
        self,
        session: AsyncSession,
        row: Connection,
        spent: dict[str, str],
        new_secret: dict[str, str],
        tokens: oauth.TokenSet,
        expires_at: datetime | None,
    ) -> Connection | None:
        """Write the refreshed tokens if the row is as read, or was only re-sealed meanwhile
        (the same refresh token under another key); the row written, or None."""
        for _ in range(2):
            if await credentials.replace_tokens(
                session,
                row,
                keys=self._sealing,
                secret=new_secret,
                scopes=tokens.scopes,
                expires_at=expires_at,
            ):
                return row
            current = await credentials.find_by_id(session, row.id, for_update=True)
            opened = credentials.open_row(current, keys=self._sealing) if current else None
            if current is None or opened is None:
                return None
            if opened.get("refresh_token") != spent["refresh_token"]:
                return None  # refreshed or granted anew meanwhile: that grant stays
            row = current
        return None

    @staticmethod
    async def _record(session: AsyncSession, event: str, row: Connection) -> None:
        await audit.record(
            session,
            event,
            actor=audit.BROKER,
            principal=Principal(row.issuer, row.subject),
            provider=row.provider,
            audience=row.audience,
            account_label=row.account_label,
        )
