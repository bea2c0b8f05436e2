"""Disconnecting: delete the credential, then revoke upstream where the provider supports it.

The deletion, and the queued revocation of the grant (app/connect/revocations.py), are committed
before the provider is asked: whatever the provider answers, and however long it takes, no usable
credential stays behind, and no pooled connection or row lock is held while it answers
(SECURITY.md T21). A revocation the provider does not confirm now is retried by the broker; the
caller tells the user it is not confirmed yet.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from sqlalchemy.ext.asyncio import AsyncSession

from app import audit, credentials
from app.audit import Actor
from app.auth.principal import Principal
from app.connect import revocations
from app.connect.revocations import Revoker
from app.errors import DATABASE_ERRORS

logger = logging.getLogger("broker.providers")


@dataclass(frozen=True)
class Disconnected:
    existed: bool
    # False when the provider has no revocation, it failed, or another connection of the same
    # upstream account holds the grant (app/connect/revocations.py `reach`)
    revoked_upstream: bool
    upstream_failed: bool  # the provider did not confirm: the broker keeps trying
    # several accounts and none named: nothing was deleted; these are their names
    choose_from: tuple[str, ...] = ()


NOTHING = Disconnected(existed=False, revoked_upstream=False, upstream_failed=False)


async def disconnect(
    session: AsyncSession,
    revoker: Revoker,
    *,
    principal: Principal,
    provider: str,
    audience: str,
    actor: Actor,
    account: str | None = None,
) -> Disconnected:
    """Delete the connection of the account named `account` (as `credentials.accounts` names
    them; None: the only one), queueing its revocation, and commit `session` (with the
    `actor`'s `connection.disconnected` event), then ask the provider to revoke the grant.
    With several accounts and none named, nothing is deleted (`choose_from` names them)."""
    held = await credentials.accounts(
        session, principal=principal, provider=provider, audience=audience
    )
    if account is None and len(held) > 1:
        return Disconnected(
            existed=True, revoked_upstream=False, upstream_failed=False, choose_from=tuple(held)
        )
    found = held.get(account) if account is not None else next(iter(held.values()), None)
    row = await credentials.find_by_id(session, found.id, for_update=True) if found else None
    if row is None:
        return NOTHING
    secret = credentials.open_row(row, keys=revoker.sealing)
    revocable = secret and revoker.revocable(provider)
    pending = await revocations.queue(session, row) if revocable else None
    await credentials.remove(session, row)
    await audit.record(
        session,
        "connection.disconnected",
        actor=actor,
        principal=principal,
        provider=provider,
        audience=audience,
        account_label=row.account_label,
    )
    await session.commit()  # flushes `pending`: its id is set
    if pending is None:
        return Disconnected(existed=True, revoked_upstream=False, upstream_failed=False)
    claimed = revocations.Claimed.of(pending, secret)
    failure = await revoker.attempt(claimed)
    kept = failure == revocations.HELD_ELSEWHERE  # another connection holds the grant
    if failure is not None and not kept:
        logger.warning("oauth.revocation_failed provider=%s reason=%s", provider, failure)
    try:
        await revoker.settle(session, claimed, failure)
        await session.commit()
    except DATABASE_ERRORS as exc:  # the queued row stays: the sweep asks the provider again
        logger.warning(
            "revocation.settle_failed provider=%s error=%s", provider, type(exc).__name__
        )
    return Disconnected(
        existed=True,
        revoked_upstream=failure is None,
        upstream_failed=failure is not None and not kept,
    )
