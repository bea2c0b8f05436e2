"""MCP resource-server side: verify the IdP's JWT access tokens (spec/DIGEST.md §6).

Signature with joserfc against the issuer's JWKS and a fixed algorithm allow-list (never `none`,
never HMAC for an asymmetric IdP); `exp`, `iss`, `aud` (= the broker's canonical /mcp URL) and the
identity claim are required. Verified tokens are cached by digest until they expire, so a client
reusing its token pays for the signature check once.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from joserfc import jws, jwt
from joserfc.errors import ExpiredTokenError, JoseError
from joserfc.jwt import JWTClaimsRegistry

from app.auth.jwks import JwksCache, JwksUnavailable
from app.auth.principal import McpCaller, Principal
from app.storable import MAX_SUBJECT_LENGTH, unstorable_reason, unstorable_subject_reason

logger = logging.getLogger("broker.auth")

MAX_TOKEN_LENGTH = 16 * 1024
CACHE_SIZE = 10_000
LEEWAY_SECONDS = 60
MAX_CLAIM_LENGTH = MAX_SUBJECT_LENGTH  # the client id column is as wide as the subject's


class InvalidToken(Exception):
    """The bearer token is missing, malformed, expired or not for us. `reason` is for logs.
    `expired`: signed by the issuer for us, and only past its expiry (a client due to refresh,
    not a forgery). `claim`: the claim found missing or wrong (`aud`: a token for another
    resource), if that is what is wrong."""

    def __init__(self, reason: str, *, expired: bool = False, claim: str | None = None) -> None:
        super().__init__(reason)
        self.reason = reason
        self.expired = expired
        self.claim = claim


def _claim_refused(exc: Exception) -> InvalidToken:
    claim = getattr(exc, "claim", None)
    return InvalidToken(type(exc).__name__, claim=claim if isinstance(claim, str) else None)


class _ClaimsApartFromExpiry(JWTClaimsRegistry):
    """The same claim checks without the expiry: what else is wrong with an expired token."""

    def validate_exp(self, value: object) -> None:
        return None


class IdpUnavailable(Exception):
    """The IdP's keys could not be fetched and none are cached."""


@dataclass(frozen=True)
class _Verified:
    caller: McpCaller
    expires_at: float


