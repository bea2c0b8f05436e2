"""Revoking a disconnected grant at its provider, until the provider confirms (DESIGN.md §3.3).

A disconnect deletes the connection and, in the same transaction, queues its grant here
(`queue`); it then asks the provider once itself. Whatever stops that attempt (a provider error or
timeout, the process dying before it asks) leaves the row, and the housekeeping loop
(app/main.py) asks again (`sweep`): after FIRST_RETRY_SECONDS, doubling up to MAX_RETRY_SECONDS,
MAX_ATTEMPTS times in all (the last about four hours after the first). Then the grant is given up
with a `revocation.abandoned` security event, for an operator to revoke it by hand. Each attempt
is claimed by moving `next_attempt_at` CLAIM_SECONDS ahead in one conditional UPDATE, so with many
replicas one process makes it; no database connection is held while a provider answers
(SECURITY.md T21).

How far a revocation reaches is decided when it is made (`Revoker.reach`), not when it was
queued: while a connection (of any user, through any audience) holds the same upstream account,
it revokes this token alone where the provider tells a token from the grant (GitHub), and
nothing where revoking any token ends the user's whole grant (RFC 7009 at Google), as that
would end the other connection too. Tokens the broker obtained but will not keep follow the same
rule (`Revoker.discard`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from enum import Enum

import httpx2
from sqlalchemy import delete, func, select, update
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker
from sqlalchemy.sql.dml import ReturningUpdate

from app import audit, credentials
from app.auth.principal import Principal
from app.clock import doubling_delay, utcnow
from app.crypto import Keyring
from app.errors import DATABASE_ERRORS
from app.metrics import RevocationBacklog
from app.models import NO_ACCOUNT_ID, Connection, PendingRevocation
from app.providers import oauth
from app.providers.settings import OAuthProviderSettings, ProviderSettings
from app.security_log import SecurityLog
from app.tables import connections as connections_table

logger = logging.getLogger("broker.providers")

FIRST_RETRY_SECONDS = 60
MAX_RETRY_SECONDS = 3600
MAX_ATTEMPTS = 10
# Longer than any provider's deadline (at most 60 s): a claim outlives the attempt it covers.
CLAIM_SECONDS = 120
SWEEP_BATCH = 20
# Failures no later attempt can cure: the grant is given up at once.
NOT_CONFIGURED = "provider_not_configured"
UNREADABLE = "credential_unreadable"
# Not a failure, and final: a connection holds the account, and revoking would end its grant.
HELD_ELSEWHERE = "account_held_elsewhere"
# Whether a connection holds the account could not be read: the sweep asks again.
HOLDERS_UNREAD = "account_holders_unread"


class Reach(Enum):
    """How far revoking a token of an upstream account may go now."""

    GRANT = "grant"  # no connection holds the account: its whole grant
    # this token alone: the provider revokes it without ending the grant
    TOKEN = "token"  # noqa: S105 (a name, not a secret)
    NOTHING = "nothing"  # a connection holds the account, and any token's revocation ends it


@dataclass(frozen=True)
class Issued:
    """Whom tokens the broker will not keep were issued for: the owner, provider and audience
    of the connection they were (or would have been), and the upstream account (None: never
    identified)."""

    principal: Principal
    provider: str
    audience: str
    account_id: str | None


@dataclass(frozen=True)
class Claimed:
    """A queued revocation this process is attempting now."""

    id: int
    provider: str
    attempts: int  # made before this one
    secret: dict[str, str] | None = field(repr=False)
    principal: Principal | None = None  # whose grant (for the audit event of its outcome)
    audience: str | None = None
    whole_grant: bool = True  # False: this token only, whoever holds the account
    account_id: str = NO_ACCOUNT_ID  # the upstream account, if known

    @classmethod
    def of(cls, row: PendingRevocation, secret: dict[str, str] | None) -> Claimed:
        return cls(
            row.id,
            row.provider,
            row.attempts,
            secret,
            Principal(row.issuer, row.subject),
            row.audience,
            row.whole_grant,
            row.account_id,
        )


async def queue(
    session: AsyncSession, row: Connection, *, due_now: bool = False, token_only: bool = False
) -> PendingRevocation:
    """Queue the revocation of the grant in `row` (being deleted, or replaced by a new grant of
    the same account, in the same transaction; `token_only`: this token alone). Its first attempt
    is the caller's, and the sweep leaves it alone for CLAIM_SECONDS; unless `due_now`: then the
    next sweep makes it. Each attempt decides how far it reaches (`Revoker.reach`); a connection
    made before accounts were told apart (no `account_id`) revokes its token alone."""
    now = utcnow()
    pending = PendingRevocation(
        issuer=row.issuer,
        subject=row.subject,
        provider=row.provider,
        audience=row.audience,
        sealed_credential=row.sealed_credential,  # sealed for the same owner, provider, audience
        key_id=row.key_id,
        whole_grant=not token_only and row.account_id != NO_ACCOUNT_ID,
        account_id=row.account_id,
        attempts=0,
        next_attempt_at=now if due_now else now + timedelta(seconds=CLAIM_SECONDS),
        created_at=now,
    )
    session.add(pending)
    return pending


def revocable(
    providers: Mapping[str, ProviderSettings], provider: str
) -> OAuthProviderSettings | None:
    """The provider's settings if it can revoke a grant, else None."""
    settings = providers.get(provider)
    if isinstance(settings, OAuthProviderSettings) and settings.revokes:
        return settings
    return None


