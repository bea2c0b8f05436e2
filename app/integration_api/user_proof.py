"""The user's own access token as proof of the user, for services with `user_proof = "token"`.

Such a service never names a user: it sends the access token the user's MCP client sent it (for
its own `token_audience` at the broker's IdP), and the broker takes issuer and subject from that
token, verified as `/mcp` verifies its own (app/auth/bearer.py: signature against the IdP's JWKS,
issuer, audience, expiry, identity claim). A leaked service secret alone reads no one's
credential.

A token that fails verification counts against the sender's address like a wrong service secret
(app/limits.py), expired ones included: the sibling verified the token before sending it, so an
expired one is not a routine refresh. Once the address has spent its budget, only tokens this
process has verified before are taken. The log names the service and the reason, never the token.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from app.auth.bearer import IdpUnavailable, InvalidToken, TokenVerifier
from app.auth.jwks import JwksCache
from app.auth.principal import Principal
from app.config import Settings
from app.integration_api.problems import (
    IdentityProviderUnavailable,
    SubjectTokenExpired,
    SubjectTokenInvalid,
    SubjectTokenWrongAudience,
    TooManyFailedAuthentications,
    UserProofNotEnabled,
)
from app.integration_api.services import Service
from app.security_log import SecurityLog

FAILED_EVENT = "service.user_proof_failed"


@dataclass(frozen=True, slots=True)
class UserProofs:
    """A verifier per service that proves its users with their tokens (by service name)."""

    verifiers: Mapping[str, TokenVerifier]
    security: SecurityLog

    def required(self, service: str) -> bool:
        """Whether `service` must prove the user (one dict lookup: the hot path asks)."""
        return service in self.verifiers

    async def principal(self, service: Service, token: str, address: str) -> Principal:
        """The user `token` stands for, if it is a valid access token for the service's audience.

        Raises:
            UserProofNotEnabled: the service names users instead.
            TooManyFailedAuthentications: `address` has spent its budget (a new token only).
            SubjectTokenInvalid: and its subclasses, for an expired token or another audience.
            IdentityProviderUnavailable: the IdP's keys are unknown and unreachable.
        """
        verifier = self.verifiers.get(service.name)
        if verifier is None:
            raise UserProofNotEnabled()
        known = verifier.cached(token)
        if known is not None:
            return known.principal
        wait = self.security.failed_auth_wait(address)
        if wait:
            raise TooManyFailedAuthentications(wait)
        try:
            caller = await verifier.verify(token)
        except InvalidToken as exc:
            self.security.note_failed_authentication(address)
            refusal = _refusal(exc)
            self.security.event(
                FAILED_EVENT,
                service=service.name,
                reason=refusal.code,
                detail=exc.reason,
                address=address,
            )
            raise refusal from None
        except IdpUnavailable:
            raise IdentityProviderUnavailable() from None
        return caller.principal


def _refusal(exc: InvalidToken) -> SubjectTokenInvalid:
    if exc.expired:
        return SubjectTokenExpired()
    if exc.claim == "aud":
        return SubjectTokenWrongAudience()
    return SubjectTokenInvalid()


def user_proofs(settings: Settings, jwks: JwksCache, security: SecurityLog) -> UserProofs:
    """A verifier for each configured `user_proof = "token"` service, all on the IdP's keys."""
    identity = settings.identity
    verifiers = {
        name: TokenVerifier(
            issuer=identity.issuer,
            audience=service.token_audience,
            identity_claim=identity.identity_claim,
            algorithms=identity.algorithms,
            jwks=jwks,
            require_at_jwt=identity.require_at_jwt,
        )
        for name, service in settings.services.items()
        if service.user_proof == "token" and service.token_audience is not None
    }
    return UserProofs(verifiers, security)
