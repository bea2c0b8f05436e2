"""Removing a connection for an operator or the broker (an erasure, `connections revoke`, an
idle connection): in the caller's transaction, the grant is queued for revocation, due at once
(the housekeeping asks the provider, and retries, as after a disconnect), the row is deleted and
the event recorded. A user's own disconnect (app/connect/disconnect.py) also asks the provider
itself before answering.
"""

from __future__ import annotations

from collections.abc import Mapping

from sqlalchemy.ext.asyncio import AsyncSession

from app import audit, credentials
from app.audit import Actor
from app.auth.principal import Principal
from app.connect import revocations
from app.crypto import Keyring
from app.models import Connection
from app.providers.settings import ProviderSettings


async def remove_connection(
    session: AsyncSession,
    row: Connection,
    *,
    sealing: Keyring,
    providers: Mapping[str, ProviderSettings],
    actor: Actor,
    event: str | None,
) -> bool:
    """Delete the (locked) connection `row`, queueing its grant's revocation where the provider
    has one and the credential opens; record `event` unless None. True when queued."""
    principal = Principal(row.issuer, row.subject)
    secret = credentials.open_row(row, keys=sealing)
    queued = bool(secret) and revocations.revocable(providers, row.provider) is not None
    if queued:
        await revocations.queue(session, row, due_now=True)
    await credentials.remove(session, row)
    if event is not None:
        await audit.record(
            session,
            event,
            actor=actor,
            principal=principal,
            provider=row.provider,
            audience=row.audience,
            account_label=row.account_label,
            detail="revocation queued" if queued else "no revocation",
        )
    return queued