def retry_delay(attempts: int) -> timedelta:
    """How long after the `attempts`-th failed attempt the next one is due."""
    return doubling_delay(attempts, first=FIRST_RETRY_SECONDS, cap=MAX_RETRY_SECONDS)


async def backlog(session: AsyncSession) -> RevocationBacklog:
    """How many revocations are queued, and how long the oldest has waited."""
    pending, oldest = (
        await session.execute(
            select(func.count(), func.min(PendingRevocation.created_at)).select_from(
                PendingRevocation
            )
        )
    ).one()
    age = (utcnow() - oldest).total_seconds() if oldest is not None else 0.0
    return RevocationBacklog(pending, max(age, 0.0))


async def listing(session: AsyncSession) -> list[PendingRevocation]:
    """Every queued revocation, the next due first (for `connect-broker revocations list`)."""
    rows = await session.execute(
        select(PendingRevocation).order_by(PendingRevocation.next_attempt_at, PendingRevocation.id)
    )
    return list(rows.scalars())


def claim_due(now: datetime) -> ReturningUpdate[PendingRevocation]:
    """One statement that claims the due revocations (up to SWEEP_BATCH) and returns them.

    The outer `next_attempt_at <= now` is not redundant: on PostgreSQL, an UPDATE that waited for
    a row another transaction was claiming re-checks its WHERE on the row as that transaction
    left it, but not the subquery that chose the row.
    """
    due = (
        select(PendingRevocation.id)
        .where(PendingRevocation.next_attempt_at <= now)
        .order_by(PendingRevocation.next_attempt_at)
        .limit(SWEEP_BATCH)
    )
    return (
        update(PendingRevocation)
        .where(PendingRevocation.id.in_(due), PendingRevocation.next_attempt_at <= now)
        .values(next_attempt_at=now + timedelta(seconds=CLAIM_SECONDS))
        .returning(PendingRevocation)
        .execution_options(synchronize_session=False)
    )


