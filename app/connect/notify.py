"""Wake MCP retries waiting for a flow, whichever process finished it.

On PostgreSQL the finishing transaction runs `pg_notify('broker_flows', <flow id>)`, delivered at
commit to every replica; each process keeps one dedicated LISTEN connection (outside the pool) and
sets the local events of its waiters. Waiters also re-check the database at a slow interval, so a
dropped listener costs latency, never correctness. On SQLite (one process) waiters poll quickly.
No waiter holds a pooled connection or a transaction while it waits.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import defaultdict
from collections.abc import Iterator
from typing import Any

from sqlalchemy import text
from sqlalchemy.engine import make_url
from sqlalchemy.ext.asyncio import AsyncSession

logger = logging.getLogger("broker.flows")

CHANNEL = "broker_flows"


class FlowNotifier:
    """In-process fan-out of "flow X changed" to waiters, plus an optional cross-process feed."""

    def __init__(self, *, poll_interval: float) -> None:
        self.poll_interval = poll_interval
        self._waiters: defaultdict[str, set[asyncio.Event]] = defaultdict(set)

    @contextlib.contextmanager
    def subscribe(self, flow_id: str) -> Iterator[asyncio.Event]:
        """Register before checking the flow, so a change between check and wait is not lost."""
        event = asyncio.Event()
        self._waiters[flow_id].add(event)
        try:
            yield event
        finally:
            waiters = self._waiters.get(flow_id)
            if waiters is not None:
                waiters.discard(event)
                if not waiters:
                    del self._waiters[flow_id]

    def wake(self, flow_id: str) -> None:
        for event in self._waiters.get(flow_id, ()):
            event.set()

    async def publish(self, session: AsyncSession, flow_id: str) -> None:
        """Announce a change made in `session`'s transaction (seen by waiters after commit)."""
        self.wake(flow_id)

    async def start(self) -> None:
        return None

    async def stop(self) -> None:
        return None


class PostgresFlowNotifier(FlowNotifier):
    def __init__(self, database_url: str, *, poll_interval: float = 2.0) -> None:
        super().__init__(poll_interval=poll_interval)
        url = make_url(database_url)
        self._connect_args: dict[str, Any] = {
            "host": url.host or "localhost",
            "port": url.port or 5432,
            "user": url.username,
            "password": url.password,
            "database": url.database,
            "timeout": 3,
        }
        self._task: asyncio.Task[None] | None = None

    async def publish(self, session: AsyncSession, flow_id: str) -> None:
        await session.execute(
            text("SELECT pg_notify(:channel, :id)"), {"channel": CHANNEL, "id": flow_id}
        )

    async def start(self) -> None:
        self._task = asyncio.create_task(self._listen_forever())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _listen_forever(self) -> None:
        import asyncpg

        while True:
            try:
                connection = await asyncpg.connect(**self._connect_args)
            except (OSError, asyncpg.PostgresError, TimeoutError):
                await asyncio.sleep(self.poll_interval)
                continue
            lost = asyncio.Event()
            try:
                connection.add_termination_listener(lambda _c, lost=lost: lost.set())
                await connection.add_listener(CHANNEL, self._on_notify)
                await lost.wait()
            except (OSError, asyncpg.PostgresError):
                logger.warning("flows.listener_lost")
            finally:
                with contextlib.suppress(Exception):
                    await connection.close(timeout=1)

    def _on_notify(self, _connection: object, _pid: int, _channel: str, payload: str) -> None:
        self.wake(payload)
