"""Application factory: builds the shared parts, wires middleware, routes and error handlers."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import httpx2
from fastapi import FastAPI
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, async_sessionmaker
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import FileResponse, JSONResponse, Response
from starlette.routing import BaseRoute
from starlette.types import Receive, Scope, Send

from app import audit, clock_skew
from app.asgi_route import AsgiRoute
from app.auth.bearer import TokenVerifier
from app.auth.browser import BrowserSessions
from app.auth.dev_idp import DevIdentityProvider
from app.auth.jwks import JwksCache, ProviderIssuers
from app.collector import settle_for_serving
from app.config import Settings
from app.connect import service as flows
from app.connect.context import RoundContext
from app.connect.idle import UsageLog, revoke_idle
from app.connect.notify import FlowNotifier, PostgresFlowNotifier
from app.connect.oauth_service import OAuthGrants
from app.connect.refresh import UsableCredentials
from app.connect.request_state import RequestStateCodec
from app.connect.revocations import Revoker
from app.crypto import Keys
from app.db import create_engine, create_sessionmaker, is_sqlite
from app.deps import SettingsDep
from app.direct import DirectStore, open_direct_store
from app.errors import (
    DATABASE_ERRORS,
    LOGGED_ERROR_KEY,
    BrokerError,
    ProviderUnavailable,
    on_broker_error,
    on_client_disconnect,
    on_database_error,
    on_http_exception,
    on_provider_unavailable,
    on_unexpected_error,
)
from app.integration_api import admin as admin_routes
from app.integration_api import credential_route, token_exchange
from app.integration_api import routes as integration_routes
from app.integration_api.broker import ConnectApi
from app.integration_api.routes import ServiceSecrets
from app.integration_api.user_proof import UserProofs, user_proofs
from app.limits import RateLimits
from app.mcp.broker_tools import register_broker_tools
from app.mcp.endpoint import McpEndpoint
from app.mcp.provider_tools import register_provider_tools
from app.mcp.registry import ToolRegistry
from app.mcp.server import SERVER_VERSION, McpServer
from app.metrics import BrokerMetrics
from app.middleware import AccessLog, BodyLimit, HostGuard
from app.operations import ANY_HOST_PATHS, add_operations_routes
from app.pages import connect as connect_pages
from app.pages import login
from app.pages import oauth as oauth_pages
from app.resources import resource_dir
from app.security_log import SecurityLog
from app.templating import render
from app.webhooks.delivery import Webhooks

logger = logging.getLogger("broker")
ENGINE_CLOSE_TIMEOUT_SECONDS = 5  # a shutdown never waits longer for the database

HOUSEKEEPING_INTERVAL_SECONDS = 60  # expired flows and sessions purged, due revocations retried


@dataclass(frozen=True)
class Shared:
    """Everything one broker process shares, built once. Only this module sees it whole:
    `create_app` puts each part on `app.state` under its own name, where the routes'
    dependencies (app/deps.py) find the part they use, and builds the hot endpoints with theirs
    (`_hot_routes`)."""

    settings: Settings
    engine: AsyncEngine
    sessionmaker: async_sessionmaker[AsyncSession]
    store: DirectStore  # the hot-path statements, straight through the driver
    keys: Keys
    identity_issuer: JwksCache
    browser_sessions: BrowserSessions
    notifier: FlowNotifier
    http: httpx2.AsyncClient
    metrics: BrokerMetrics
    security: SecurityLog
    oauth_grants: OAuthGrants
    revoker: Revoker
    usage: UsageLog  # connections used, written by the housekeeping
    mcp_server: McpServer
    connect_api: ConnectApi
    service_secrets: ServiceSecrets
    user_proofs: UserProofs  # the services that prove their users with the users' tokens
    webhooks: Webhooks  # lifecycle events posted to `[webhooks.<name>]`, in a loop of their own


def build_shared(settings: Settings, registry: ToolRegistry) -> Shared:
    """Everything the process shares; nothing here does I/O yet."""
    keys = Keys.parse(
        tuple(k.get_secret_value() for k in settings.keys.signing),
        tuple(k.get_secret_value() for k in settings.keys.encryption),
    )
    engine = create_engine(settings.database.connect_url(), pool_size=settings.database.pool_size)
    sessionmaker = create_sessionmaker(engine)
    store = open_direct_store(
        settings.database.connect_url(), pool_size=settings.database.pool_size
    )
    http = httpx2.AsyncClient(
        timeout=httpx2.Timeout(10.0, connect=3.0),
        follow_redirects=False,
        # An idle connection is dropped after 4 s, before servers that close theirs after 5 s
        # (uvicorn's default) do: a request sent on a connection the server is closing at that
        # moment fails with a read error, and a code exchange cannot be sent twice.
        limits=httpx2.Limits(
            max_connections=50, max_keepalive_connections=10, keepalive_expiry=4.0
        ),
        trust_env=False,
    )
    identity_issuer = JwksCache(
        settings.identity.issuer,
        http=http,
        cooldown=settings.identity.jwks_refresh_cooldown_seconds,
    )
    provider_issuers = ProviderIssuers(http)
    notifier: FlowNotifier = (
        FlowNotifier(poll_interval=0.25, still_open=store.still_open)
        if is_sqlite(settings.database.url)
        else PostgresFlowNotifier(settings.database.connect_url(), still_open=store.still_open)
    )
    limits = RateLimits.from_settings(settings.limits)
    metrics = BrokerMetrics()
    security = SecurityLog(limits, metrics)
    grants = OAuthGrants(
        public_url=settings.public_url,
        keys=keys,
        issuers=provider_issuers,
        http=http,
        notifier=notifier,
        security=security,
    )
    revoker = Revoker(
        providers=settings.providers,
        http=http,
        sealing=keys.sealing,
        sessionmaker=sessionmaker,
        security=security,
    )
    usage = UsageLog()
    credentials = UsableCredentials(
        store=store,
        sessionmaker=sessionmaker,
        sealing=keys.sealing,
        providers=settings.providers,
        grants=grants,
        revoker=revoker,
        # half of the pool (pool_size + as many overflow): a slow provider never takes it all
        call_slots=asyncio.Semaphore(settings.database.pool_size),
        security=security,
        usage=usage,
    )
    rounds = RoundContext(settings, store, sessionmaker, notifier, credentials)
    codec = RequestStateCodec(keys.signing, max_age=settings.server.flow_ttl_seconds)
    register_broker_tools(registry, settings.providers, sessionmaker, revoker)
    register_provider_tools(registry, settings.providers, http)
    return Shared(
        settings=settings,
        engine=engine,
        sessionmaker=sessionmaker,
        store=store,
        keys=keys,
        identity_issuer=identity_issuer,
        browser_sessions=BrowserSessions(
            keys.signing,
            ttl_seconds=settings.server.session_ttl_seconds,
            max_auth_age_seconds=settings.server.login_max_age_seconds,
        ),
        notifier=notifier,
        http=http,
        metrics=metrics,
        security=security,
        oauth_grants=grants,
        revoker=revoker,
        usage=usage,
        mcp_server=McpServer(
            settings=settings,
            verifier=TokenVerifier(
                issuer=settings.identity.issuer,
                audience=settings.audience,
                identity_claim=settings.identity.identity_claim,
                algorithms=settings.identity.algorithms,
                jwks=identity_issuer,
                require_at_jwt=settings.identity.require_at_jwt,
            ),
            security=security,
            limits=limits,
            metrics=metrics,
            registry=registry,
            codec=codec,
            rounds=rounds,
            allowed_origins=frozenset((settings.public_origin, *settings.server.allowed_origins)),
        ),
        connect_api=ConnectApi(rounds, codec),
        service_secrets=ServiceSecrets(store, keys.signing, security, limits),
        user_proofs=user_proofs(settings, identity_issuer, security),
        webhooks=Webhooks(
            webhooks=settings.webhooks,
            sessionmaker=sessionmaker,
            http=http,
            metrics=metrics,
            postgres=not is_sqlite(settings.database.url),
        ),
    )


def share(app: FastAPI, shared: Shared) -> None:
    """Put each shared part on `app.state` under its own name."""
    for part in dataclasses.fields(shared):
        setattr(app.state, part.name, getattr(shared, part.name))


def allowed_hosts(settings: Settings) -> frozenset[str]:
    hosts = set()
    for url in (settings.public_url, *settings.server.allowed_origins):
        netloc = urlsplit(url).netloc.lower()
        hosts.add(netloc)
        default_port = ":443" if url.startswith("https://") else ":80"
        hosts.add(netloc.removesuffix(default_port))
    return frozenset(hosts)


class BrokerApp(FastAPI):
    """FastAPI, with one traceback per failed request in the log, and the credential route
    (a plain Starlette route) in the OpenAPI document."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        except Exception as exc:
            # Starlette has answered 500 through `on_unexpected_error`, which logged the
            # traceback with the request id, and re-raises for the server to log: a second
            # traceback without the id. An exception nobody logged goes on to the server.
            if scope.get(LOGGED_ERROR_KEY) is not exc:
                raise

    def openapi(self) -> dict[str, Any]:
        first = self.openapi_schema is None
        document = super().openapi()  # kept by FastAPI after the first call
        if first:
            credential_route.add_operation(document)
        return document