class Revoker:
    """Asks providers to revoke disconnected grants, and retries until they confirm."""

    def __init__(
        self,
        *,
        providers: Mapping[str, ProviderSettings],
        http: httpx2.AsyncClient,
        sealing: Keyring,
        sessionmaker: async_sessionmaker[AsyncSession],
        security: SecurityLog,
    ) -> None:
        self._providers = providers
        self._http = http
        self.sealing = sealing
        self._sessionmaker = sessionmaker
        self._security = security

    def revocable(self, provider: str) -> OAuthProviderSettings | None:
        """The provider's settings if it can revoke a grant, else None."""
        return revocable(self._providers, provider)

    async def reach(
        self, settings: OAuthProviderSettings, provider: str, account_id: str | None
    ) -> Reach:
        """How far revoking a token of the upstream account `account_id` may go now (the module's
        docstring says why); None: tokens whose account was never identified (their ID token was
        refused), which may be any account's. A connection made before accounts were told apart
        (NO_ACCOUNT_ID) revokes its token alone, as it always has. Whether a connection holds
        the account is read in a session of its own, ended before any provider is asked.

        Raises:
            DATABASE_ERRORS: the read failed.
        """
        if account_id == NO_ACCOUNT_ID:
            return Reach.TOKEN
        held = account_id is None
        if account_id is not None:
            async with self._sessionmaker() as session:
                statement = connections_table.holds_account(provider, account_id)
                held = bool(await session.scalar(statement))
        if not held:
            return Reach.GRANT
        return Reach.TOKEN if settings.revokes_one_token else Reach.NOTHING

    async def attempt(self, claimed: Claimed) -> str | None:
        """Ask the provider to revoke, as far as `reach` allows: None once it confirms, else
        why not (HELD_ELSEWHERE: not asked, and nothing is left to do)."""
        if not claimed.secret:
            return UNREADABLE if self.revocable(claimed.provider) else NOT_CONFIGURED
        return await self._revoke(
            claimed.provider, claimed.secret, claimed.account_id, whole_grant=claimed.whole_grant
        )

    async def _revoke(
        self, provider: str, secret: dict[str, str], account_id: str | None, *, whole_grant: bool
    ) -> str | None:
        """Revoke `secret` at `provider`, the whole grant only where asked and `reach` allows it
        (a row naming no account keeps the reach it was queued with): None once the provider
        confirms, else why not."""
        settings = self.revocable(provider)
        if settings is None:
            return NOT_CONFIGURED
        try:
            reach = await self.reach(settings, provider, account_id)
        except DATABASE_ERRORS:
            return HOLDERS_UNREAD
        if reach is Reach.NOTHING:
            return HELD_ELSEWHERE
        whole_grant = whole_grant and (reach is Reach.GRANT or account_id == NO_ACCOUNT_ID)
        try:
            await oauth.revoke(settings, self._http, secret, whole_grant=whole_grant)
        except oauth.UpstreamError as exc:
            return exc.reason
        return None

    async def discard(
        self, issued: Issued, tokens: oauth.TokenSet, *, why: str, about: str
    ) -> None:
        """Revoke tokens the provider issued that the broker will not keep (`why`: their ID
        token failed its checks, the flow moved on, storing them failed, the connection they
        refreshed changed meanwhile; `about`: the flow or connection, for the log), so that none
        stays valid at the provider with nobody holding it: this token alone, as far as `reach`
        allows. A revocation the provider does not confirm is queued, sealed, for the sweep to
        retry, like a disconnect's. Never raising: when the database is what failed, the
        outcome is only logged. The caller holds no write transaction (on SQLite, this one
        would wait for it)."""
        secret = tokens.secret()
        reason = await self._revoke(issued.provider, secret, issued.account_id, whole_grant=False)
        if reason is None:
            logger.info("token.discarded %s why=%s revoked=yes", about, why)
            return
        upstream = reason not in (NOT_CONFIGURED, HELD_ELSEWHERE, HOLDERS_UNREAD)
        queued = upstream and await self._queue_discarded(issued, secret, reason)
        logger.warning(
            "token.discarded %s why=%s revoked=no reason=%s queued=%s",
            about,
            why,
            reason,
            "yes" if queued else "no",
        )

    async def _queue_discarded(self, issued: Issued, secret: dict[str, str], failure: str) -> bool:
        """Queue the revocation of discarded tokens whose first attempt failed (this token
        alone, retried as after a disconnect); False when the database refused it."""
        now = utcnow()
        account_id = issued.account_id or NO_ACCOUNT_ID
        sealed = credentials.seal_secret(
            self.sealing,
            principal=issued.principal,
            provider=issued.provider,
            audience=issued.audience,
            secret=secret,
            account_id=account_id,
        )
        pending = PendingRevocation(
            issuer=issued.principal.issuer,
            subject=issued.principal.subject,
            provider=issued.provider,
            audience=issued.audience,
            **sealed,
            whole_grant=False,
            account_id=account_id,
            attempts=1,
            last_error=failure[:64],
            next_attempt_at=now + retry_delay(1),
            created_at=now,
        )
        try:
            async with self._sessionmaker.begin() as session:
                session.add(pending)
        except DATABASE_ERRORS as exc:
            logger.warning(
                "revocation.queue_failed provider=%s error=%s", issued.provider, type(exc).__name__
            )
            return False
        return True

    async def settle(self, session: AsyncSession, claimed: Claimed, failure: str | None) -> None:
        """Record an attempt's outcome (the caller commits): confirmed and given-up revocations
        leave the queue; others wait for their next attempt."""
        attempts = claimed.attempts + 1
        final = (None, NOT_CONFIGURED, UNREADABLE, HELD_ELSEWHERE)
        if failure not in final and attempts < MAX_ATTEMPTS:
            await session.execute(
                update(PendingRevocation)
                .where(PendingRevocation.id == claimed.id)
                .values(
                    attempts=attempts,
                    last_error=failure[:64],
                    next_attempt_at=utcnow() + retry_delay(attempts),
                )
                .execution_options(synchronize_session=False)
            )
            logger.info(
                "revocation.retry_scheduled provider=%s revocation=%d attempts=%d reason=%s",
                claimed.provider,
                claimed.id,
                attempts,
                failure,
            )
            return
        await session.execute(
            delete(PendingRevocation)
            .where(PendingRevocation.id == claimed.id)
            .execution_options(synchronize_session=False)
        )
        if failure is None:
            event = "revocation.confirmed"
        elif failure == HELD_ELSEWHERE:
            event = "revocation.skipped"
        else:
            event = "revocation.abandoned"
        await audit.record(
            session,
            event,
            actor=audit.BROKER,
            principal=claimed.principal,
            provider=claimed.provider,
            audience=claimed.audience,
            detail=f"attempts={attempts}" + (f" reason={failure}" if failure else ""),
        )
        if failure is None or failure == HELD_ELSEWHERE:
            logger.info(
                "%s provider=%s revocation=%d attempts=%d",
                event,
                claimed.provider,
                claimed.id,
                attempts,
            )
        else:
            self._security.event(
                "revocation.abandoned",
                provider=claimed.provider,
                revocation=str(claimed.id),
                attempts=str(attempts),
                reason=failure,
            )

    async def sweep(self) -> int:
        """Attempt every due revocation (up to SWEEP_BATCH): how many were attempted."""
        claimed = await self._claim_due()
        if not claimed:
            return 0
        failures = await asyncio.gather(*(self.attempt(item) for item in claimed))
        async with self._sessionmaker.begin() as session:
            for item, failure in zip(claimed, failures, strict=True):
                await self.settle(session, item, failure)
        return len(claimed)

    async def _claim_due(self) -> list[Claimed]:
        async with self._sessionmaker.begin() as session:
            rows = list((await session.execute(claim_due(utcnow()))).scalars())
        return [Claimed.of(row, credentials.open_row(row, keys=self.sealing)) for row in rows]
