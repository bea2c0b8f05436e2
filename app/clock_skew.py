"""This process's clock against PostgreSQL's, checked by the housekeeping.

Replicas decide leases by their own clocks: a flow's exchange (60 s), a revocation's claim
(120 s), a webhook's claim (30 s). A replica whose clock runs ahead of the others by more than a
lease takes over work another replica still holds (a webhook event posted twice, a grant revoked
twice); one behind holds its own leases too long. The broker cannot correct a clock, so it makes a
wrong one visible: the difference to the database's clock, which every replica shares, is the
gauge `broker_clock_skew_seconds`, and past SKEW_WARN_SECONDS each housekeeping round logs
`clock.skew`. On SQLite every process runs on one machine, with one clock: nothing to compare.
"""

from __future__ import annotations

import logging
from datetime import datetime

from sqlalchemy import func, select
from sqlalchemy.ext.asyncio import AsyncEngine

from app.clock import utcnow

logger = logging.getLogger("broker")

SKEW_WARN_SECONDS = 5.0  # well inside the shortest lease; NTP keeps clocks within milliseconds
DATABASE_CLOCK = select(func.clock_timestamp())  # the time now, not the transaction's start


async def measure(engine: AsyncEngine) -> float:
    """Seconds this process's clock is ahead of PostgreSQL's (behind: negative), measured at the
    middle of the round trip."""
    async with engine.connect() as connection:
        sent = utcnow()
        database_time: datetime = (await connection.execute(DATABASE_CLOCK)).scalar_one()
        answered = utcnow()
    middle = sent + (answered - sent) / 2
    return (middle - database_time).total_seconds()


async def check(engine: AsyncEngine) -> float:
    """`measure`, logged as `clock.skew` past SKEW_WARN_SECONDS either way."""
    skew = await measure(engine)
    if abs(skew) > SKEW_WARN_SECONDS:
        logger.warning(
            "clock.skew seconds=%+.1f: this process's clock differs from the database's by more "
            "than %.0f s; replicas decide leases by their clocks, so synchronise them (NTP)",
            skew,
            SKEW_WARN_SECONDS,
        )
    return skew
