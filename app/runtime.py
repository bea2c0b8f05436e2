"""The long-lived objects one broker process shares between requests, built once at start-up."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field

import httpx2
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, async_sessionmaker

from app.auth.bearer import TokenVerifier
from app.auth.browser import BrowserSessions
from app.auth.jwks import JwksCache
from app.config import Settings
from app.connect.notify import FlowNotifier
from app.crypto import Keyring
from app.direct import DirectStore
from app.limits import RateLimits
from app.mcp.registry import ToolRegistry
from app.mcp.request_state import RequestStateCodec
from app.metrics import BrokerMetrics

security_log = logging.getLogger("broker.security")

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
    # Pooled connections that may be held while a provider answers (app/connect/refresh.py)
    provider_call_slots: asyncio.Semaphore
    limits: RateLimits
    provider_issuers: dict[str, JwksCache] = field(default_factory=dict)
    server_info: dict[str, str] = field(
        default_factory=lambda: {"name": SERVER_NAME, "version": SERVER_VERSION}
    )
    metrics: BrokerMetrics = field(default_factory=BrokerMetrics)

    def provider_jwks(self, issuer: str) -> JwksCache:
        """Discovery and keys of a third-party OpenID provider, cached per issuer."""
        cache = self.provider_issuers.get(issuer)
        if cache is None:
            cache = self.provider_issuers[issuer] = JwksCache(issuer, http=self.http)
        return cache

    def audit(self, event: str, **fields: str | None) -> None:
        """A security event: fixed name, identifiers only (never secrets or raw identities)."""
        details = " ".join(f"{key}={value}" for key, value in fields.items() if value is not None)
        security_log.warning("%s %s", event, details)
        self.metrics.security_event(event)

    def failed_auth_wait(self, address: str, secret: str | None = None) -> float:
        """Seconds until `address` may present a new credential (0.0: now; at once for a service
        `secret` this process has verified before); a request refused for it is counted in the
        metrics."""
        wait = self.limits.failed_auths.wait(address)
        if wait and secret is not None and self.limits.known_secret(secret):
            return 0.0
        if wait:
            self.metrics.refused("failed_auths")
        return wait

    def note_failed_authentication(self, address: str) -> None:
        """A wrong credential (token, service secret) from `address`: counted against its
        budget, and an audit event the moment that is spent."""
        if self.limits.failed_auth(address):
            self.audit("auth.failed_auth_limit_reached", address=address)
