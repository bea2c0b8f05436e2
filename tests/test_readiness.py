"""GET /readyz: ready while the database answers and its schema is the one this version runs on."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from sqlalchemy import text

from app.db import create_engine
from app.migrate import head_revision, shipped_revisions

from .support.broker import BrokerConfig, running_broker
from .support.http import local_get

pytestmark = pytest.mark.both_databases


def stamp(url: str, revision: str) -> None:
    async def update() -> None:
        engine = create_engine(url, pool_size=1)
        try:
            async with engine.begin() as connection:
                await connection.execute(
                    text("UPDATE alembic_version SET version_num = :revision"),
                    {"revision": revision},
                )
        finally:
            await engine.dispose()

    asyncio.run(update())


def test_readyz_is_unavailable_on_a_schema_other_than_its_own(tmp_path: Path) -> None:
    """An older schema (a version's `migrate` not run yet) or a newer one (a newer version
    migrated it, during an upgrade) is 503: this process's statements are its own schema's, and
    the load balancer should send requests to the replicas that match it."""
    config = BrokerConfig(issuer="http://127.0.0.1:1")
    answers: dict[str, tuple[int, dict[str, str]]] = {}
    with running_broker(config, tmp_path) as broker:
        for name, revision in [
            ("current", head_revision()),
            ("older", shipped_revisions()[-2]),
            ("newer", "f00dfeed"),
            ("current again", head_revision()),
        ]:
            stamp(broker.database_url, revision)
            answer = local_get(f"{broker.url}/readyz", timeout=5)
            answers[name] = (answer.status_code, answer.json())

    ready = (200, {"status": "ready"})
    assert answers == {
        "current": ready,
        "older": (503, {"status": "unavailable", "database": "schema_outdated"}),
        "newer": (503, {"status": "unavailable", "database": "schema_newer"}),
        "current again": ready,
    }
