"""The direct store on SQLite: one connection used on the event loop's own thread.

These statements take tens of microseconds on a local WAL database, less than handing them to a
worker thread would. Readers never wait under WAL; a writer can find the write lock held by another
connection (a SQLAlchemy transaction, the CLI). The loop's connection therefore never waits
(`busy_timeout = 0`): when SQLite answers "busy", the work is retried on a worker thread that may
wait for the lock (as long as app/db.py's statement bound), and the event loop keeps serving other
requests meanwhile.

Reads are batched by loop turn: the reads issued during one turn run together at the start of
the next, in one read transaction (one snapshot of the database, one lock of the WAL index instead
of a lock pair per statement), and their requests resume together. So their answers leave the
process back to back, as PostgreSQL's batched answers do: a client sleeping on several connections
is woken once for all of them, not once per answer, and under load that wakeup cost more CPU than
the statement itself (`python -m bench.run`, credential fetch: 0.10 → 0.08 ms of CPU per request,
9,988 → 11,863 req/s on one worker).

Writes are group-committed: inserts issued during one turn of the event loop share one
transaction, committed on the next turn (a commit costs more than the insert itself). Each insert
succeeds or fails alone: SQLite backs out a failed statement without ending the transaction.
The loop's connection never checkpoints the WAL itself (a checkpoint syncs the database file to
disk, milliseconds the loop would stand still): a passive checkpoint runs on the worker thread
a second after writes. SQLite starts the WAL file over only after a checkpoint that copied every
frame, and under a flood of writes a commit always lands beside the checkpoint: the file grew
without end (874 MB in 8 s of 16,000 new flows a second). So once a checkpoint leaves the WAL
past WAL_LIMIT_BYTES, a second one runs at once in this process's write turn (it copies only
what came in during the first, a short pause for writers); the next write then starts the file
over, cut back to WAL_LIMIT_BYTES (`journal_size_limit`). That second checkpoint syncs the database
file, and with it every page the earlier checkpoints copied: the files are synced just before it,
outside the write turn, so writers wait for a few pages' sync only.
Datetimes are stored as SQLAlchemy's SQLite dialect stores them: naive UTC, "YYYY-MM-DD
HH:MM:SS.ffffff", so comparisons in SQL stay lexical and match.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import sqlite3
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, TypeVar

from sqlalchemy.dialects import sqlite

from app.db import STATEMENT_WAIT_SECONDS, WAL_LIMIT_BYTES, set_sqlite_options
from app.direct.batching import LoopBatcher
from app.direct.compiled import Compiled
from app.direct.records import (
    OPEN_CHECK_CHUNK,
    ConnectionRecord,
    FlowRecord,
    NewFlow,
    RowReader,
    ServiceRecord,
    StoreUnavailable,
    insert_values,
    open_check_chunks,
)
from app.sqlite_gate import WriteTurnTimeout, gate_for
from app.tables import audit, connections, flows, services

T = TypeVar("T")

WAIT_FOR_LOCK_MS = STATEMENT_WAIT_SECONDS * 1000
CHECKPOINT_DELAY_SECONDS = 1.0
BUSY_CODES = (sqlite3.SQLITE_BUSY, sqlite3.SQLITE_LOCKED)

# One read-only descriptor per database file, for fsync, never closed: closing any descriptor of a
# file drops all of the process's POSIX locks on it, SQLite's own included.
_DATABASE_FILES: dict[str, int] = {}
_DATABASE_FILES_LOCK = threading.Lock()

# The tables' statements (app/tables/), compiled for sqlite3: one call each (a loop turn's calls
# share a transaction instead). qmark parameters, bound by position: binding by name looks each
# name up again on every execution.
DIALECT = sqlite.dialect()
FIND_CONNECTION = Compiled(connections.find_one(), DIALECT)
INSERT_FLOW = Compiled(flows.insert_one(), DIALECT)
FIND_REUSABLE_FLOW = Compiled(flows.reusable_one(), DIALECT)
RECORD_NEW_FLOW = Compiled(audit.for_new_flow(), DIALECT)
GET_FLOW_AND_CONNECTION = Compiled(flows.read_one(), DIALECT)
OPEN_AMONG = Compiled(flows.open_among(), DIALECT, expand={"ids": OPEN_CHECK_CHUNK})


def stored_time(value: datetime) -> str:
    return value.astimezone(UTC).replace(tzinfo=None).isoformat(" ", "microseconds")


def read_time(value: str) -> datetime:
    return datetime.fromisoformat(value).replace(tzinfo=UTC)


READ_CONNECTION = RowReader(FIND_CONNECTION, read_time)
READ_FLOW = RowReader(GET_FLOW_AND_CONNECTION, read_time)
READ_REUSABLE_FLOW = RowReader(FIND_REUSABLE_FLOW, read_time)


@functools.cache
def find_service(digests: int) -> tuple[Compiled, RowReader]:
    """The service lookup for `digests` digests (one per signing key: a handful, made once)."""
    compiled = Compiled(services.find_one(), DIALECT, expand={"digests": digests})
    return compiled, RowReader(compiled, read_time)


@functools.cache
def find_service_and_connection(digests: int) -> tuple[Compiled, RowReader]:
    compiled = Compiled(services.find_with_connection_one(), DIALECT, expand={"digests": digests})
    return compiled, RowReader(compiled, read_time)


def _is_busy(exc: sqlite3.OperationalError) -> bool:
    return getattr(exc, "sqlite_errorcode", 0) & 0xFF in BUSY_CODES


@dataclass(slots=True)
class _Statement:
    statement: str
    values: tuple[Any, ...]
    then: _Statement | None = None  # run in the same transaction when this one changed a row


def _read_all(connection: sqlite3.Connection, reads: list[_Statement]) -> list[Any]:
    """The first row (or None) of each read, all in one read transaction."""
    if len(reads) == 1:
        return [connection.execute(reads[0].statement, reads[0].values).fetchone()]
    return _in_read_transaction(
        connection,
        lambda: [connection.execute(read.statement, read.values).fetchone() for read in reads],
    )


def _in_read_transaction(connection: sqlite3.Connection, read: Callable[[], T]) -> T:
    """`read()` in one read transaction (one snapshot), ended whatever happens."""
    connection.execute("BEGIN")
    try:
        result = read()
        connection.execute("COMMIT")
    except BaseException:
        _roll_back(connection)
        raise
    return result


def _roll_back(connection: sqlite3.Connection) -> None:
    if connection.in_transaction:
        with contextlib.suppress(sqlite3.Error):  # the original error is the one to report
            connection.execute("ROLLBACK")


def _apply(connection: sqlite3.Connection, writes: list[_Statement]) -> list[int | Exception]:
    """Run `writes` in one transaction; each gets its row count or its own error.

    A write refused by a constraint is that write's own fault: SQLite backs out the statement
    and the others go on. Once a write has changed a row, its `then` must follow it or the row
    must go: a `then` that fails ends the whole transaction (the batcher then runs each write
    alone), so no row is ever committed without its companion (a flow without its event)."""
    outcomes: list[int | Exception] = []
    connection.execute("BEGIN IMMEDIATE")
    try:
        for write in writes:
            try:
                changed = connection.execute(write.statement, write.values).rowcount
            except sqlite3.IntegrityError as exc:  # this row's own fault; others go on
                outcomes.append(exc)
                continue
            if changed and write.then is not None:
                connection.execute(write.then.statement, write.then.values)
            outcomes.append(changed)
        connection.execute("COMMIT")
    except BaseException:
        _roll_back(connection)
        raise
    return outcomes


class SqliteStore:
    def __init__(self, path: str) -> None:
        self._path = path
        self._loop_connection: sqlite3.Connection | None = None
        self._reads: LoopBatcher[_Statement, Any] = LoopBatcher(
            self._read_batch, shared_failures=(StoreUnavailable,)
        )
        self._writes: LoopBatcher[_Statement, int] = LoopBatcher(
            self._commit, shared_failures=(StoreUnavailable,)
        )
        self._checkpoint: asyncio.TimerHandle | None = None
        self._checkpoints: set[asyncio.Task[None]] = set()
        self._waiter = ThreadPoolExecutor(max_workers=1, thread_name_prefix="sqlite-wait")
        self._waiter_local = threading.local()
        self._gate = gate_for(path, STATEMENT_WAIT_SECONDS)  # shared with the engine's writers

    def _connect(self, busy_timeout_ms: int) -> sqlite3.Connection:
        connection = sqlite3.connect(
            self._path, isolation_level=None, check_same_thread=False, cached_statements=32
        )
        set_sqlite_options(
            connection, busy_timeout_ms=busy_timeout_ms, wal_limit_bytes=WAL_LIMIT_BYTES
        )
        if busy_timeout_ms == 0:  # the loop's connection: checkpoints belong to the worker
            connection.execute("PRAGMA wal_autocheckpoint = 0")
        return connection

    def _on_loop(self) -> sqlite3.Connection:
        if self._loop_connection is None:
            self._loop_connection = self._connect(busy_timeout_ms=0)
        return self._loop_connection

    def _on_waiter(self) -> sqlite3.Connection:
        connection: sqlite3.Connection | None = getattr(self._waiter_local, "connection", None)
        if connection is None:
            connection = self._waiter_local.connection = self._connect(WAIT_FOR_LOCK_MS)
        return connection

    async def _run(
        self, use: Callable[[sqlite3.Connection], T], wait_ms: int = WAIT_FOR_LOCK_MS
    ) -> T:
        """`use` on the loop's connection, or, if SQLite is busy, on the worker thread's, which
        waits up to `wait_ms` for the lock."""
        try:
            try:
                return use(self._on_loop())
            except sqlite3.OperationalError as exc:
                if not _is_busy(exc):
                    raise
            loop = asyncio.get_running_loop()
            return await loop.run_in_executor(self._waiter, lambda: use(self._waiting(wait_ms)))
        except (sqlite3.IntegrityError, sqlite3.ProgrammingError, sqlite3.InterfaceError):
            raise  # a constraint or a bug, not the database being unavailable
        except sqlite3.DatabaseError as exc:  # locked, I/O, full, corrupt, not a database …
            raise StoreUnavailable(f"sqlite: {exc}") from exc

    def _read(self, statement: str, values: tuple[Any, ...]) -> asyncio.Future[Any]:
        """The first row of `statement` (or None), read with the other reads of this loop turn."""
        return self._reads.submit(_Statement(statement, values))

    async def _read_batch(self, reads: list[_Statement]) -> list[Any]:
        return await self._run(lambda c: _read_all(c, reads))

    def _write(self, write: _Statement) -> asyncio.Future[int]:
        """The row count of `write`, committed with the other writes of this loop turn."""
        return self._writes.submit(write)

    async def _commit(self, writes: list[_Statement]) -> list[int | Exception]:
        try:
            turn, left_seconds = await self._gate.acquire()
        except WriteTurnTimeout as exc:
            raise StoreUnavailable(f"sqlite: {exc}") from exc
        try:
            outcomes = await self._run(lambda c: _apply(c, writes), int(left_seconds * 1000))
        finally:
            turn.release()
        self._schedule_checkpoint()
        return outcomes

    def _schedule_checkpoint(self) -> None:
        if self._checkpoint is None:
            loop = asyncio.get_running_loop()
            self._checkpoint = loop.call_later(CHECKPOINT_DELAY_SECONDS, self._start_checkpoint)

    def _start_checkpoint(self) -> None:
        self._checkpoint = None
        task = asyncio.get_running_loop().create_task(self._checkpoint_and_limit())
        self._checkpoints.add(task)  # the loop keeps only a weak reference to a task
        task.add_done_callback(self._checkpoints.discard)

    async def _checkpoint_and_limit(self) -> None:
        """A passive checkpoint; if the WAL is still past its limit, the files synced, then one
        more checkpoint in our write turn, so that it copies every frame and the next write starts
        the file over. A failure or a turn not given in time leaves it to the next checkpoint."""
        loop = asyncio.get_running_loop()
        try:
            wal_bytes = await loop.run_in_executor(self._waiter, self._checkpoint_wal)
            if wal_bytes <= WAL_LIMIT_BYTES:
                return
            await loop.run_in_executor(self._waiter, self._sync_files)
            turn, _ = await self._gate.acquire()
            try:
                await loop.run_in_executor(self._waiter, self._checkpoint_wal)
            finally:
                turn.release()
        except (sqlite3.Error, OSError, WriteTurnTimeout):
            return

    def _waiting(self, wait_ms: int) -> sqlite3.Connection:
        connection = self._on_waiter()
        connection.execute(f"PRAGMA busy_timeout = {min(wait_ms, WAIT_FOR_LOCK_MS)}")
        return connection

    def _sync_files(self) -> None:
        """fsync the database file and the WAL. The checkpoint that copies the last frame syncs
        the database file, under the write lock: synced here first, that costs the pages it copies
        itself, not every page the checkpoints before it left in the page cache (measured on the
        round-1 benchmark: 6-22 ms in the write turn before, 3-9 ms after)."""
        with _DATABASE_FILES_LOCK:
            database = _DATABASE_FILES.get(self._path)
            if database is None:
                database = _DATABASE_FILES[self._path] = os.open(self._path, os.O_RDONLY)
        os.fsync(database)
        wal = os.open(self._path + "-wal", os.O_RDONLY)  # SQLite takes no locks on this file
        try:
            os.fsync(wal)
        finally:
            os.close(wal)

    def _checkpoint_wal(self) -> int:
        """A passive checkpoint: the size of the WAL it found, in bytes."""
        connection = self._on_waiter()
        _busy, frames, _copied = connection.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchone()
        (page_size,) = connection.execute("PRAGMA page_size").fetchone()
        return int(frames) * int(page_size)

    async def find_connection(
        self, issuer: str, subject: str, provider: str, audience: str
    ) -> ConnectionRecord | None:
        key = (issuer, subject, provider, audience)
        params = {"issuer": issuer, "subject": subject, "provider": provider, "audience": audience}
        row = await self._read(FIND_CONNECTION.sql, FIND_CONNECTION.values(params))
        return READ_CONNECTION.connection(key, row) if row is not None else None

    async def insert_flow(self, flow: NewFlow, *, max_open: int) -> bool:
        values = INSERT_FLOW.values(insert_values(flow, max_open, stored_time))
        event = RECORD_NEW_FLOW.values({"id": flow.id, "request_id": flow.request_id})
        write = _Statement(INSERT_FLOW.sql, values, _Statement(RECORD_NEW_FLOW.sql, event))
        return await self._write(write) == 1

    async def find_reusable_flow(self, flow: NewFlow) -> FlowRecord | None:
        statement = FIND_REUSABLE_FLOW
        values = statement.values(insert_values(flow, 0, stored_time))
        row = await self._read(statement.sql, values)
        return READ_REUSABLE_FLOW.flow(row) if row is not None else None

    async def get_flow_and_connection(
        self, flow_id: str
    ) -> tuple[FlowRecord, ConnectionRecord | None] | None:
        statement = GET_FLOW_AND_CONNECTION
        row = await self._read(statement.sql, statement.values({"id": flow_id}))
        return READ_FLOW.flow_and_connection(row) if row is not None else None

    async def still_open(self, flow_ids: list[str]) -> set[str]:
        now = stored_time(datetime.now(UTC))
        reads = [
            OPEN_AMONG.values({"ids": chunk, "now": now}) for chunk in open_check_chunks(flow_ids)
        ]
        rows = await self._run(
            lambda c: _in_read_transaction(
                c, lambda: [row for values in reads for row in c.execute(OPEN_AMONG.sql, values)]
            )
        )
        return {flow_id for (flow_id,) in rows}

    async def find_service(self, digests: list[str]) -> ServiceRecord | None:
        statement, read = find_service(len(digests))
        row = await self._read(statement.sql, statement.values({"digests": digests}))
        return read.service(row) if row is not None else None

    async def find_service_and_own_connection(
        self, digests: list[str], issuer: str, subject: str, provider: str
    ) -> tuple[ServiceRecord, ConnectionRecord | None] | None:
        statement, read = find_service_and_connection(len(digests))
        params = {"digests": digests, "issuer": issuer, "subject": subject, "provider": provider}
        row = await self._read(statement.sql, statement.values(params))
        if row is None:
            return None
        return read.service_and_connection((issuer, subject, provider), row)

    async def close(self) -> bool:
        if self._checkpoint is not None:
            self._checkpoint.cancel()
            self._checkpoint = None
        for task in list(self._checkpoints):
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self._loop_connection is not None:
            self._loop_connection.close()
            self._loop_connection = None
        await asyncio.get_running_loop().run_in_executor(self._waiter, self._close_waiter)
        self._waiter.shutdown(wait=False)
        return True

    def _close_waiter(self) -> None:
        connection: sqlite3.Connection | None = getattr(self._waiter_local, "connection", None)
        if connection is not None:
            connection.close()
            self._waiter_local.connection = None
