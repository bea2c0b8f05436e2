"""The endpoints for orchestrators and monitoring: liveness, readiness and Prometheus metrics.

They answer whatever the Host header (`ANY_HOST_PATHS`): probes and scrapes address each process
by its own address, not by the public name.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import TypeVar

from fastapi import FastAPI
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, async_sessionmaker
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response

from app.auth.bearer import bearer_token
from app.connect import revocations
from app.crypto import constant_time_equal
from app.deps import SessionmakerDep, SettingsDep
from app.errors import DATABASE_ERRORS
from app.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from app.metrics import BrokerMetrics, RevocationBacklog
from app.migrate import SCHEMA_VERSION, head_revision, shipped_revisions
from app.webhooks.delivery import Webhooks

logger = logging.getLogger("broker")

LIVENESS_PATH = "/healthz"
READINESS_PATH = "/readyz"
METRICS_PATH = "/metrics"
ANY_HOST_PATHS = frozenset({LIVENESS_PATH, READINESS_PATH, METRICS_PATH})
READINESS_SECONDS = 3
BACKLOG_READ_SECONDS = 2  # well within Prometheus's default scrape timeout (10 s)
T = TypeVar("T")


def add_operations_routes(app: FastAPI) -> None:
    app.add_api_route(LIVENESS_PATH, _healthz, include_in_schema=False)
    app.add_api_route(READINESS_PATH, _readyz, include_in_schema=False)
    app.add_api_route(METRICS_PATH, _metrics, include_in_schema=False)


async def _healthz() -> Response:
    return JSONResponse({"status": "ok"})


async def _readyz(request: Request) -> Response:
    """Ready when the database answers and its schema is the one this version was built for.

    A schema another version migrated, older or newer, is not ready either: this process's
    statements are those of its own schema (`serve` refuses to start on any other). During an
    upgrade the load balancer thus sends requests to the replicas that match the schema.
    """
    engine: AsyncEngine = request.app.state.engine
    try:
        async with asyncio.timeout(READINESS_SECONDS), engine.connect() as connection:
            revision = await connection.scalar(SCHEMA_VERSION)
    except (*DATABASE_ERRORS, OSError, TimeoutError):
        return _unavailable("unreachable")
    if revision != head_revision():
        known = revision is None or revision in shipped_revisions()
        return _unavailable("schema_outdated" if known else "schema_newer")
    return JSONResponse({"status": "ready"})


def _unavailable(database: str) -> Response:
    return JSONResponse({"status": "unavailable", "database": database}, status_code=503)


async def _metrics(
    request: Request, settings: SettingsDep, sessionmaker: SessionmakerDep
) -> Response:
    """Prometheus text format, for a scrape presenting `[server] metrics_token`; without one
    configured the path does not exist."""
    metrics: BrokerMetrics = request.app.state.metrics
    token = settings.server.metrics_token
    if token is None:
        raise StarletteHTTPException(404)
    presented = bearer_token(request.headers.get("authorization"))
    if presented is None or not constant_time_equal(presented, token.get_secret_value()):
        return PlainTextResponse(
            "Metrics need the bearer token configured as [server] metrics_token.\n",
            status_code=401,
            headers={"WWW-Authenticate": 'Bearer realm="metrics"', "Cache-Control": "no-store"},
        )
    return Response(
        metrics.render(
            await _revocation_backlog(sessionmaker),
            await _webhook_backlog(sessionmaker, request.app.state.webhooks),
        ),
        media_type=METRICS_CONTENT_TYPE,
        headers={"Cache-Control": "no-store"},
    )


async def _webhook_backlog(
    sessionmaker: async_sessionmaker[AsyncSession], webhooks: Webhooks
) -> dict[str, int] | None:
    """The events waiting for each webhook, or None (no webhook configured, or no answer)."""
    if not webhooks.configured:
        return None
    return await _read_backlog(
        sessionmaker, webhooks.backlog, "metrics.webhook_backlog_unavailable"
    )


async def _revocation_backlog(
    sessionmaker: async_sessionmaker[AsyncSession],
) -> RevocationBacklog | None:
    """The revocation queue for a scrape, or None when the database does not answer in time."""
    return await _read_backlog(sessionmaker, revocations.backlog, "metrics.backlog_unavailable")


async def _read_backlog(
    sessionmaker: async_sessionmaker[AsyncSession],
    read: Callable[[AsyncSession], Awaitable[T]],
    unavailable: str,
) -> T | None:
    """`read` for a scrape, or None (and a warning named `unavailable`) when the database does
    not answer within BACKLOG_READ_SECONDS: the scrape still gets the counters."""
    try:
        async with asyncio.timeout(BACKLOG_READ_SECONDS), sessionmaker() as session:
            return await read(session)
    except (*DATABASE_ERRORS, OSError, TimeoutError) as exc:
        logger.warning("%s error=%s", unavailable, type(exc).__name__)
        return None
