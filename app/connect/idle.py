"""`[connections] max_idle_days`: connections nobody used for that long are revoked.

Use is noted in memory where a credential is handed out (`UsageLog.note`: one set lookup, no
statement: the credential fetch stays one read), and the housekeeping writes it once a minute,
as the day of use (midnight UTC), to connections not already marked used that day: at most one
write per connection a day across all processes. A process that stops loses at most a minute of
notes. A connection is idle when neither its last day of use nor the last time its user
connected or chose that account (`selected_at`: its creation, a new grant of the same account, a
choice among several) is on or after midnight `max_idle_days` days ago: at least that many whole
days pass without use.
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import UTC, datetime, timedelta

from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from app import audit
from app.clock import utcnow
from app.connect.removal import remove_connection
from app.crypto import Keyring
from app.providers.settings import ProviderSettings
from app.tables import connections as connections_table

IDLE_CHUNK = 100  # connections removed per transaction


def today() -> datetime:
    now = utcnow()
    return datetime(now.year, now.month, now.day, tzinfo=UTC)


class UsageLog:
    """The connections this process handed a credential of, not yet written as used today."""

    def __init__(self) -> None:
        self._day = today()
        self._noted: set[int] = set()  # noted today (written or pending)
        self._pending: set[int] = set()

    def note(self, connection_id: int) -> None:
        if connection_id not in self._noted:
            self._noted.add(connection_id)
            self._pending.add(connection_id)

    async def flush(self, sessions: async_sessionmaker[AsyncSession]) -> int:
        """Write the pending notes as used today; how many were pending."""
        day = today()
        if day != self._day:  # a new day: every connection may be noted once more
            self._day, self._noted = day, set(self._pending)
        pending, self._pending = sorted(self._pending), set()
        if not pending:
            return 0
        try:
            async with sessions.begin() as session:
                await session.execute(connections_table.mark_used(pending, day))
        except BaseException:
            self._pending.update(pending)  # the next flush tries again
            raise
        return len(pending)


async def revoke_idle(
    sessions: async_sessionmaker[AsyncSession],
    *,
    max_idle_days: int,
    sealing: Keyring,
    providers: Mapping[str, ProviderSettings],
) -> int:
    """Remove the idle connections (their grants queued for revocation), IDLE_CHUNK per
    transaction, each with a `connection.idle_revoked` event; how many."""
    cutoff = today() - timedelta(days=max_idle_days)
    total = 0
    while True:
        async with sessions.begin() as session:
            rows = list(
                (await session.execute(connections_table.idle_since(cutoff, IDLE_CHUNK)))
                .scalars()
                .all()
            )
            for row in rows:
                await remove_connection(
                    session,
                    row,
                    sealing=sealing,
                    providers=providers,
                    actor=audit.BROKER,
                    event="connection.idle_revoked",
                )
        total += len(rows)
        if len(rows) < IDLE_CHUNK:
            return total
