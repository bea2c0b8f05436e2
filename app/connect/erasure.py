"""Erasing a user (`connect-broker users erase`, `DELETE /api/v1/admin/users`): one definition,
one transaction.

Every connection is removed with its grant queued for revocation at the provider (the
housekeeping asks it, as after a disconnect; a queued revocation keeps the user's issuer and
subject until the provider confirms or it is given up); every flow, account choice and browser
session is deleted; the user's audit events older than `[audit] erase_hold_days` are deleted, the
recent ones stay for investigations until the retention sweep takes them; and a `user.erased`
event records what was removed.

The flows go first. A completion stores its connection in the transaction that moves its flow to
`completed`, and only if that move found the flow (app/connect/service.py `transition`, then
`credentials.store` for the winner: app/pages/connect.py, app/connect/oauth_service.py). Deleting
the flows waits for a completion in progress (PostgreSQL: its flow's row lock; SQLite: the write
lock), so its connection is there when the connections are read; a completion after it finds no
flow and stores nothing. Read first, the connections would miss that one, left usable with no
revocation queued. The account choices (all of the user's, those of an account no connection has
any more too) go last: a completion writes its flow before its connection, and
`credentials.choose_account` its connection before its choice (writing none for a connection
removed meanwhile), so the locks are taken in one order and the erasure cannot deadlock with
either, nor leave a choice behind.
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
from app.tables import account_choices as choices_table
from app.tables import audit as audit_table
from app.tables import connections as connections_table
from app.tables import flows as flows_table


@dataclass(frozen=True)
class Erased:
    """What an erasure removed, by kind."""

    connections: int
    revocations_queued: int
    account_choices: int
    flows: int
    sessions: int
    audit_events: int

    def summary(self) -> str:
        return (
            f"connections={self.connections} revocations_queued={self.revocations_queued} "
            f"account_choices={self.account_choices} flows={self.flows} "
            f"sessions={self.sessions} audit_events={self.audit_events}"
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
    issuer, subject = principal.issuer, principal.subject
    flows = await session.execute(flows_table.remove_of_owner(issuer, subject))  # first: above
    choices = (await session.execute(choices_table.count_of_user(issuer, subject))).scalar_one()
    rows = list((await session.execute(connections_table.of_user(issuer, subject))).scalars())
    queued = 0
    for row in rows:
        queued += await remove_connection(
            session, row, sealing=sealing, providers=providers, actor=actor, event=None
        )
    await session.execute(choices_table.of_user(issuer, subject))  # those of no connection too
    sessions = await browser.end_all(session, principal)
    held_from = utcnow() - timedelta(days=hold_days)
    events = await session.execute(audit_table.remove_of_user(issuer, subject, held_from))
    erased = Erased(
        connections=len(rows),
        revocations_queued=queued,
        account_choices=int(choices),
        flows=int(getattr(flows, "rowcount", 0)),
        sessions=sessions,
        audit_events=int(getattr(events, "rowcount", 0)),
    )
    await audit.record(
        session, "user.erased", actor=actor, principal=principal, detail=erased.summary()
    )
    return erased
