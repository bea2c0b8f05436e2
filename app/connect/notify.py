"""Wake MCP retries waiting for a flow, whichever process finished it.

A flow finished in this process wakes its waiters at once (`wake`). On PostgreSQL the finishing
transaction also runs `pg_notify('broker_flows', <flow id>)`, delivered at commit to every
replica; each process keeps one dedicated LISTEN connection (outside the pool) and sets the local
events of its waiters. For what no notification reports (another process on SQLite, a dropped
listener on PostgreSQL), each process checks every flow its retries wait for at each
`poll_interval`, in one statement for all of them: a waiter costs nothing while it waits, however
many wait. No waiter holds a pooled connection or a transaction.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import defaultdict
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

from sqlalchemy import text
from sqlalchemy.engine import make_url
from sqlalchemy.ext.asyncio import AsyncSession

from app.direct import StoreUnavailable
from app.errors import DATABASE_ERRORS

logger = logging.getLogger("broker.flows")

CHANNEL = "broker_flows"


# Which of the given flow ids are still open (the direct store's `still_open`).
StillOpen = Callable[[list[str]], Awaitable[set[str]]]


class FlowNotifier:
    """In-process fan-out of "flow X changed" to waiters, plus an optional cross-process feed.

    `still_open`: the check of the waited-for flows run every `poll_interval` once started (none:
    only `wake` and the feed end a wait early)."""

    def __init__(self, *, poll_interval: float, still_open: StillOpen | None = None) -> None:
        self.poll_interval = poll_interval
        self._still_open = still_open
        self._waiters: defaultdict[str, set[asyncio.Event]] = defaultdict(set)
        self._poller: asyncio.Task[None] | None = None

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
        if self._still_open is not None:
            self._poller = asyncio.create_task(self._poll_forever(self._still_open))

    async def stop(self) -> None:
        if self._poller is not None:
            self._poller.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._poller
            self._poller = None

    async def _poll_forever(self, still_open: StillOpen) -> None:
        """Wake the waiters of every waited-for flow that is no longer open. When the database
        does not answer, waiters end at their deadline, as without the poll."""
        failing = False  # logged once when the checks start failing, once when they recover
        while True:
            await asyncio.sleep(self.poll_interval)
            waited = list(self._waiters)
            if not waited:
                continue
            try:
                open_now = await still_open(waited)
            except (*DATABASE_ERRORS, StoreUnavailable) as exc:
                if not failing:
                    logger.warning("flows.check_failed error=%s", type(exc).__name__)
                failing = True
                continue
            if failing:
                logger.info("flows.check_recovered")
                failing = False
            for flow_id in waited:
                if flow_id not in open_now:
                    self.wake(flow_id)


class PostgresFlowNotifier(FlowNotifier):
    def __init__(
        self,
        database_url: str,
        *,
        poll_interval: float = 2.0,
        still_open: StillOpen | None = None,
    ) -> None:
        super().__init__(poll_interval=poll_interval, still_open=still_open)
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
        await super().start()
        self._task = asyncio.create_task(self._listen_forever())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        await super().stop()

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
