"""The direct store on PostgreSQL: an asyncpg pool, each statement in autocommit.

The calls of one event-loop turn go as one statement (app/direct/batching.py): under load the
fixed cost of a statement (pool checkout, a round trip, the driver's protocol work) is shared by
every request of the turn instead of paid by each. A statement fails or succeeds for its whole
batch: a failed batch writes nothing, and every call in it gets the error.

Each statement is prepared once per connection (asyncpg's statement cache). A released connection
is not sent asyncpg's default `RESET ALL; UNLISTEN *; …` round trip: these statements leave no
session state behind (asyncpg still rolls back a transaction a cancelled request left open).
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from typing import Any, TypeVar

import asyncpg

from app.db import (
    CONNECT_TIMEOUT_SECONDS,
    POOL_TIMEOUT_SECONDS,
    STATEMENT_WAIT_SECONDS,
    DroppingAsyncpgDialect,
    postgres_server_settings,
)
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
from app.tables import audit, connections, flows, services

T = TypeVar("T")
ConnectionKey = tuple[str, str, str, str]  # issuer, subject, provider, audience
ServiceLookup = tuple[list[str], str, str, str]  # secret digests, issuer, subject, provider
FlowAndConnection = tuple[FlowRecord, ConnectionRecord | None]
ServiceAndConnection = tuple[ServiceRecord, ConnectionRecord | None]

CLOSE_TIMEOUT_SECONDS = 3


def as_given(value: T) -> T:
    """asyncpg answers aware datetimes already."""
    return value


UNAVAILABLE = (
    OSError,
    TimeoutError,
    asyncpg.InterfaceError,
    asyncpg.PostgresConnectionError,
    asyncpg.CannotConnectNowError,
    asyncpg.QueryCanceledError,
    asyncpg.AdminShutdownError,
    asyncpg.TooManyConnectionsError,
)

# The tables' statements (app/tables/), compiled for asyncpg. The hot ones take a batch (arrays
# bound and `unnest`ed with their positions) and answer in positions: one statement for all the
# calls of one loop turn (app/direct/batching.py).
DIALECT = DroppingAsyncpgDialect()  # type: ignore[no-untyped-call]
FIND_CONNECTIONS = Compiled(connections.find_many(), DIALECT)
INSERT_FLOWS = Compiled(audit.with_new_flows(flows.insert_many()), DIALECT)  # + their events
GET_FLOWS_AND_CONNECTIONS = Compiled(flows.read_many(), DIALECT)
FIND_REUSABLE_FLOW = Compiled(flows.reusable_one(), DIALECT)  # one call each: seldom needed
OPEN_AMONG = Compiled(flows.open_among(), DIALECT, expand={"ids": OPEN_CHECK_CHUNK})
FIND_SERVICES_AND_OWN_CONNECTIONS = Compiled(services.find_with_connection_many(), DIALECT)
READ_CONNECTIONS = RowReader(FIND_CONNECTIONS, as_given)
READ_FLOWS = RowReader(GET_FLOWS_AND_CONNECTIONS, as_given)
READ_REUSABLE_FLOW = RowReader(FIND_REUSABLE_FLOW, as_given)
READ_SERVICES = RowReader(FIND_SERVICES_AND_OWN_CONNECTIONS, as_given)
CALL = FIND_CONNECTIONS.columns["n"]
SERVICE_CALL = FIND_SERVICES_AND_OWN_CONNECTIONS.columns["n"]
FLOW_ID = GET_FLOWS_AND_CONNECTIONS.columns["id"]


@functools.cache
def find_service(digests: int) -> tuple[Compiled, RowReader]:
    """The service lookup for `digests` digests (one per signing key: a handful, made once)."""
    compiled = Compiled(services.find_one(), DIALECT, expand={"digests": digests})
    return compiled, RowReader(compiled, as_given)


async def _open_among(
    chunk: list[str], now: datetime, connection: asyncpg.Connection[Any]
) -> list[str]:
    values = OPEN_AMONG.values({"ids": chunk, "now": now})
    return [row[0] for row in await connection.fetch(OPEN_AMONG.sql, *values)]


async def _keep_session(_connection: asyncpg.Connection[Any]) -> None:
    """Pool reset hook: nothing to undo (see the module docstring)."""


SHARED = (StoreUnavailable,)  # the pool or server failed: no item's fault, so no retries


class PostgresStore:
    def __init__(self, dsn: str, *, pool_size: int) -> None:
        self._dsn = dsn
        self._pool_size = pool_size
        self._pool: asyncpg.Pool[Any] | None = None
        self._opening = asyncio.Lock()
        self._connection_reads = LoopBatcher(self._find_connections, shared_failures=SHARED)
        self._flow_inserts = LoopBatcher(self._insert_flows, shared_failures=SHARED)
        self._flow_reads = LoopBatcher(self._get_flows_and_connections, shared_failures=SHARED)
        self._service_reads = LoopBatcher(
            self._find_services_and_own_connections, shared_failures=SHARED
        )

    async def _get_pool(self) -> asyncpg.Pool[Any]:
        if self._pool is None:
            async with self._opening:
                if self._pool is None:
                    self._pool = await asyncpg.create_pool(
                        self._dsn,
                        min_size=1,
                        max_size=self._pool_size,
                        reset=_keep_session,
                        max_inactive_connection_lifetime=0,
                        timeout=CONNECT_TIMEOUT_SECONDS,
                        command_timeout=STATEMENT_WAIT_SECONDS,
                        server_settings=postgres_server_settings(),
                    )
        return self._pool

    async def _run(self, use: Callable[[asyncpg.Connection[Any]], Awaitable[T]]) -> T:
        try:
            pool = await self._get_pool()
            # Waiting for a busy pool is bounded. Taking an idle connection never waits, so it
            # skips the timeout, whose setup costs a good part of a short statement's CPU.
            timeout = None if pool.get_idle_size() else POOL_TIMEOUT_SECONDS
            async with pool.acquire(timeout=timeout) as connection:
                try:
                    return await use(connection)
                except TimeoutError:
                    # A server that does not answer will not answer the cancel request either:
                    # releasing the connection would wait for that as long again. Drop it.
                    connection.terminate()
                    raise
        except UNAVAILABLE as exc:
            raise StoreUnavailable(type(exc).__name__) from exc

    async def find_connection(
        self, issuer: str, subject: str, provider: str, audience: str
    ) -> ConnectionRecord | None:
        return await self._connection_reads.submit((issuer, subject, provider, audience))

    async def _find_connections(self, keys: list[ConnectionKey]) -> list[ConnectionRecord | None]:
        statement = FIND_CONNECTIONS
        params = dict(zip(connections.KEY, map(list, zip(*keys, strict=True)), strict=True))
        rows = await self._run(lambda c: c.fetch(statement.sql, *statement.values(params)))
        found: list[ConnectionRecord | None] = [None] * len(keys)
        for row in rows:
            position = row[CALL] - 1
            found[position] = READ_CONNECTIONS.connection(keys[position], row)
        return found

    async def insert_flow(self, flow: NewFlow, *, max_open: int) -> bool:
        return await self._flow_inserts.submit((flow, max_open))

    async def _insert_flows(self, batch: list[tuple[NewFlow, int]]) -> list[bool]:
        calls = [insert_values(flow, max_open, as_given) for flow, max_open in batch]
        params = {name: [call[name] for call in calls] for name in calls[0]}
        params["request_id"] = [flow.request_id for flow, _ in batch]
        statement = INSERT_FLOWS
        rows = await self._run(lambda c: c.fetch(statement.sql, *statement.values(params)))
        inserted = {row["id"] for row in rows}
        return [flow.id in inserted for flow, _ in batch]

    async def find_reusable_flow(self, flow: NewFlow) -> FlowRecord | None:
        statement = FIND_REUSABLE_FLOW
        values = statement.values(insert_values(flow, 0, as_given))
        row = await self._run(lambda c: c.fetchrow(statement.sql, *values))
        return READ_REUSABLE_FLOW.flow(row) if row is not None else None

    async def get_flow_and_connection(
        self, flow_id: str
    ) -> tuple[FlowRecord, ConnectionRecord | None] | None:
        return await self._flow_reads.submit(flow_id)

    async def _get_flows_and_connections(
        self, flow_ids: list[str]
    ) -> list[FlowAndConnection | None]:
        statement = GET_FLOWS_AND_CONNECTIONS
        values = statement.values({"ids": flow_ids})
        rows = await self._run(lambda c: c.fetch(statement.sql, *values))
        by_id = {row[FLOW_ID]: READ_FLOWS.flow_and_connection(row) for row in rows}
        return [by_id.get(flow_id) for flow_id in flow_ids]

    async def still_open(self, flow_ids: list[str]) -> set[str]:
        now = datetime.now(UTC)
        found: set[str] = set()
        for chunk in open_check_chunks(flow_ids):
            found.update(await self._run(functools.partial(_open_among, chunk, now)))
        return found

    async def find_service(self, digests: list[str]) -> ServiceRecord | None:
        statement, read = find_service(len(digests))
        values = statement.values({"digests": digests})
        row = await self._run(lambda c: c.fetchrow(statement.sql, *values))
        return read.service(row) if row is not None else None

    async def find_service_and_own_connection(
        self, digests: list[str], issuer: str, subject: str, provider: str
    ) -> tuple[ServiceRecord, ConnectionRecord | None] | None:
        return await self._service_reads.submit((digests, issuer, subject, provider))

    async def _find_services_and_own_connections(
        self, calls: list[ServiceLookup]
    ) -> list[ServiceAndConnection | None]:
        params = {
            "issuer": [issuer for _, issuer, _, _ in calls],
            "subject": [subject for _, _, subject, _ in calls],
            "provider": [provider for _, _, _, provider in calls],
            "digest_call": [n for n, (digests, *_) in enumerate(calls, start=1) for _ in digests],
            "digests": [digest for digests, *_ in calls for digest in digests],
        }
        statement = FIND_SERVICES_AND_OWN_CONNECTIONS
        values = statement.values(params)
        rows = await self._run(lambda c: c.fetch(statement.sql, *values))
        found: list[ServiceAndConnection | None] = [None] * len(calls)
        for row in rows:
            position = row[SERVICE_CALL] - 1
            _, issuer, subject, provider = calls[position]
            found[position] = READ_SERVICES.service_and_connection((issuer, subject, provider), row)
        return found

    async def close(self) -> bool:
        """Close the connections politely, or drop them when the database does not answer (a
        shutdown during an outage must not hang or fail)."""
        if self._pool is None:
            return True
        pool, self._pool = self._pool, None
        try:
            async with asyncio.timeout(CLOSE_TIMEOUT_SECONDS):
                await pool.close()
        except UNAVAILABLE:
            pool.terminate()
            return False
        return True
