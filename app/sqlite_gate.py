"""SQLite's write lock, taken in turn by the writers of one process.

SQLite lets one connection write at a time. A connection that finds the lock taken polls for it,
sleeping longer between tries (up to 100 ms), and whichever writer asks at the right moment goes
first: under a steady stream of short writes a writer that has waited longest can keep missing
the lock until its wait runs out (25 people signing in at once, with tool calls going on, had a
sign-in wait 4.4 s and fail). So the writers of this process queue here first, first come first
served (an asyncio.Lock wakes its waiters in order): a SQLAlchemy transaction from its first
writing statement until it commits or rolls back, the direct store for each batch it commits.
SQLite's own polling is left only between processes (the CLI beside a running broker) and for the
moment a commit takes to finish after its turn is handed on.
"""

from __future__ import annotations

import asyncio
import os
import sqlite3
import time
import weakref
from typing import Any

from sqlalchemy import event
from sqlalchemy.engine import Connection
from sqlalchemy.ext.asyncio import AsyncEngine
from sqlalchemy.pool import ConnectionPoolEntry
from sqlalchemy.util import await_

HELD = "connect_broker.write_turn"  # key in a pooled connection's info: the lock it holds
BUSY_MS = "connect_broker.busy_timeout_ms"  # key in its info: its SQLite busy timeout now
# A writer that queued longer than this gives SQLite's own wait only what is left of its bound
QUEUE_SLACK_SECONDS = 0.25
WRITING_VERBS = frozenset({"INSERT", "UPDATE", "DELETE", "REPLACE"})


class WriteTurnTimeout(sqlite3.OperationalError):
    """The process's other writers kept SQLite's write lock longer than a request may wait.

    SQLite's own "database is locked", so that SQLAlchemy reports it as any lock timeout (an
    OperationalError, answered 503) and keeps the connection; a TimeoutError would make it
    drop the connection as if the request had been cancelled."""


class WriteGate:
    """One FIFO lock per event loop (tests and the CLI run several loops in one process)."""

    def __init__(self, wait_seconds: float) -> None:
        self.wait_seconds = wait_seconds
        self._locks: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, asyncio.Lock] = (
            weakref.WeakKeyDictionary()
        )

    def _lock(self) -> asyncio.Lock:
        loop = asyncio.get_running_loop()
        lock = self._locks.get(loop)
        if lock is None:
            lock = self._locks[loop] = asyncio.Lock()
        return lock

    async def acquire(self) -> tuple[asyncio.Lock, float]:
        """Wait for this process's turn to write: the lock to release when done, and how many
        seconds SQLite's own wait may still take, so that both waits together stay within
        `wait_seconds` (plus QUEUE_SLACK_SECONDS).

        Raises:
            WriteTurnTimeout: not our turn within `wait_seconds`.
        """
        lock = self._lock()
        started = time.monotonic()
        try:
            async with asyncio.timeout(self.wait_seconds):
                await lock.acquire()
        except TimeoutError:
            raise WriteTurnTimeout("waited too long for SQLite's write lock") from None
        queued = time.monotonic() - started
        left = self.wait_seconds - queued if queued > QUEUE_SLACK_SECONDS else self.wait_seconds
        return lock, max(left, 0.001)


_gates: dict[str, WriteGate] = {}


def gate_for(database_path: str, wait_seconds: float) -> WriteGate:
    """The one gate of this process for the SQLite file at `database_path`."""
    key = os.path.abspath(database_path)
    gate = _gates.get(key)
    if gate is None:
        gate = _gates[key] = WriteGate(wait_seconds)
    return gate


def writes(statement: str) -> bool:
    verb = statement.lstrip()[:7].upper()
    return any(verb.startswith(word) for word in WRITING_VERBS)


def gate_transactions(engine: AsyncEngine, gate: WriteGate, *, busy_timeout: float) -> None:
    """Make each of `engine`'s transactions wait for its turn at its first writing statement,
    and hand the turn on when it commits or rolls back (or its connection goes back to the pool
    or is dropped, whichever comes first). `busy_timeout`: the engine's SQLite busy timeout."""
    sync_engine = engine.sync_engine
    full_wait_ms = int(busy_timeout * 1000)

    def take_turn(
        connection: Connection,
        _cursor: Any,
        statement: str,
        _parameters: Any,
        _context: Any,
        _executemany: bool,
    ) -> None:
        info = connection.info
        if HELD in info or not writes(statement):
            return
        # runs inside SQLAlchemy's greenlet on the event loop: await_ waits for the turn
        info[HELD], left_seconds = await_(gate.acquire())
        busy_ms = min(int(left_seconds * 1000), full_wait_ms)
        if info.get(BUSY_MS, full_wait_ms) != busy_ms:  # set only after a long queue, and back
            cursor = connection.connection.cursor()
            try:
                cursor.execute(f"PRAGMA busy_timeout = {busy_ms}")
            finally:
                cursor.close()
            info[BUSY_MS] = busy_ms

    def end_turn(connection: Connection) -> None:
        if not connection.invalidated:  # an invalidated one was handed on by the pool's event
            _hand_on(connection.info)

    def end_turn_of_record(_dbapi: Any, record: ConnectionPoolEntry | None, *_: Any) -> None:
        if record is not None:
            _hand_on(record.info)

    event.listen(sync_engine, "before_cursor_execute", take_turn)
    event.listen(sync_engine, "commit", end_turn)
    event.listen(sync_engine, "rollback", end_turn)
    event.listen(sync_engine.pool, "checkin", end_turn_of_record)
    event.listen(sync_engine.pool, "invalidate", end_turn_of_record)
    event.listen(sync_engine.pool, "close", end_turn_of_record)


def _hand_on(info: dict[Any, Any]) -> None:
    lock: asyncio.Lock | None = info.pop(HELD, None)
    if lock is not None and lock.locked():
        lock.release()
