"""SQLite's write lock is taken in arrival order by the writers of one process (app/sqlite_gate.py):
SQLAlchemy transactions and the direct store queue for it, and a writer's queueing and SQLite's
own wait together stay within one bound. (SQLite only: PostgreSQL has row locks.)"""

from __future__ import annotations

import asyncio
import contextlib
import sqlite3
import threading
import time
from pathlib import Path

import pytest
from sqlalchemy import text
from sqlalchemy.exc import OperationalError
from sqlalchemy.ext.asyncio import AsyncEngine

from app import db as app_db
from app.auth.principal import McpCaller, Principal
from app.connect import service as flows
from app.direct import open_direct_store
from app.migrate import upgrade
from app.sqlite_gate import WriteTurnTimeout, writes

HOLD_SECONDS = 0.5  # how long the first writer keeps its transaction open
BOUND_SECONDS = 0.5  # the statement wait, lowered for these tests
# The ordering test's bound: its first writer queues behind the holder for nearly HOLD_SECONDS,
# and only the order is under test, so a slow commit on a busy machine must not time it out
ORDER_BOUND_SECONDS = 4 * HOLD_SECONDS
# The queueing test's bound: long beside a busy machine's delays, which it tells from a second wait
QUEUE_BOUND_SECONDS = 1.0


@pytest.fixture
def bound() -> float:
    """The statement wait of the test's database (a test may parametrize its own)."""
    return BOUND_SECONDS


@pytest.fixture
async def database(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, bound: float) -> str:
    """A migrated SQLite file with a `turns` table recording who wrote in which order (a flow
    inserted by the direct store records itself there too)."""
    url = f"sqlite:///{tmp_path / 'gate.db'}"
    # Before the migration, which opens an engine and so makes this file's gate (one per file
    # and process, with the bound of that moment).
    monkeypatch.setattr(app_db, "STATEMENT_WAIT_SECONDS", bound)
    await asyncio.to_thread(upgrade, url)
    with contextlib.closing(sqlite3.connect(tmp_path / "gate.db")) as connection:
        connection.execute("CREATE TABLE turns (n INTEGER PRIMARY KEY AUTOINCREMENT, who TEXT)")
        connection.execute(
            "CREATE TRIGGER flow_turn AFTER INSERT ON flows"
            " BEGIN INSERT INTO turns (who) VALUES ('direct'); END"
        )
        connection.commit()
    return url


async def write_turn(engine: AsyncEngine, who: str, *, hold: float = 0.0) -> None:
    async with engine.begin() as connection:
        await connection.execute(text("INSERT INTO turns (who) VALUES (:who)"), {"who": who})
        await asyncio.sleep(hold)


async def turns(engine: AsyncEngine) -> list[str]:
    async with engine.connect() as connection:
        return list((await connection.execute(text("SELECT who FROM turns ORDER BY n"))).scalars())


def caller(subject: str) -> McpCaller:
    return McpCaller(
        principal=Principal("https://idp.example", subject), client_id="c", scopes=frozenset()
    )


@pytest.mark.parametrize("bound", [ORDER_BOUND_SECONDS])
async def test_writers_get_the_lock_in_the_order_they_asked_for_it(database: str) -> None:
    """While one transaction holds the lock, three writers arrive 0, 0.35 and 0.45 s later: a
    transaction, the direct store's flow insert, a transaction. They write in that order. Left
    to SQLite's polling, the last one, which polls most often when the lock comes free, goes
    first."""
    engine = app_db.create_engine(database, pool_size=4)
    store = open_direct_store(database, pool_size=2)

    async def after(delay: float, name: str) -> None:
        await asyncio.sleep(delay)
        if name == "direct":
            await flows.create(
                store,
                caller=caller("gate"),
                client_name=None,
                provider="demo",
                scopes=(),
                tool_name="connect_account",
                args_digest="d" * 64,
                ttl_seconds=600,
            )
        else:
            await write_turn(engine, name)

    try:
        holder = asyncio.create_task(write_turn(engine, "holder", hold=HOLD_SECONDS))
        await asyncio.sleep(0.05)  # the holder has the lock
        await asyncio.gather(
            holder, after(0.0, "first"), after(0.35, "direct"), after(0.45, "third")
        )
        written = await turns(engine)
    finally:
        await store.close()
        await engine.dispose()

    assert written == ["holder", "first", "direct", "third"]


@pytest.mark.parametrize("bound", [QUEUE_BOUND_SECONDS])
async def test_a_writer_queued_behind_a_blocked_one_answers_within_one_bound(
    database: str, tmp_path: Path, bound: float
) -> None:
    """Another process (here a thread's own connection) holds the lock for 4 bounds. The first
    writer waits its bound in SQLite and fails; the one queued behind it fails by then too,
    instead of starting a full SQLite wait of its own (two bounds). Both keep their connections:
    the pool serves the next writer once the lock is free. The times are compared with each
    other, not with the clock: a busy machine slows both."""
    engine = app_db.create_engine(database, pool_size=4)
    release = threading.Event()
    taken = threading.Event()

    def hold_elsewhere() -> None:
        with contextlib.closing(
            sqlite3.connect(tmp_path / "gate.db", isolation_level=None)
        ) as other:
            other.execute("BEGIN IMMEDIATE")
            taken.set()
            release.wait(bound * 4)
            other.execute("ROLLBACK")

    async def timed(name: str) -> tuple[BaseException | None, float]:
        started = time.monotonic()
        try:
            await write_turn(engine, name)
        except OperationalError as exc:
            return exc, time.monotonic() - started
        return None, time.monotonic() - started

    holder = threading.Thread(target=hold_elsewhere)
    holder.start()
    try:
        await asyncio.to_thread(taken.wait, 5)
        first = asyncio.create_task(timed("first"))
        await asyncio.sleep(0.05)
        (first_error, first_seconds), (second_error, second_seconds) = await asyncio.gather(
            first, timed("second")
        )
        release.set()
        await asyncio.to_thread(holder.join, 5)
        await write_turn(engine, "after")
        written = await turns(engine)
    finally:
        release.set()
        await engine.dispose()

    assert isinstance(first_error, OperationalError) and isinstance(second_error, OperationalError)
    assert "database is locked" in str(first_error.orig)
    # the second runs out of time in SQLite's own wait or, on a busy machine, still in the queue
    assert isinstance(second_error.orig, WriteTurnTimeout) or "database is locked" in str(
        second_error.orig
    )
    assert first_seconds >= bound * 0.9  # it waited its bound in SQLite
    # queued 0.05 s behind the first, it ends with it: a wait of its own would end a bound later
    assert second_seconds < first_seconds + bound / 2
    assert written == ["after"]


@pytest.mark.parametrize(
    ("statement", "expected"),
    [
        ("INSERT INTO flows VALUES (1)", True),
        ("  update flows SET x = 1", True),
        ("DELETE FROM flows", True),
        ("REPLACE INTO t VALUES (1)", True),
        ("SELECT * FROM flows", False),
        ("PRAGMA busy_timeout = 5", False),
        ("WITH x AS (SELECT 1) SELECT * FROM x", False),
    ],
)
def test_only_writing_statements_queue(statement: str, expected: bool) -> None:
    assert writes(statement) is expected
