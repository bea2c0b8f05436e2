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
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import asyncpg

from app.db import (
    CONNECT_TIMEOUT_SECONDS,
    POOL_TIMEOUT_SECONDS,
    SERVER_STATEMENT_TIMEOUT_MS,
    STATEMENT_WAIT_SECONDS,
)
from app.direct.batching import LoopBatcher
from app.direct.records import (
    ConnectionRecord,
    FlowRecord,
    NewFlow,
    ServiceRecord,
    StoreUnavailable,
    connection_record,
    flow_and_connection,
    service_and_connection,
)
from app.models import OPEN_FLOW_STATUSES

T = TypeVar("T")
ConnectionKey = tuple[str, str, str, str]  # issuer, subject, provider, audience
ServiceLookup = tuple[list[str], str, str, str]  # secret digests, issuer, subject, provider
FlowAndConnection = tuple[FlowRecord, ConnectionRecord | None]
ServiceAndConnection = tuple[ServiceRecord, ConnectionRecord | None]

OPEN_STATUSES = [str(status) for status in OPEN_FLOW_STATUSES]
CLOSE_TIMEOUT_SECONDS = 3

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

# The hot statements take a batch (bind arrays, `unnest` them with their positions) and answer
# in positions: one statement for all the calls of one loop turn (app/direct/batching.py).
# Connections are read through `LATERAL (… LIMIT 1)` (the unique index allows one row anyway): a
# probe of the unique index per key whatever the table statistics say, never a hash join over
# the whole table.
FIND_CONNECTIONS = """
SELECT k.n, c.id, c.status, c.sealed_credential, c.scopes, c.account_label, c.expires_at
FROM unnest($1::text[], $2::text[], $3::text[], $4::text[])
     WITH ORDINALITY AS k(issuer, subject, provider, audience, n)
JOIN LATERAL (
  SELECT id, status, sealed_credential, scopes, account_label, expires_at FROM connections
  WHERE issuer = k.issuer AND subject = k.subject AND provider = k.provider
    AND audience = k.audience
  LIMIT 1
) AS c ON true
"""
# A flow is inserted while its owner has fewer than max_open open flows, counting the flows of
# the same owner earlier in the batch as well.
INSERT_FLOWS = """
INSERT INTO flows (id, issuer, subject, client_id, client_name, audience, provider, scopes,
                   tool_name, args_digest, status, created_at, updated_at, expires_at)
SELECT n.id, n.issuer, n.subject, n.client_id, n.client_name, n.audience, n.provider, n.scopes,
       n.tool_name, n.args_digest, 'pending', n.created_at, n.created_at, n.expires_at
FROM unnest($1::text[], $2::text[], $3::text[], $4::text[], $5::text[], $6::text[], $7::text[],
            $8::text[], $9::text[], $10::text[], $11::timestamptz[], $12::timestamptz[],
            $13::int[])
     WITH ORDINALITY AS n(id, issuer, subject, client_id, client_name, audience, provider,
                          scopes, tool_name, args_digest, created_at, expires_at, max_open, pos)
WHERE (SELECT count(*) FROM (
         SELECT 1 FROM flows
         WHERE issuer = n.issuer AND subject = n.subject AND status = ANY($14::text[])
           AND expires_at > n.created_at
         LIMIT n.max_open) AS open_flows)
    + (SELECT count(*)
       FROM unnest($2::text[], $3::text[]) WITH ORDINALITY AS e(issuer, subject, pos)
       WHERE e.issuer = n.issuer AND e.subject = n.subject AND e.pos < n.pos) < n.max_open
RETURNING id
"""
GET_FLOWS_AND_CONNECTIONS = """
SELECT f.id, f.issuer, f.subject, f.client_id, f.client_name, f.audience, f.provider, f.scopes,
       f.status, f.account_label, f.failure, f.expires_at,
       c.id, c.status, c.sealed_credential, c.scopes, c.account_label, c.expires_at
FROM flows AS f
LEFT JOIN LATERAL (
  SELECT id, status, sealed_credential, scopes, account_label, expires_at FROM connections
  WHERE issuer = f.issuer AND subject = f.subject AND provider = f.provider
    AND audience = f.audience
  LIMIT 1
) AS c ON true
WHERE f.id = ANY($1::text[])
"""
FIND_SERVICE = """
SELECT name, providers FROM service_clients
WHERE secret_digest = ANY($1::text[]) AND revoked_at IS NULL
LIMIT 1
"""
# Each call brings its own list of digests (one per configured key): ($4[i], $5[i]) says that
# digest $5[i] belongs to call $4[i].
FIND_SERVICES_AND_OWN_CONNECTIONS = """
SELECT k.n, s.name, s.providers,
       c.id, c.status, c.sealed_credential, c.scopes, c.account_label, c.expires_at
FROM unnest($1::text[], $2::text[], $3::text[]) WITH ORDINALITY AS k(issuer, subject, provider, n)
JOIN LATERAL (
  SELECT name, providers FROM service_clients
  WHERE secret_digest = ANY(ARRAY(
          SELECT d.digest FROM unnest($4::bigint[], $5::text[]) AS d(n, digest) WHERE d.n = k.n))
    AND revoked_at IS NULL
  LIMIT 1
) AS s ON true
LEFT JOIN LATERAL (
  SELECT id, status, sealed_credential, scopes, account_label, expires_at FROM connections
  WHERE issuer = k.issuer AND subject = k.subject AND provider = k.provider
    AND audience = s.name
  LIMIT 1
) AS c ON true
"""


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
                        server_settings={
                            "statement_timeout": str(SERVER_STATEMENT_TIMEOUT_MS),
                            "application_name": "connect-broker",
                        },
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
        columns = [list(column) for column in zip(*keys, strict=True)]
        rows = await self._run(lambda c: c.fetch(FIND_CONNECTIONS, *columns))
        found: list[ConnectionRecord | None] = [None] * len(keys)
        for row in rows:
            position = row[0] - 1
            found[position] = connection_record(keys[position], row[1:], row[6])
        return found

    async def insert_flow(self, flow: NewFlow, *, max_open: int) -> bool:
        return await self._flow_inserts.submit((flow, max_open))

    async def _insert_flows(self, batch: list[tuple[NewFlow, int]]) -> list[bool]:
        flows = [flow for flow, _ in batch]
        values = [
            [flow.id for flow in flows],
            [flow.issuer for flow in flows],
            [flow.subject for flow in flows],
            [flow.client_id for flow in flows],
            [flow.client_name for flow in flows],
            [flow.audience for flow in flows],
            [flow.provider for flow in flows],
            [flow.scopes for flow in flows],
            [flow.tool_name for flow in flows],
            [flow.args_digest for flow in flows],
            [flow.created_at for flow in flows],
            [flow.expires_at for flow in flows],
            [max_open for _, max_open in batch],
            OPEN_STATUSES,
        ]
        rows = await self._run(lambda c: c.fetch(INSERT_FLOWS, *values))
        inserted = {row[0] for row in rows}
        return [flow.id in inserted for flow in flows]

    async def get_flow_and_connection(
        self, flow_id: str
    ) -> tuple[FlowRecord, ConnectionRecord | None] | None:
        return await self._flow_reads.submit(flow_id)

    async def _get_flows_and_connections(
        self, flow_ids: list[str]
    ) -> list[FlowAndConnection | None]:
        rows = await self._run(lambda c: c.fetch(GET_FLOWS_AND_CONNECTIONS, flow_ids))
        by_id = {row[0]: flow_and_connection(row, row[11], row[17]) for row in rows}
        return [by_id.get(flow_id) for flow_id in flow_ids]

    async def find_service(self, digests: list[str]) -> ServiceRecord | None:
        row = await self._run(lambda c: c.fetchrow(FIND_SERVICE, digests))
        return ServiceRecord(name=row[0], providers=row[1]) if row is not None else None

    async def find_service_and_own_connection(
        self, digests: list[str], issuer: str, subject: str, provider: str
    ) -> tuple[ServiceRecord, ConnectionRecord | None] | None:
        return await self._service_reads.submit((digests, issuer, subject, provider))

    async def _find_services_and_own_connections(
        self, calls: list[ServiceLookup]
    ) -> list[ServiceAndConnection | None]:
        positions = [n for n, (digests, *_) in enumerate(calls, start=1) for _ in digests]
        values = (
            [issuer for _, issuer, _, _ in calls],
            [subject for _, _, subject, _ in calls],
            [provider for _, _, _, provider in calls],
            positions,
            [digest for digests, *_ in calls for digest in digests],
        )
        rows = await self._run(lambda c: c.fetch(FIND_SERVICES_AND_OWN_CONNECTIONS, *values))
        found: list[ServiceAndConnection | None] = [None] * len(calls)
        for row in rows:
            position = row[0] - 1
            _, issuer, subject, provider = calls[position]
            found[position] = service_and_connection((issuer, subject, provider), row[1:], row[8])
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
