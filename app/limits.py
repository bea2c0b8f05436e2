"""Rate limits: token buckets per user and per client address, held in this process.

Two budgets (SECURITY.md T21; MCP servers must rate-limit tool invocations):
- each user (issuer and subject of a verified token) may make `user_requests_per_minute` MCP
  requests, in bursts of up to `user_burst`;
- each client address may present `failed_auths_per_minute` credentials that turn out wrong (MCP
  tokens, service secrets), in bursts of up to `failed_auth_burst`. Once that is spent, its
  requests are refused before any signature check or lookup, except those with a token or
  service secret this process has already verified (users and sibling servers behind the same
  address, a shared NAT, keep working). A token of ours that has only expired is not wrong: its
  client is due to refresh.
A budget of 0 turns that limit off. The buckets live in each process: with N processes (replicas,
`serve --workers N`), a client gets up to N times the budget.
"""

from __future__ import annotations

import functools
import ipaddress
import math
import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass

from app.config import LimitSettings

MAX_KEYS = 100_000  # buckets kept per limit; past it, refilled buckets are dropped first
MAX_KNOWN_SECRETS = 10_000  # verified service secrets remembered (as digests); past it, none
IPV6_PREFIX = 64  # one IPv6 client is a /64: a host picks addresses within it at will


@dataclass(slots=True)
class _Bucket:
    tokens: float
    stamp: float


class TokenBuckets:
    """Token buckets by key: `per_minute` tokens a minute, at most `burst` held (the start).
    A key without a bucket has a full one, so memory holds only recently active keys."""

    def __init__(
        self,
        per_minute: int,
        burst: int,
        *,
        clock: Callable[[], float] = time.monotonic,
        max_keys: int = MAX_KEYS,
    ) -> None:
        self.enabled = per_minute > 0
        self._rate = per_minute / 60
        self._burst = float(max(burst, 1))
        self._clock = clock
        self._max_keys = max_keys
        self._buckets: dict[Hashable, _Bucket] = {}

    def take(self, key: Hashable) -> float:
        """Spend a token of `key`: 0.0 if there was one, else the seconds until there is."""
        if not self.enabled:
            return 0.0
        now = self._clock()
        bucket = self._buckets.get(key)
        if bucket is None:
            self._make_room()
            self._buckets[key] = _Bucket(self._burst - 1, now)
            return 0.0
        tokens = min(self._burst, bucket.tokens + (now - bucket.stamp) * self._rate)
        bucket.stamp = now
        if tokens >= 1:
            bucket.tokens = tokens - 1
            return 0.0
        bucket.tokens = tokens
        return (1 - tokens) / self._rate

    def wait(self, key: Hashable) -> float:
        """Seconds until `key` has a token (0.0 if it has one now); spends nothing."""
        bucket = self._buckets.get(key) if self.enabled else None
        if bucket is None:
            return 0.0
        tokens = bucket.tokens + (self._clock() - bucket.stamp) * self._rate
        return 0.0 if tokens >= 1 else (1 - tokens) / self._rate

    def __len__(self) -> int:
        return len(self._buckets)

    def _make_room(self) -> None:
        """Past `max_keys`: drop every bucket that has refilled (no different from none); if
        that frees too little (a flood of new keys), the oldest half goes, refilled or not."""
        if len(self._buckets) < self._max_keys:
            return
        now = self._clock()
        self._buckets = {
            key: bucket
            for key, bucket in self._buckets.items()
            if bucket.tokens + (now - bucket.stamp) * self._rate < self._burst
        }
        if len(self._buckets) >= self._max_keys // 2:
            keep = list(self._buckets.items())[len(self._buckets) // 2 :]
            self._buckets = dict(keep)


def client_key(scope_client: tuple[str, int] | list[object] | None) -> str:
    """The address a per-client budget counts against: the peer's IP (the forwarded one when
    uvicorn trusts the proxy), an IPv6 address as its /64. An IPv4 address is taken as the
    server wrote it (dotted quad): parsing it on every request would cost more than the limit."""
    if not scope_client:
        return "unknown"
    host = str(scope_client[0])
    return _ipv6_key(host) if ":" in host else host


@functools.lru_cache(maxsize=1024)
def _ipv6_key(host: str) -> str:
    try:
        address = ipaddress.IPv6Address(host)
    except ValueError:
        return host
    if address.ipv4_mapped is not None:
        return str(address.ipv4_mapped)
    return str(ipaddress.IPv6Network((address, IPV6_PREFIX), strict=False))


def retry_after(seconds: float) -> str:
    """A `Retry-After` value: whole seconds, at least 1."""
    return str(max(1, math.ceil(seconds)))


class RateLimits:
    """The process's budgets (see the module's docstring)."""

    def __init__(
        self,
        *,
        user_requests_per_minute: int,
        user_burst: int,
        failed_auths_per_minute: int,
        failed_auth_burst: int,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.users = TokenBuckets(user_requests_per_minute, user_burst, clock=clock)
        self.failed_auths = TokenBuckets(failed_auths_per_minute, failed_auth_burst, clock=clock)
        self._known_secrets: set[str] = set()

    def remember_secret(self, digest: str) -> None:
        """A service secret this process verified, by its keyed digest (the one the services
        table holds, never the secret): a lockout of its address does not stop it."""
        if len(self._known_secrets) >= MAX_KNOWN_SECRETS:
            self._known_secrets.clear()
        self._known_secrets.add(digest)

    def known_secret(self, digest: str) -> bool:
        return digest in self._known_secrets

    def failed_auth(self, address: str) -> bool:
        """Count a wrong credential from `address`: True if that spent its budget."""
        self.failed_auths.take(address)
        return self.failed_auths.wait(address) > 0

    @classmethod
    def from_settings(cls, settings: LimitSettings) -> RateLimits:
        return cls(
            user_requests_per_minute=settings.user_requests_per_minute,
            user_burst=settings.user_burst,
            failed_auths_per_minute=settings.failed_auths_per_minute,
            failed_auth_burst=settings.failed_auth_burst,
        )
