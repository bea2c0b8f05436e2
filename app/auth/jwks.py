"""The identity provider's signing keys, fetched through OIDC discovery and cached.

- Fetched lazily, refreshed after `ttl`; a failed refresh keeps the last-known-good set, so one
  JWKS outage does not become an authentication outage (SECURITY.md A12).
- An unknown `kid` triggers at most one refetch per `cooldown` (A2, A11), behind one lock so
  concurrent misses cause one fetch.
- Only HTTPS (or loopback HTTP) URLs from the issuer's own metadata are fetched; token headers such
  as `jku`/`x5u` are never followed.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

import httpx2
from joserfc.errors import JoseError
from joserfc.jwk import KeySet

logger = logging.getLogger("broker.auth")

MAX_DOCUMENT_BYTES = 256 * 1024


class JwksUnavailable(Exception):
    """No keys could be obtained and none are cached."""


class JwksCache:
    def __init__(
        self,
        issuer: str,
        *,
        http: httpx2.AsyncClient,
        ttl: float = 600,
        cooldown: float = 30,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._issuer = issuer.rstrip("/")
        self._http = http
        self._ttl = ttl
        self._cooldown = cooldown
        self._clock = clock
        self._metadata: dict[str, object] | None = None
        self._keys: KeySet | None = None
        self._kids: frozenset[str] = frozenset()
        self._fetched_at = float("-inf")
        self._attempted_at = float("-inf")
        self._lock = asyncio.Lock()
        self.fetch_count = 0

    async def keys_for(self, kid: str | None) -> KeySet:
        """Keys to verify a token whose header names `kid`.

        Raises:
            JwksUnavailable: nothing cached and the issuer is unreachable.
        """
        now = self._clock()
        stale = now - self._fetched_at > self._ttl
        unknown = kid is not None and kid not in self._kids
        if stale or unknown:
            if now - self._attempted_at >= self._cooldown:
                async with self._lock:
                    if self._clock() - self._attempted_at >= self._cooldown:
                        await self._refresh()
            elif self._lock.locked():
                async with self._lock:  # a refresh is in flight: wait for its keys
                    pass
        if self._keys is None:
            raise JwksUnavailable()
        return self._keys

    async def metadata(self) -> dict[str, object]:
        """The issuer's OIDC discovery document (cached with the keys).

        Raises:
            JwksUnavailable: never fetched and the issuer is unreachable.
        """
        if self._metadata is None:
            await self.keys_for(None)
        if self._metadata is None:
            raise JwksUnavailable()
        return self._metadata

    async def _refresh(self) -> None:
        self._attempted_at = self._clock()
        try:
            metadata = await self._get_json(f"{self._issuer}/.well-known/openid-configuration")
            jwks_uri = metadata.get("jwks_uri")
            if not isinstance(jwks_uri, str):
                raise ValueError("issuer metadata has no jwks_uri")
            document = await self._get_json(jwks_uri)
            keys = KeySet.import_key_set(document)  # type: ignore[arg-type]
        except (httpx2.HTTPError, JoseError, ValueError, TypeError, KeyError) as exc:
            # JoseError: a key set the library rejects (e.g. a truncated key) is a failed refresh
            # too; letting it escape would turn a JWKS problem into 500s instead of keeping keys.
            logger.warning("jwks.refresh_failed reason=%s", type(exc).__name__)
            return
        self.fetch_count += 1
        self._metadata = metadata
        self._keys = keys
        self._kids = frozenset(str(key.kid) for key in keys.keys if key.kid)
        self._fetched_at = self._clock()

    async def _get_json(self, url: str) -> dict[str, object]:
        response = await self._http.get(url, headers={"Accept": "application/json"})
        response.raise_for_status()
        if len(response.content) > MAX_DOCUMENT_BYTES:
            raise ValueError("document too large")
        document = response.json()
        if not isinstance(document, dict):
            raise ValueError("not a JSON object")
        return document


class ProviderIssuers:
    """Discovery and keys of third-party OpenID providers, one cache per issuer."""

    def __init__(self, http: httpx2.AsyncClient) -> None:
        self._http = http
        self._caches: dict[str, JwksCache] = {}

    def __call__(self, issuer: str) -> JwksCache:
        cache = self._caches.get(issuer)
        if cache is None:
            cache = self._caches[issuer] = JwksCache(issuer, http=self._http)
        return cache
