"""Erasing a user (`connect-broker users erase`, `DELETE /api/v1/admin/users`): one definition,
one transaction.

Every connection is removed with its grant queued for revocation at the provider (the
housekeeping asks it, as after a disconnect; a queued revocation keeps the user's issuer and
subject until the provider confirms or it is given up); every flow and browser session is
deleted; the user's audit events older than `[audit] erase_hold_days` are deleted, the recent
ones stay for investigations until the retention sweep takes them; and a `user.erased` event
records what was removed.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta

from sqlalchemy.ext.asyncio import AsyncSession

from app import audit
from app.audit import Actor
from app.auth import browser
from app.auth.principal import Principal
from app.clock import utcnow
from app.connect.removal import remove_connection
from app.crypto import Keyring
from app.providers.settings import ProviderSettings
from app.tables import audit as audit_table
from app.tables import connections as connections_table
from app.tables import flows as flows_table


@dataclass(frozen=True)
class Erased:
    """What an erasure removed, by kind."""

    connections: int
    revocations_queued: int
    flows: int
    sessions: int
    audit_events: int

    def summary(self) -> str:
        return (
            f"connections={self.connections} revocations_queued={self.revocations_queued} "
            f"flows={self.flows} sessions={self.sessions} audit_events={self.audit_events}"
        )


async def erase_user(
    session: AsyncSession,
    *,
    principal: Principal,
    sealing: Keyring,
    providers: Mapping[str, ProviderSettings],
    hold_days: int,
    actor: Actor,
) -> Erased:
    """Erase everything the broker holds about `principal` (the caller commits)."""
    rows = list(
        (await session.execute(connections_table.of_user(principal.issuer, principal.subject)))
        .scalars()
        .all()
    )
    queued = 0
    for row in rows:
        queued += await remove_connection(
            session, row, sealing=sealing, providers=providers, actor=actor, event=None
        )
    flows = await session.execute(flows_table.remove_of_owner(principal.issuer, principal.subject))
    sessions = await browser.end_all(session, principal)
    held_from = utcnow() - timedelta(days=hold_days)
    events = await session.execute(
        audit_table.remove_of_user(principal.issuer, principal.subject, held_from)
    )
    erased = Erased(
        connections=len(rows),
        revocations_queued=queued,
        flows=int(getattr(flows, "rowcount", 0)),
        sessions=sessions,
        audit_events=int(getattr(events, "rowcount", 0)),
    )
    await audit.record(
        session, "user.erased", actor=actor, principal=principal, detail=erased.summary()
    )
    return erased
