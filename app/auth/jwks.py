"""The identity provider's signing keys, fetched through OIDC discovery and cached.

- Fetched lazily, refreshed after `ttl`; a failed refresh keeps the last-known-good set, so one
  JWKS outage does not become an authentication outage (SECURITY.md A12).
- An unknown `kid` triggers at most one refetch per `cooldown` (A2, A11), behind one lock so
  concurrent misses cause one fetch.
- Only HTTPS (or loopback HTTP) URLs from the issuer's own metadata are fetched; token headers such
  as `jku`/`x5u` are never followed. A discovery document is used only if it names exactly the
  configured issuer (OpenID Connect Discovery 1.0 §4.3) and each URL of it the broker uses passes
  the rule configured URLs pass (`check_metadata`); otherwise it is refused as a failed refresh.
- A document is read up to MAX_DOCUMENT_BYTES (counted as it arrives) and must be a JSON object;
  one nested too deeply to parse is as unusable as one that is not JSON.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable

import httpx2
from joserfc.errors import JoseError
from joserfc.jwk import KeySet

from app.urls import validate_public_url

logger = logging.getLogger("broker.auth")

MAX_DOCUMENT_BYTES = 256 * 1024
# The discovery document's URLs the broker uses: keys are fetched from the first, browsers sent to
# the second, codes (and the client secret) sent to the third. Only `jwks_uri` must be present.
DISCOVERED_URLS = ("jwks_uri", "authorization_endpoint", "token_endpoint")


class JwksUnavailable(Exception):
    """No keys could be obtained and none are cached."""


class MetadataRefused(Exception):
    """A discovery document the broker must not use. `reason` names the member and the rule,
    never a value from the document, so it is safe to log."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def check_metadata(metadata: dict[str, object], issuer: str) -> None:
    """A discovery document is usable only if its `issuer` is exactly the configured `issuer`
    (OpenID Connect Discovery 1.0 §4.3) and every URL of DISCOVERED_URLS it holds passes the
    rule of the configured URLs (`validate_public_url`: https, or http to a loopback host; no user
    info, query or fragment).

    Raises:
        MetadataRefused: the first fault found.
    """
    if metadata.get("issuer") != issuer:
        raise MetadataRefused("issuer: not exactly the configured issuer (Discovery 1.0 §4.3)")
    for name in DISCOVERED_URLS:
        value = metadata.get(name)
        if value is None and name != "jwks_uri":
            continue
        if not isinstance(value, str):
            raise MetadataRefused(f"{name}: missing or not a string")
        try:
            validate_public_url(value)
        except ValueError as exc:
            raise MetadataRefused(f"{name}: {exc}") from None


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
        self._issuer = issuer  # as configured: what the discovery document must name exactly
        self._discovery_url = f"{issuer.rstrip('/')}/.well-known/openid-configuration"
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
        """The issuer's OIDC discovery document (cached with the keys), as `check_metadata`
        passed it: it names this issuer, and the URLs of DISCOVERED_URLS it holds are safe to use.

        Raises:
            JwksUnavailable: no usable document yet (issuer unreachable, or its document refused).
        """
        if self._metadata is None:
            await self.keys_for(None)
        if self._metadata is None:
            raise JwksUnavailable()
        return self._metadata

    async def _refresh(self) -> None:
        self._attempted_at = self._clock()
        try:
            metadata = await self._get_json(self._discovery_url)
            check_metadata(metadata, self._issuer)
            document = await self._get_json(str(metadata["jwks_uri"]))
            keys = KeySet.import_key_set(document)  # type: ignore[arg-type]
        except MetadataRefused as exc:
            # nothing the document names is fetched: the operator learns which member is wrong
            logger.warning("jwks.metadata_refused issuer=%s reason=%s", self._issuer, exc.reason)
            return
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
        """The JSON object at `url`, its body read only up to MAX_DOCUMENT_BYTES.

        Raises:
            httpx2.HTTPError: no answer, or not a 2xx one.
            ValueError: too large, not JSON (or nested too deeply to parse), not an object.
        """
        chunks: list[bytes] = []
        size = 0
        async with self._http.stream("GET", url, headers={"Accept": "application/json"}) as answer:
            answer.raise_for_status()
            async for chunk in answer.aiter_bytes():  # decoded bytes: a compressed body too
                size += len(chunk)
                if size > MAX_DOCUMENT_BYTES:
                    raise ValueError("document too large")
                chunks.append(chunk)
        try:
            document = json.loads(b"".join(chunks))
        except RecursionError:
            raise ValueError("document nested too deeply") from None
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
