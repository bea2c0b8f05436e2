"""The long-lived objects one broker process shares between requests, built once at start-up."""

from __future__ import annotations

from dataclasses import dataclass, field

import httpx2
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, async_sessionmaker

from app.auth.bearer import TokenVerifier
from app.auth.browser import BrowserSessions
from app.auth.jwks import JwksCache, ProviderIssuers
from app.config import Settings
from app.connect.context import RoundContext
from app.connect.notify import FlowNotifier
from app.connect.oauth_service import OAuthGrants
from app.connect.refresh import UsableCredentials
from app.connect.request_state import RequestStateCodec
from app.connect.revocations import Revoker
from app.crypto import Keyring, Keys
from app.direct import DirectStore
from app.limits import RateLimits
from app.mcp.registry import ToolRegistry
from app.metrics import BrokerMetrics
from app.security_log import SecurityLog

SERVER_NAME = "connect-broker"
SERVER_VERSION = "0.1.0"


@dataclass
class Runtime:
    settings: Settings
    engine: AsyncEngine
    sessionmaker: async_sessionmaker[AsyncSession]
    direct: DirectStore  # the hot-path statements, straight through the driver
    signing_keys: Keyring
    sealing_keys: Keyring
    issuer: JwksCache
    verifier: TokenVerifier
    browser_sessions: BrowserSessions
    codec: RequestStateCodec
    registry: ToolRegistry
    notifier: FlowNotifier
    http: httpx2.AsyncClient
    allowed_origins: frozenset[str]
    limits: RateLimits
    security: SecurityLog
    keys: Keys
    grants: OAuthGrants
    revoker: Revoker
    credentials: UsableCredentials
    round_context: RoundContext
    provider_issuers: ProviderIssuers
    metrics: BrokerMetrics
    server_info: dict[str, str] = field(
        default_factory=lambda: {"name": SERVER_NAME, "version": SERVER_VERSION}
    )

    def provider_jwks(self, issuer: str) -> JwksCache:
        return self.provider_issuers(issuer)

    def audit(self, event: str, **fields: str | None) -> None:
        self.security.event(event, **fields)

    def failed_auth_wait(self, address: str, secret: str | None = None) -> float:
        return self.security.failed_auth_wait(address, secret)

    def note_failed_authentication(self, address: str) -> None:
        self.security.note_failed_authentication(address)
