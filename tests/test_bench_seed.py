"""bench/seed.py: the large-database scenario's rows are what bench/scale.py says they are, on
the suite's database kind: counted, spread over users under the open-flow cap, untouched by the
housekeeping, and invisible to the users the benchmark measures."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from sqlalchemy import func, select

from app.auth.principal import Principal
from app.connect import service as flows
from app.connect.service import MAX_OPEN_FLOWS
from app.db import create_engine, create_sessionmaker
from app.migrate import upgrade
from app.models import OPEN_FLOW_STATUSES, Connection, Flow, FlowStatus
from bench import seed as seeding
from bench.seed import FLOWS_PER_USER, seed

from .support.broker import drop_database, fresh_database

pytestmark = pytest.mark.both_databases

ISSUER = "https://idp.example"


@pytest.fixture
async def url(tmp_path: Path) -> AsyncIterator[str]:
    url = await asyncio.to_thread(fresh_database, tmp_path, "seed")
    await asyncio.to_thread(upgrade, url)
    yield url
    await asyncio.to_thread(drop_database, url)


async def test_seeded_rows_are_counted_spread_and_survive_the_housekeeping(
    url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(seeding, "CHUNK", 70)  # several chunks, the last one partial
    await seed(url, issuer=ISSUER, flows=1000, connections=150)
    engine = create_engine(url, pool_size=1)
    sessions = create_sessionmaker(engine)
    try:
        await flows.purge(sessions)
        async with sessions() as session:
            flow_count = await session.scalar(select(func.count()).select_from(Flow))
            ids = await session.scalar(select(func.count(func.distinct(Flow.id))))
            counted = await session.execute(select(Flow.status, func.count()).group_by(Flow.status))
            by_status = {str(status): int(count) for status, count in counted}
            open_per_user = (
                select(func.count().label("open"))
                .where(Flow.status.in_(OPEN_FLOW_STATUSES))
                .group_by(Flow.subject)
                .subquery()
            )
            most_open = await session.scalar(select(func.max(open_per_user.c.open)))
            users = await session.scalar(select(func.count(func.distinct(Flow.subject))))
            connection_count = await session.scalar(select(func.count()).select_from(Connection))
            connected = await session.scalar(select(func.count(func.distinct(Connection.subject))))
            expired = await flows.get(session, flow_id="seed-flow-30")
            pending = await flows.get(session, flow_id="seed-flow-32")
    finally:
        await engine.dispose()
    assert (flow_count, ids) == (1000, 1000)
    assert by_status == {str(status): 250 for status in seeding.CYCLE}
    assert users == 1000 // FLOWS_PER_USER
    assert most_open is not None and 0 < most_open < MAX_OPEN_FLOWS
    assert (connection_count, connected) == (150, 150)
    # flow n belongs to user n // FLOWS_PER_USER; its status cycles: pending, completed, …
    assert expired is not None and pending is not None
    assert (expired.principal, expired.status) == (Principal(ISSUER, "seed-3"), FlowStatus.expired)
    assert (pending.status, pending.is_open) == (FlowStatus.pending, True)
