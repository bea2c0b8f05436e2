"""The OAuth legs of a connect flow: start (state + PKCE) and callback (claim, exchange, store).

Order at the callback matters (SECURITY.md §0 items 1, 4, 5): find the flow by the digest of
`state`, check the provider path and the browser's identity against the flow *before* looking at
`error=` or calling the token endpoint (a forwarded authorize URL, T2, is refused without any
exchange); then claim the flow atomically (`authorizing → exchanging`), exchange with a total
deadline, and store the sealed tokens together with the flow's completion in one transaction.
A provider failure puts the flow back to `pending` with the reason, so the user can start again
before it expires; nothing is stored.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import httpx2
from joserfc import jws, jwt
from joserfc.errors import JoseError
from joserfc.jwt import JWTClaimsRegistry
from sqlalchemy.ext.asyncio import AsyncSession

from app import credentials
from app.audit import Actor
from app.auth.jwks import JwksUnavailable, ProviderIssuers
from app.clock import utcnow
from app.config import SIGNATURE_ALGORITHMS
from app.connect import revocations
from app.connect import service as flows
from app.connect.notify import FlowNotifier
from app.connect.service import FlowView
from app.crypto import Digester, InvalidSeal, Keys, random_token, seal, unseal
from app.models import NO_ACCOUNT_ID, FlowStatus
from app.providers import oauth
from app.providers.settings import OAuthProviderSettings
from app.security_log import SecurityLog
from app.tables import connections as connections_table
from app.tables import flows as flows_table

logger = logging.getLogger("broker.security")

STARTABLE = (FlowStatus.pending, FlowStatus.authorizing)
PKCE_PURPOSE = "pkce:v1"
# RFC 6749 §4.1.2.1 error codes other than access_denied (which is the user's decline)
AUTHORIZE_ERRORS = frozenset(
    {
        "invalid_request",
        "unauthorized_client",
        "invalid_scope",
        "server_error",
        "temporarily_unavailable",
        "unsupported_response_type",
    }
)


class CallbackRefused(Exception):
    """The callback cannot proceed; `status` and `reason` say why (no exchange happened)."""

    def __init__(self, status: int, reason: str, flow: FlowView | None = None) -> None:
        super().__init__(reason)
        self.status = status
        self.reason = reason
        self.flow = flow


@dataclass(frozen=True)
class Endpoints:
    authorize_url: str
    token_url: str


async def fail(session: AsyncSession, *, flow: FlowView, reason: str) -> None:
    """`exchanging → pending`: nothing stored, the user may start again before expiry."""
    await flows.transition(
        session,
        flow_id=flow.id,
        principal=flow.principal,
        from_statuses=(FlowStatus.exchanging,),
        to_status=FlowStatus.pending,
        only_unexpired=False,
        failure=reason[:64],
        sealed_pkce_verifier=None,
    )


class OAuthGrants:
    """The OAuth legs of connect flows, with what they share: the broker's public URL (for the
    redirect URI), its keys, third-party issuers' discovery, the flow notifier and the
    security log."""

    def __init__(
        self,
        *,
        public_url: str,
        keys: Keys,
        issuers: ProviderIssuers,
        http: httpx2.AsyncClient,
        notifier: FlowNotifier,
        security: SecurityLog,
    ) -> None:
        self._public_url = public_url
        self._keys = keys
        self._issuers = issuers
        self.http = http
        self._notifier = notifier
        self._security = security
        self._state_digest = Digester(keys.signing, "oauth-state")

    async def issuer_metadata(self, issuer: str) -> dict[str, object]:
        """A third-party issuer's discovery document.

        Raises:
            JwksUnavailable: never fetched and the issuer is unreachable.
        """
        return await self._issuers(issuer).metadata()

    def redirect_uri(self, provider_name: str) -> str:
        return f"{self._public_url}/oauth/{provider_name}/callback"

    async def endpoints(self, provider: OAuthProviderSettings) -> Endpoints:
        """Configured endpoints, or those an `oidc` provider's discovery document names. The
        document is one `check_metadata` passed (app/auth/jwks.py): it names exactly the
        configured issuer, and its endpoints pass the rule of configured URLs (https, or http to
        loopback); a document that does not is refused and logged, never used.

        Raises:
            oauth.UpstreamError: discovery failed, or its document was refused.
        """
        if provider.authorize_url and provider.token_url:
            return Endpoints(provider.authorize_url, provider.token_url)
        assert provider.issuer is not None
        try:
            metadata = await self._issuers(provider.issuer).metadata()
        except JwksUnavailable:
            raise oauth.UpstreamError("discovery_failed") from None
        authorize, token = metadata.get("authorization_endpoint"), metadata.get("token_endpoint")
        if not isinstance(authorize, str) or not isinstance(token, str):
            raise oauth.UpstreamError("discovery_incomplete")
        return Endpoints(provider.authorize_url or authorize, provider.token_url or token)

    async def start(
        self,
        session: AsyncSession,
        *,
        flow: FlowView,
        provider: OAuthProviderSettings,
    ) -> str | None:
        """Arm the flow with a fresh single-use state and PKCE verifier; the authorize URL to send
        the browser to, or None if the flow can no longer be started.

        The endpoints come first: an `oidc` provider's discovery document may have to be
        fetched, and no row lock is held while it is (the caller has ended its reads: no
        connection either).
        """
        target = await self.endpoints(provider)
        state, verifier = random_token(), random_token() + random_token()
        won = await flows.transition(
            session,
            flow_id=flow.id,
            principal=flow.principal,
            from_statuses=STARTABLE,
            to_status=FlowStatus.authorizing,
            state_digest=self._state_digest(state),
            sealed_pkce_verifier=seal(
                verifier.encode(), purpose=f"{PKCE_PURPOSE}|{flow.id}", keys=self._keys.sealing
            ),
            failure=None,
        )
        if not won:
            return None
        return oauth.authorize_url(
            provider,
            endpoint=target.authorize_url,
            redirect_uri=self.redirect_uri(flow.provider),
            state=state,
            verifier=verifier,
            scopes=flow.scopes,
        )

    async def flow_for_state(self, session: AsyncSession, state: str) -> FlowView | None:
        flow_id = await session.scalar(flows_table.id_by_state(self._state_digest(state)))
        return await flows.get(session, flow_id=flow_id) if flow_id else None

    async def claim(self, session: AsyncSession, *, flow: FlowView, state: str) -> str:
        """Move `authorizing → exchanging` (exactly one winner) and return the PKCE verifier.

        A claim whose verifier is missing or no configured key opens (a key removed while the
        flow was at the provider) puts the flow back to `pending` in the same transaction,
        failed with that reason, so that the user can start again at once rather than find it
        stuck `exchanging` until its lease runs out.

        Raises:
            CallbackRefused: someone else won, or the flow moved on, or its verifier is unusable.
        """
        statement = flows_table.claim(flow.id, self._state_digest(state), utcnow())
        row = (await session.execute(statement)).first()
        if row is None:
            raise CallbackRefused(409, "already_used", flow)
        try:
            if row[0] is None:
                raise InvalidSeal("no verifier")
            return unseal(
                row[0], purpose=f"{PKCE_PURPOSE}|{flow.id}", keys=self._keys.sealing
            ).decode()
        except InvalidSeal:
            await fail(session, flow=flow, reason="verifier_unreadable")
            raise CallbackRefused(400, "verifier_unreadable", flow) from None

    async def complete(
        self,
        session: AsyncSession,
        *,
        provider: OAuthProviderSettings,
        flow: FlowView,
        tokens: oauth.TokenSet,
        account: oauth.AccountIdentity,
    ) -> bool:
        """Store the sealed tokens and complete the flow, in the caller's single transaction."""
        won = await flows.transition(
            session,
            flow_id=flow.id,
            principal=flow.principal,
            from_statuses=(FlowStatus.exchanging,),
            to_status=FlowStatus.completed,
            only_unexpired=False,
            event="flow.completed",
            actor=Actor.user(flow.principal),
            sealed_pkce_verifier=None,
            account_label=account.label,
            failure=None,
        )
        if not won:
            return False
        await self._revoke_replaced(session, provider, flow, tokens, account)
        await credentials.store(
            session,
            keys=self._keys.sealing,
            principal=flow.principal,
            provider=flow.provider,
            audience=flow.audience,
            secret=tokens.secret(),
            scopes=tokens.scopes,
            account_label=account.label,
            account_id=account.account_id,
            expires_at=tokens.expires_at,
        )
        await self._notifier.publish(session, flow.id)
        self._security.event("credential.stored", flow_id=flow.id)
        return True

    async def _revoke_replaced(
        self,
        session: AsyncSession,
        provider: OAuthProviderSettings,
        flow: FlowView,
        tokens: oauth.TokenSet,
        account: oauth.AccountIdentity,
    ) -> None:
        """A new grant of an account the user holds replaces its connection (or adopts the one
        made before accounts were told apart): the replaced token would stay valid at the
        provider with nobody holding it, so its revocation is queued, due at once, in the same
        transaction (this token only). Only where the provider revokes one token without ending
        the new grant with it (`revokes_one_token`), and never when the provider handed back
        the very token it replaces."""
        if not provider.revokes_one_token or account.account_id == NO_ACCOUNT_ID:
            return
        statement = connections_table.replaced_by_grant(
            flow.principal, flow.provider, flow.audience, account.account_id, account.label
        )
        row = await session.scalar(statement)
        old = credentials.open_row(row, keys=self._keys.sealing) if row is not None else None
        if row is None or not old or old.get("access_token") == tokens.access_token:
            return
        await revocations.queue(session, row, due_now=True, token_only=True)
        logger.info("token.replaced flow_id=%s revocation=queued", flow.id)

    async def provider_refused(self, session: AsyncSession, *, flow: FlowView, error: str) -> None:
        """The provider sent the browser back with `error=` (state and session already checked).

        `access_denied` is the user's "no": the flow is declined. Any other error is the provider's
        problem: `authorizing → pending` with the reason, so the page says what happened and the
        user can start again. Only known RFC 6749 codes are kept (the value is request input).
        """
        if error == "access_denied":
            to_status, failure, event = FlowStatus.declined, None, "flow.declined"
        else:
            to_status, event = FlowStatus.pending, None
            failure = f"authorize_error:{error}" if error in AUTHORIZE_ERRORS else "authorize_error"
        if await flows.transition(
            session,
            flow_id=flow.id,
            principal=flow.principal,
            from_statuses=(FlowStatus.authorizing,),
            to_status=to_status,
            event=event,
            actor=Actor.user(flow.principal),
            sealed_pkce_verifier=None,
            failure=failure,
        ):
            await self._notifier.publish(session, flow.id)

    async def verify_id_token(
        self, provider: OAuthProviderSettings, tokens: oauth.TokenSet, state: str
    ) -> dict[str, Any]:
        """For `oidc` providers: the ID token must be signed by the issuer, for us, with our nonce.
        Returns its claims ({} for other providers).

        Raises:
            oauth.UpstreamError: missing or invalid ID token.
        """
        if provider.kind != "oidc":
            return {}
        if tokens.id_token is None:
            raise oauth.UpstreamError("id_token_missing")
        assert provider.issuer is not None
        try:
            header = jws.extract_compact(tokens.id_token.encode()).protected
            kid = header.get("kid")
            keys = await self._issuers(provider.issuer).keys_for(
                kid if isinstance(kid, str) else None
            )
            decoded = jwt.decode(tokens.id_token, keys, algorithms=list(SIGNATURE_ALGORITHMS))
            JWTClaimsRegistry(
                leeway=60,
                iss={"essential": True, "value": provider.issuer},
                aud={"essential": True, "value": provider.client_id},
                exp={"essential": True},
                nonce={"essential": True, "value": oauth.nonce_for(state)},
            ).validate(decoded.claims)
        except (JoseError, ValueError, JwksUnavailable):
            raise oauth.UpstreamError("id_token_invalid") from None
        return dict(decoded.claims)
