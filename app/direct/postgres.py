"""The direct store on PostgreSQL: an asyncpg pool, each statement in autocommit.

Each statement is prepared once per connection (asyncpg's statement cache). A released connection
is not sent asyncpg's default `RESET ALL; UNLISTEN *; …` round trip: these statements leave no
session state behind (asyncpg still rolls back a transaction a cancelled request left open).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import asyncpg

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

OPEN_STATUSES = [str(status) for status in OPEN_FLOW_STATUSES]
ACQUIRE_TIMEOUT_SECONDS = 3
CONNECT_TIMEOUT_SECONDS = 3
STATEMENT_TIMEOUT_SECONDS = 5

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

FIND_CONNECTION = """
SELECT id, status, sealed_credential, scopes, account_label, expires_at
FROM connections WHERE issuer = $1 AND subject = $2 AND provider = $3 AND audience = $4
"""
INSERT_FLOW = """
INSERT INTO flows (id, issuer, subject, client_id, client_name, audience, provider, scopes,
                   tool_name, args_digest, status, created_at, updated_at, expires_at)
SELECT $1, $2::varchar, $3::varchar, $4, $5, $6, $7, $8, $9, $10, 'pending', $11, $11, $12
WHERE (SELECT count(*) FROM (
         SELECT 1 FROM flows
         WHERE issuer = $2 AND subject = $3 AND status = ANY($13::text[]) AND expires_at > $11
         LIMIT $14) AS open_flows) < $14
"""
GET_FLOW_AND_CONNECTION = """
SELECT f.id, f.issuer, f.subject, f.client_id, f.client_name, f.audience, f.provider, f.scopes,
       f.status, f.account_label, f.failure, f.expires_at,
       c.id, c.status, c.sealed_credential, c.scopes, c.account_label, c.expires_at
FROM flows AS f
LEFT JOIN connections AS c
  ON c.issuer = f.issuer AND c.subject = f.subject AND c.provider = f.provider
 AND c.audience = f.audience
WHERE f.id = $1
"""
FIND_SERVICE = """
SELECT name, providers FROM service_clients
WHERE secret_digest = ANY($1::text[]) AND revoked_at IS NULL
LIMIT 1
"""
FIND_SERVICE_AND_OWN_CONNECTION = """
SELECT s.name, s.providers,
       c.id, c.status, c.sealed_credential, c.scopes, c.account_label, c.expires_at
FROM service_clients AS s
LEFT JOIN connections AS c
  ON c.issuer = $2 AND c.subject = $3 AND c.provider = $4 AND c.audience = s.name
WHERE s.secret_digest = ANY($1::text[]) AND s.revoked_at IS NULL
LIMIT 1
"""


async def _keep_session(_connection: asyncpg.Connection[Any]) -> None:
    """Pool reset hook: nothing to undo (see the module docstring)."""


class PostgresStore:
    def __init__(self, dsn: str, *, pool_size: int) -> None:
        self._dsn = dsn
        self._pool_size = pool_size
        self._pool: asyncpg.Pool[Any] | None = None
        self._opening = asyncio.Lock()

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
                        command_timeout=STATEMENT_TIMEOUT_SECONDS,
                        server_settings={
                            "statement_timeout": str(STATEMENT_TIMEOUT_SECONDS * 1000),
                            "application_name": "connect-broker",
                        },
                    )
        return self._pool

    async def _run(self, use: Callable[[asyncpg.Connection[Any]], Awaitable[T]]) -> T:
        try:
            pool = await self._get_pool()
            # Waiting for a busy pool is bounded. Taking an idle connection never waits, so it
            # skips the timeout, whose setup costs a good part of a short statement's CPU.
            timeout = None if pool.get_idle_size() else ACQUIRE_TIMEOUT_SECONDS
            async with pool.acquire(timeout=timeout) as connection:
                return await use(connection)
        except UNAVAILABLE as exc:
            raise StoreUnavailable(type(exc).__name__) from exc

    async def find_connection(
        self, issuer: str, subject: str, provider: str, audience: str
    ) -> ConnectionRecord | None:
        row = await self._run(
            lambda c: c.fetchrow(FIND_CONNECTION, issuer, subject, provider, audience)
        )
        if row is None:
            return None
        return connection_record((issuer, subject, provider, audience), row, row[5])

    async def insert_flow(self, flow: NewFlow, *, max_open: int) -> bool:
        status: str = await self._run(
            lambda c: c.execute(
                INSERT_FLOW,
                flow.id,
                flow.issuer,
                flow.subject,
                flow.client_id,
                flow.client_name,
                flow.audience,
                flow.provider,
                flow.scopes,
                flow.tool_name,
                flow.args_digest,
                flow.created_at,
                flow.expires_at,
                OPEN_STATUSES,
                max_open,
            )
        )
        return status == "INSERT 0 1"

    async def get_flow_and_connection(
        self, flow_id: str
    ) -> tuple[FlowRecord, ConnectionRecord | None] | None:
        row = await self._run(lambda c: c.fetchrow(GET_FLOW_AND_CONNECTION, flow_id))
        return flow_and_connection(row, row[11], row[17]) if row is not None else None

    async def find_service(self, digests: list[str]) -> ServiceRecord | None:
        row = await self._run(lambda c: c.fetchrow(FIND_SERVICE, digests))
        return ServiceRecord(name=row[0], providers=row[1]) if row is not None else None

    async def find_service_and_own_connection(
        self, digests: list[str], issuer: str, subject: str, provider: str
    ) -> tuple[ServiceRecord, ConnectionRecord | None] | None:
        values = (digests, issuer, subject, provider)
        row = await self._run(lambda c: c.fetchrow(FIND_SERVICE_AND_OWN_CONNECTION, *values))
        if row is None:
            return None
        return service_and_connection((issuer, subject, provider), row, row[7])

    async def close(self) -> None:
        if self._pool is not None:
            pool, self._pool = self._pool, None
            await pool.close()
