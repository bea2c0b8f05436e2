"""Usable credentials: refresh OAuth access tokens shortly before they expire.

One refresh at a time per connection across all processes: the connection row is locked
(`SELECT … FOR UPDATE` on PostgreSQL; SQLite is single-process, so an in-process lock suffices),
and the expiry is re-checked once the lock is held, so a process that waited uses the token the
winner stored. A rotated refresh token is committed before the new access token is handed out.
A refresh the provider rejects (`invalid_grant`) marks the connection `needs_reauth`; the next
tool call then elicits a new connect flow.
"""

from __future__ import annotations

import asyncio
import logging
from collections import defaultdict
from collections.abc import Mapping
from dataclasses import replace
from datetime import timedelta

from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from app import audit, credentials
from app.auth.principal import Principal
from app.clock import utcnow
from app.connect.idle import UsageLog
from app.connect.oauth_service import OAuthGrants
from app.credentials import Credential
from app.crypto import Keyring
from app.db import POOL_TIMEOUT_SECONDS
from app.direct import ConnectionRecord, DirectStore
from app.models import Connection, ConnectionStatus
from app.providers import oauth
from app.providers.settings import OAuthProviderSettings, ProviderSettings
from app.security_log import SecurityLog

logger = logging.getLogger("broker.providers")

REFRESH_MARGIN = timedelta(minutes=5)
_process_locks: defaultdict[int, asyncio.Lock] = defaultdict(asyncio.Lock)


def _due(row: Connection | ConnectionRecord, secret: dict[str, str]) -> bool:
    return (
        row.expires_at is not None
        and "refresh_token" in secret
        and row.expires_at - utcnow() < REFRESH_MARGIN
    )


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
        call_slots: asyncio.Semaphore,
        security: SecurityLog,
        usage: UsageLog | None = None,
    ) -> None:
        self._store = store
        self._sessionmaker = sessionmaker
        self._sealing = sealing
        self._providers = providers
        self._grants = grants
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
        async with _process_locks[row.id]:
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
            raise
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
                row.status = ConnectionStatus.needs_reauth
                row.updated_at = utcnow()
                await self._record(session, "credential.refresh_rejected", row)
                self._security.event("credential.refresh_rejected", provider=provider)
                return None
            except oauth.UpstreamError as exc:
                logger.warning("oauth.refresh_failed provider=%s reason=%s", provider, exc.reason)
                still_valid = row.expires_at is not None and row.expires_at > utcnow()
                return credentials.as_credential(row, secret) if still_valid else None
            new_secret = {**secret, **tokens.secret()}
            credentials.replace_tokens(
                row,
                keys=self._sealing,
                secret=new_secret,
                scopes=tokens.scopes,
                expires_at=tokens.expires_at,
            )
            await self._record(session, "credential.refreshed", row)
            credential = credentials.as_credential(row, new_secret)
        return credential  # returned only after the commit above

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
