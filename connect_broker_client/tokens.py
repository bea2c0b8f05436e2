"""A TokenVerifier for the sibling's own MCP access tokens: RFC 9068 JWTs from the OIDC IdP.

The sibling is a resource server of the same IdP as the broker, with its own audience (its `/mcp`
URL). A token is accepted only with header `typ: at+jwt`, an allowed algorithm, a key from the
issuer's JWKS (found through OIDC discovery, never through `jku`/`x5u` headers), and `iss`, `aud`,
`exp` and `sub` present and valid, and the identity claim (the broker's `identity.identity_claim`)
one the broker takes as a user's name. Keys are cached; an unknown `kid` refetches at most once per
`cooldown` seconds. Any failure answers None, which the SDK turns into a 401.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Sequence
from typing import Any

import httpx2
import jwt
from mcp.server.auth.provider import AccessToken

logger = logging.getLogger("connect_broker_client")

MAX_DOCUMENT_BYTES = 256 * 1024
MAX_IDENTITY_CHARS = 255  # the broker's bound on an issuer's and a user's names
ACCESS_TOKEN_TYPES = ("at+jwt", "application/at+jwt")


class IdpTokenVerifier:
    """`MCPServer(token_verifier=IdpTokenVerifier(issuer, audience), auth=AuthSettings(...))`."""

    def __init__(
        self,
        issuer: str,
        audience: str,
        *,
        identity_claim: str = "sub",
        algorithms: Sequence[str] = ("RS256", "PS256", "ES256", "EdDSA"),
        leeway: float = 30,
        ttl: float = 600,
        cooldown: float = 30,
        http: httpx2.AsyncClient | None = None,
    ) -> None:
        self.issuer = issuer
        self.audience = audience
        self.identity_claim = identity_claim
        self.algorithms = tuple(algorithms)
        self.leeway = leeway
        self._ttl = ttl
        self._cooldown = cooldown
        self._http = http or httpx2.AsyncClient(timeout=10, follow_redirects=False)
        self._owns_http = http is None
        self._keys: dict[str, tuple[jwt.PyJWK, str | None]] = {}  # kid -> (key, its declared alg)
        self._fetched_at = self._attempted_at = float("-inf")
        self._lock = asyncio.Lock()

    async def aclose(self) -> None:
        if self._owns_http:
            await self._http.aclose()

    async def verify_token(self, token: str) -> AccessToken | None:
        try:
            header = jwt.get_unverified_header(token)
        except jwt.PyJWTError:
            return None
        algorithm, kid = header.get("alg"), header.get("kid")
        if algorithm not in self.algorithms or not isinstance(kid, str):
            return None
        if str(header.get("typ", "")).lower() not in ACCESS_TOKEN_TYPES:
            return None  # an ID token or another JWT is not an access token (RFC 9068 §4)
        found = await self._key(kid)
        if found is None or found[1] not in (None, algorithm):
            return None
        try:
            claims: dict[str, Any] = jwt.decode(
                token,
                found[0].key,
                algorithms=[algorithm],
                audience=self.audience,
                issuer=self.issuer,
                leeway=self.leeway,
                options={"require": ["exp", "iss", "aud", "sub"]},
            )
        except jwt.PyJWTError as exc:
            logger.info("access_token.refused reason=%s", type(exc).__name__)
            return None
        if not _storable_name(claims.get(self.identity_claim)):
            logger.info("access_token.refused reason=identity_claim")
            return None
        return AccessToken(
            token=token,
            client_id=str(claims.get("client_id") or claims.get("azp") or ""),
            scopes=str(claims.get("scope", "")).split(),
            expires_at=int(claims["exp"]),
            resource=self.audience,
            subject=str(claims["sub"]),
            claims=claims,
        )

    async def _key(self, kid: str) -> tuple[jwt.PyJWK, str | None] | None:
        if self._needs_refresh(kid):
            async with self._lock:
                if self._needs_refresh(kid):
                    await self._refresh()
        return self._keys.get(kid)

    def _needs_refresh(self, kid: str) -> bool:
        now = time.monotonic()
        stale = kid not in self._keys or now - self._fetched_at > self._ttl
        return stale and now - self._attempted_at >= self._cooldown

    async def _refresh(self) -> None:
        self._attempted_at = time.monotonic()
        try:
            metadata = await self._get_json(
                f"{self.issuer.rstrip('/')}/.well-known/openid-configuration"
            )
            if metadata.get("issuer") != self.issuer:
                raise ValueError("discovery issuer mismatch")
            document = await self._get_json(str(metadata["jwks_uri"]))
            entries = [entry for entry in document["keys"] if isinstance(entry, dict)]
        except (httpx2.HTTPError, ValueError, KeyError, TypeError) as exc:
            logger.warning("jwks.refresh_failed reason=%s", type(exc).__name__)
            return  # keep the last good keys (one JWKS outage is not an authentication outage)
        self._keys = dict(filter(None, map(_signing_key, entries)))
        self._fetched_at = time.monotonic()

    async def _get_json(self, url: str) -> dict[str, Any]:
        """The JSON object at `url`, its body read only up to MAX_DOCUMENT_BYTES (decoded, so a
        compressed body too): an endless or huge answer is refused as it arrives.

        Raises:
            httpx2.HTTPError: no answer, or not a 2xx one.
            ValueError: too large, not JSON (or nested too deeply to parse), not an object.
        """
        chunks: list[bytes] = []
        size = 0
        async with self._http.stream("GET", url, headers={"Accept": "application/json"}) as answer:
            answer.raise_for_status()
            async for chunk in answer.aiter_bytes():
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


def _storable_name(value: object) -> bool:
    """Whether `value` is a user's name the broker takes: text of 1 to MAX_IDENTITY_CHARS
    characters, without the NUL or unpaired surrogates a database refuses."""
    return (
        isinstance(value, str)
        and 0 < len(value) <= MAX_IDENTITY_CHARS
        and "\x00" not in value
        and not any("\ud800" <= ch <= "\udfff" for ch in value)
    )


def _signing_key(entry: dict[str, Any]) -> tuple[str, tuple[jwt.PyJWK, str | None]] | None:
    """(kid, (key, declared alg)) of a JWKS entry usable for signatures, else None."""
    kid, algorithm = entry.get("kid"), entry.get("alg")
    if not isinstance(kid, str) or entry.get("use", "sig") != "sig":
        return None
    try:
        key = jwt.PyJWK(entry)
    except jwt.PyJWTError:
        return None  # a key type or curve this library cannot use: skip it, keep the others
    return kid, (key, algorithm if isinstance(algorithm, str) else None)