class TokenVerifier:
    def __init__(
        self,
        *,
        issuer: str,
        audience: str,
        identity_claim: str,
        algorithms: tuple[str, ...],
        jwks: JwksCache,
        require_at_jwt: bool = False,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._issuer = issuer
        self._require_at_jwt = require_at_jwt
        self._audience = audience
        self._identity_claim = identity_claim
        self._algorithms = list(algorithms)
        self._jwks = jwks
        self._clock = clock
        claims: dict[str, Any] = {
            "iss": {"essential": True, "value": issuer},
            "aud": {"essential": True, "value": audience},
            "exp": {"essential": True},
            identity_claim: {"essential": True},
        }

        def now() -> int:
            return int(self._clock())

        self._claims = JWTClaimsRegistry(now=now, leeway=LEEWAY_SECONDS, **claims)
        self._claims_apart_from_expiry = _ClaimsApartFromExpiry(
            now=now, leeway=LEEWAY_SECONDS, **claims
        )
        self._cache: OrderedDict[bytes, _Verified] = OrderedDict()
        # digests of genuine tokens found expired: replayed, they are refused without a signature
        # check (and, like any expired token, not counted as a failed authentication)
        self._expired: OrderedDict[bytes, None] = OrderedDict()

    def cached(self, token: str) -> McpCaller | None:
        """The caller of a token this verifier has already verified and that has not expired;
        None for any other token (nothing is checked)."""
        if len(token) > MAX_TOKEN_LENGTH:
            return None
        key = hashlib.sha256(token.encode()).digest()
        cached = self._cache.get(key)
        if cached is None or cached.expires_at <= self._clock() - LEEWAY_SECONDS:
            return None
        self._cache.move_to_end(key)
        return cached.caller

    async def verify(self, token: str) -> McpCaller:
        """Return the caller a valid access token stands for, its signature and claims checked
        (callers ask `cached` first), and remember it.

        Raises:
            InvalidToken: anything wrong with the token.
            IdpUnavailable: the IdP's keys are unknown and unreachable.
        """
        if not token or len(token) > MAX_TOKEN_LENGTH:
            raise InvalidToken("length")
        key = hashlib.sha256(token.encode()).digest()
        if key in self._expired:
            raise InvalidToken("expired", expired=True)
        try:
            verified = await self._verify(token)
        except InvalidToken as exc:
            if exc.expired:
                self._expired[key] = None
                if len(self._expired) > CACHE_SIZE:
                    self._expired.popitem(last=False)
            raise
        self._cache[key] = verified
        if len(self._cache) > CACHE_SIZE:
            self._cache.popitem(last=False)
        return verified.caller

    async def _verify(self, token: str) -> _Verified:
        try:
            header = jws.extract_compact(token.encode()).protected
        except (JoseError, ValueError, UnicodeDecodeError):
            raise InvalidToken("malformed") from None
        if header.get("alg") not in self._algorithms:
            raise InvalidToken("algorithm")
        if self._require_at_jwt and not _is_at_jwt(header.get("typ")):
            raise InvalidToken("typ")
        kid = header.get("kid")
        try:
            keys = await self._jwks.keys_for(kid if isinstance(kid, str) else None)
        except JwksUnavailable:
            raise IdpUnavailable() from None
        try:
            decoded = jwt.decode(token, keys, algorithms=self._algorithms)
        except (JoseError, ValueError, TypeError) as exc:
            raise InvalidToken(type(exc).__name__) from None
        claims = decoded.claims
        self._validate(claims)
        subject = claims.get(self._identity_claim)
        if not isinstance(subject, str) or not _storable(subject):
            raise InvalidToken("identity_claim")
        client_id = str(claims.get("client_id") or claims.get("azp") or "")[:MAX_CLAIM_LENGTH]
        if unstorable_reason(client_id):
            raise InvalidToken("client_id")
        return _Verified(
            caller=McpCaller(
                principal=Principal(issuer=self._issuer, subject=subject),
                client_id=client_id,
                scopes=_scopes(claims),
            ),
            expires_at=float(claims["exp"]),
        )

    def _validate(self, claims: dict[str, Any]) -> None:
        """The claims of a token whose signature holds; an expired one is told apart when
        nothing else is wrong with it."""
        try:
            self._claims.validate(claims)
        except ExpiredTokenError:
            try:
                self._claims_apart_from_expiry.validate(claims)
            except (JoseError, ValueError, TypeError) as exc:
                raise _claim_refused(exc) from None
            raise InvalidToken("expired", expired=True) from None
        except (JoseError, ValueError, TypeError) as exc:
            raise _claim_refused(exc) from None


def _is_at_jwt(typ: object) -> bool:
    """RFC 9068 §2.1: an access token's `typ` is `at+jwt`; RFC 7515 §4.1.9 lets it be written
    as the full media type, and media types compare without regard to case."""
    if not isinstance(typ, str):
        return False
    value = typ.lower()
    return value in ("at+jwt", "application/at+jwt")


def _storable(subject: str) -> bool:
    """Whether the identity claim can be the subject of a stored principal (app/storable.py).
    Refused here, such a claim is an invalid token; let through, it would fail the first
    statement that stores it."""
    return unstorable_subject_reason(subject) is None


def _scopes(claims: dict[str, object]) -> frozenset[str]:
    scope = claims.get("scope")
    if isinstance(scope, str):
        return frozenset(scope.split())
    scp = claims.get("scp")
    if isinstance(scp, list):
        return frozenset(str(item) for item in scp)
    if isinstance(scp, str):
        return frozenset(scp.split())
    return frozenset()


def bearer_token(authorization: str | None) -> str | None:
    """The token of an `Authorization: Bearer …` header, or None."""
    if not authorization:
        return None
    scheme, _, token = authorization.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return None
    return token.strip()


def challenge(
    resource_metadata_url: str,
    *,
    error: str | None = None,
    scope: str = "",
    description: str | None = None,
) -> str:
    """A `WWW-Authenticate` value (RFC 6750 §3, RFC 9728 §5.1)."""
    parts = [f'resource_metadata="{resource_metadata_url}"']
    if error:
        parts.insert(0, f'error="{error}"')
    if scope:
        parts.append(f'scope="{scope}"')
    if description:
        parts.append(f'error_description="{description}"')
    return "Bearer " + ", ".join(parts)
