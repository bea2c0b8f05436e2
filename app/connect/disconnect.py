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
    revoked_upstream: bool  # False when the provider has no revocation or it failed
    upstream_failed: bool  # the provider did not confirm: the broker keeps trying


async def disconnect(
    session: AsyncSession,
    revoker: Revoker,
    *,
    principal: Principal,
    provider: str,
    audience: str,
    actor: Actor,
) -> Disconnected:
    """Delete the connection (queueing its revocation) and commit `session` (with the `actor`'s
    `connection.disconnected` event), then ask the provider to revoke the grant."""
    row = await credentials.find(
        session, principal=principal, provider=provider, audience=audience, for_update=True
    )
    if row is None:
        return Disconnected(existed=False, revoked_upstream=False, upstream_failed=False)
    secret = credentials.open_row(row, keys=revoker.sealing)
    pending = revocations.queue(session, row) if secret and revoker.revocable(provider) else None
    await credentials.remove(session, principal=principal, provider=provider, audience=audience)
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
    if failure is not None:
        logger.warning("oauth.revocation_failed provider=%s reason=%s", provider, failure)
    try:
        await revoker.settle(session, claimed, failure)
        await session.commit()
    except DATABASE_ERRORS as exc:  # the queued row stays: the sweep asks the provider again
        logger.warning(
            "revocation.settle_failed provider=%s error=%s", provider, type(exc).__name__
        )
    return Disconnected(
        existed=True, revoked_upstream=failure is None, upstream_failed=failure is not None
    )