MCP_PATH = "/mcp"


class _NotFound:
    """An ASGI endpoint that answers as a routing miss is answered (`on_http_exception`)."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        raise StarletteHTTPException(status_code=404)


def _hot_routes(shared: Shared) -> list[BaseRoute]:
    """The hot paths, first in the router, which then finds them on its first comparisons."""
    return [
        AsgiRoute(MCP_PATH, McpEndpoint(shared.mcp_server)),
        credential_route.route(
            shared.settings, shared.connect_api, shared.service_secrets, shared.user_proofs
        ),
    ]


def _mcp_slash_route() -> BaseRoute:
    """`/mcp/` answers 404 like any unknown path: without a route of its own the router would
    redirect it to /mcp (307), and a client would then use an MCP endpoint other than the
    resource its tokens are for (`/.well-known/oauth-protected-resource/mcp`). It is the
    router's last route: the router tries its redirect only after every route, and no request
    to another path pays for comparing with this one (a credential fetch did, 1.8 % of its
    instructions, `python -m bench.instructions`)."""
    return AsgiRoute(MCP_PATH + "/", _NotFound())


def create_app(
    settings: Settings,
    *,
    registry: ToolRegistry | None = None,
    dev_idp: DevIdentityProvider | None = None,
) -> FastAPI:
    """The ASGI app. `registry` may carry extra tools; `dev_idp` is passed only by `dev`."""
    registry = registry if registry is not None else ToolRegistry()
    shared = build_shared(settings, registry)

    @contextlib.asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        await shared.notifier.start()
        settle_for_serving()
        loops = [asyncio.create_task(_housekeeping_forever(shared))]
        if shared.webhooks.configured:
            # a new webhook's events start here, before the first request; if the database does
            # not answer yet, the delivery loop starts it later
            with contextlib.suppress(*DATABASE_ERRORS):
                await shared.webhooks.start()
            loops.append(asyncio.create_task(shared.webhooks.forever()))
        try:
            yield
        finally:
            for loop in loops:
                loop.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await loop
            await shared.notifier.stop()
            await shared.http.aclose()
            answered = await shared.store.close()
            if not answered:
                logger.warning("shutdown.database_unresponsive connections=dropped")
            # dropped, not closed, when the database did not answer: a polite close would hang
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(ENGINE_CLOSE_TIMEOUT_SECONDS):
                    await shared.engine.dispose(close=answered)

    app = BrokerApp(
        title="Connect Broker",
        version=SERVER_VERSION,
        lifespan=lifespan,
        docs_url=None,
        redoc_url=None,
        openapi_url="/api/v1/openapi.json",
        # FastAPI's own OpenTelemetry spans, metrics and exception logs are off: the broker
        # counts requests itself (/metrics), logs a bug once with its messages withheld
        # (app/bug_report.py), and would otherwise ask for the providers on every request
        telemetry={"tracing": False, "metrics": False, "logs": False},
    )
    app.router.routes[:0] = _hot_routes(shared)
    share(app, shared)
    app.state.development = dev_idp is not None  # every page then shows the development banner
    for path in (
        "/.well-known/oauth-protected-resource",
        "/.well-known/oauth-protected-resource/mcp",
    ):
        app.add_api_route(path, _resource_metadata, include_in_schema=False)
    add_operations_routes(app)
    app.add_api_route("/static/broker.css", _stylesheet, include_in_schema=False)
    app.add_api_route("/", _landing, include_in_schema=False)
    app.include_router(login.router)
    app.include_router(connect_pages.router)
    app.include_router(oauth_pages.router)
    app.include_router(integration_routes.router)
    app.include_router(token_exchange.router)
    app.include_router(admin_routes.router)
    if dev_idp is not None:
        app.include_router(dev_idp.router())
    app.router.routes.append(_mcp_slash_route())
    app.add_exception_handler(BrokerError, on_broker_error)
    app.add_exception_handler(StarletteHTTPException, on_http_exception)
    app.add_exception_handler(ClientDisconnect, on_client_disconnect)
    app.add_exception_handler(ProviderUnavailable, on_provider_unavailable)
    for error in DATABASE_ERRORS:
        app.add_exception_handler(error, on_database_error)
    app.add_exception_handler(Exception, on_unexpected_error)
    hosts = allowed_hosts(settings)
    app.add_middleware(
        BodyLimit,
        limit=settings.server.max_api_body_bytes,
        own_limit_paths=frozenset({MCP_PATH}),
    )
    app.add_middleware(HostGuard, allowed_hosts=hosts, any_host_paths=ANY_HOST_PATHS)
    app.add_middleware(AccessLog, metrics=shared.metrics)
    return app


async def _housekeeping_forever(shared: Shared) -> None:
    while True:
        try:
            expired, deleted = await flows.purge(shared.sessionmaker)
            async with shared.sessionmaker.begin() as session:
                await shared.browser_sessions.purge(session)
            if expired or deleted:
                logger.info("flows.purged expired=%d deleted=%d", expired, deleted)
        except DATABASE_ERRORS as exc:
            logger.warning("flows.purge_failed error=%s", type(exc).__name__)
        try:
            await shared.revoker.sweep()
        except DATABASE_ERRORS as exc:
            logger.warning("revocation.sweep_failed error=%s", type(exc).__name__)
        try:
            swept = await audit.sweep(
                shared.sessionmaker, retention_days=shared.settings.audit.retention_days
            )
            if swept:
                logger.info("audit.swept deleted=%d", swept)
        except DATABASE_ERRORS as exc:
            logger.warning("audit.sweep_failed error=%s", type(exc).__name__)
        await _connections_housekeeping(shared)
        if not is_sqlite(shared.settings.database.url):
            await _clock_check(shared)
        await asyncio.sleep(HOUSEKEEPING_INTERVAL_SECONDS)


async def _clock_check(shared: Shared) -> None:
    """This process's clock against the database's (app/clock_skew.py); unknown (no gauge) while
    the database does not answer."""
    try:
        shared.metrics.clock_skew_seconds = await clock_skew.check(shared.engine)
    except DATABASE_ERRORS as exc:
        shared.metrics.clock_skew_seconds = None
        logger.warning("clock.check_failed error=%s", type(exc).__name__)


async def _connections_housekeeping(shared: Shared) -> None:
    """Write the connections used meanwhile; then, with `[connections] max_idle_days`, revoke
    the idle ones."""
    try:
        await shared.usage.flush(shared.sessionmaker)
        max_idle_days = shared.settings.connections.max_idle_days
        if max_idle_days is not None:
            revoked = await revoke_idle(
                shared.sessionmaker,
                max_idle_days=max_idle_days,
                sealing=shared.keys.sealing,
                providers=shared.settings.providers,
            )
            if revoked:
                logger.info("connections.idle_revoked count=%d", revoked)
    except DATABASE_ERRORS as exc:
        logger.warning("connections.housekeeping_failed error=%s", type(exc).__name__)


async def _resource_metadata(settings: SettingsDep) -> Response:
    document: dict[str, object] = {
        "resource": settings.audience,
        "authorization_servers": [settings.identity.issuer],
        "bearer_methods_supported": ["header"],
        "resource_name": "Connect Broker",
    }
    if settings.identity.advertised_scopes:
        document["scopes_supported"] = list(settings.identity.advertised_scopes)
    return JSONResponse(document, headers={"Cache-Control": "public, max-age=3600"})


async def _landing(request: Request, settings: SettingsDep) -> Response:
    """What this service is, for someone who opens its address in a browser."""
    return render(request, "landing.html", docs_url=settings.server.docs_url)


async def _stylesheet() -> Response:
    return FileResponse(
        resource_dir("templates") / "broker.css",
        media_type="text/css",
        headers={"Cache-Control": "public, max-age=3600"},
    )
