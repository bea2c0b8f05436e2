"""Security events and the failed-authentication budget, for every surface.

An event has a fixed name and identifiers only (never a secret or a raw identity); it is logged
on `broker.security` and counted in the metrics. Wrong credentials (MCP tokens, service
secrets) are counted per client address against `RateLimits`; the moment an address spends its
budget that is an event too.
"""

from __future__ import annotations

import logging

from app.limits import RateLimits
from app.metrics import BrokerMetrics

logger = logging.getLogger("broker.security")


class SecurityLog:
    def __init__(self, limits: RateLimits, metrics: BrokerMetrics) -> None:
        self.limits = limits
        self.metrics = metrics

    def event(self, name: str, **fields: str | None) -> None:
        details = " ".join(f"{key}={value}" for key, value in fields.items() if value is not None)
        logger.warning("%s %s", name, details)
        self.metrics.security_event(name)

    def failed_auth_wait(self, address: str, secret_digest: str | None = None) -> float:
        """Seconds until `address` may present a new credential (0.0: now; at once for a service
        secret this process has verified before, given by its digest); a request refused for it
        is counted in the metrics."""
        wait = self.limits.failed_auths.wait(address)
        if wait and secret_digest is not None and self.limits.known_secret(secret_digest):
            return 0.0
        if wait:
            self.metrics.refused("failed_auths")
        return wait

    def note_failed_authentication(self, address: str) -> None:
        """A wrong credential from `address`: counted against its budget, and an event the moment
        that is spent."""
        if self.limits.failed_auth(address):
            self.event("auth.failed_auth_limit_reached", address=address)
