"""OAuth routes of the connect flow: POST /connect/{flow_id}/start and the provider callback."""

from __future__ import annotations

import contextlib
import logging
from dataclasses import replace

from fastapi import APIRouter, Request
from sqlalchemy.ext.asyncio import AsyncSession
from starlette.responses import RedirectResponse, Response

from app.auth.browser import BrowserSessions
from app.auth.jwks import JwksUnavailable
from app.config import Settings
from app.connect import oauth_service
from app.connect.oauth_service import CallbackRefused, OAuthGrants
from app.connect.revocations import Issued, Revoker
from app.connect.service import FlowView
from app.deps import (
    BrowserSessionsDep,
    OAuthGrantsDep,
    RevokerDep,
    SecurityDep,
    SessionDep,
    SettingsDep,
)
from app.errors import DATABASE_ERRORS, BrokerError, NotFound
from app.models import FlowStatus
from app.pages.access import SignedInPost, flow_for_user
from app.providers import oauth
from app.providers.settings import OAuthProviderSettings
from app.security_log import SecurityLog
from app.templating import html_security_headers, render

logger = logging.getLogger("broker.security")
router = APIRouter(include_in_schema=False)

MAX_PARAM_LENGTH = 2048


class StartUnavailable(BrokerError):
    status_code = 502
    code = "provider_unavailable"
    title = "The provider could not be reached"
    message = "The broker could not prepare the sign-in at the provider."
    next_step = "Reload this page and try again in a moment."


@router.post("/connect/{flow_id}/start", name="connect:start")
async def start(
    request: Request,
    flow_id: str,
    posted: SignedInPost,
    session: SessionDep,
    settings: SettingsDep,
    sessions: BrowserSessionsDep,
    security: SecurityDep,
    grants: OAuthGrantsDep,
) -> Response:
    flow = await flow_for_user(session, flow_id, posted.user, sessions=sessions, security=security)
    provider = settings.providers.get(flow.provider)
    if not isinstance(provider, OAuthProviderSettings):
        raise NotFound()
    await session.commit()  # the reads are done: no connection waits on the provider's discovery
    try:
        target = await grants.start(session, flow=flow, provider=provider)
    except oauth.UpstreamError:
        raise StartUnavailable() from None
    if target is None:  # finished, expired or mid-exchange: show where it stands
        return _see_other(f"/connect/{flow.id}")
    # a page that refreshes to the provider, not a 303: templates/connect/continue.html says why
    return render(
        request, "connect/continue.html", provider_name=provider.display_name, target=target
    )


@router.get("/oauth/{provider_name}/callback", name="oauth:callback")
async def callback(
    request: Request,
    provider_name: str,
    session: SessionDep,
    settings: SettingsDep,
    sessions: BrowserSessionsDep,
    security: SecurityDep,
    grants: OAuthGrantsDep,
    revoker: RevokerDep,
) -> Response:
    try:
        flow, state = await _checked(
            request, provider_name, session, settings, sessions, security, grants
        )
    except CallbackRefused as refused:
        logger.warning("callback.refused reason=%s", refused.reason)
        return _refusal(request, refused)
    params = request.query_params
    if "error" in params:
        await grants.provider_refused(session, flow=flow, error=params["error"])
        return _see_other(f"/connect/{flow.id}")
    try:
        verifier = await grants.claim(session, flow=flow, state=state)
    except CallbackRefused:  # replay, double click, parallel callback: someone else won
        return _see_other(f"/connect/{flow.id}")
    await session.commit()  # the claim is durable before the code is spent (SECURITY.md §0.4)
    provider = settings.providers[flow.provider]
    assert isinstance(provider, OAuthProviderSettings)
    try:
        await _exchange_and_store(
            session, grants, revoker, flow, provider, params["code"], state, verifier
        )
    except Exception:
        await _release(session, flow)
        raise  # still a bug (or an outage): logged and answered as such
    return _see_other(f"/connect/{flow.id}")


def _see_other(target: str) -> Response:
    """303 with the page headers: the URL it answers (code and state in the query) is neither
    sent on as a Referer nor cached (T13); likewise the start's provider URL (state)."""
    return RedirectResponse(target, status_code=303, headers=html_security_headers())


async def _checked(
    request: Request,
    provider_name: str,
    session: AsyncSession,
    settings: Settings,
    sessions: BrowserSessions,
    security: SecurityLog,
    grants: OAuthGrants,
) -> tuple[FlowView, str]:
    """State, provider path, expiry and the browser's identity — before anything else."""
    params = request.query_params
    state, code, error = params.get("state"), params.get("code"), params.get("error")
    if any(len(value) > MAX_PARAM_LENGTH for value in params.values()):
        raise CallbackRefused(400, "oversized")
    if not state:
        raise CallbackRefused(400, "missing_state")
    flow = await grants.flow_for_state(session, state)
    if flow is None:
        raise CallbackRefused(400, "unknown_state")
    if flow.provider != provider_name:
        raise CallbackRefused(400, "provider_mismatch")
    user = await sessions.current(session, request)
    if user is None or user.principal != flow.principal:
        security.event("callback.session_mismatch", flow_id=flow.id)
        raise CallbackRefused(403, "session_mismatch")
    if flow.outcome == FlowStatus.expired:
        raise CallbackRefused(410, "expired", flow)
    if flow.is_done:
        raise CallbackRefused(303, "already_done", flow)
    if (code is None) == (error is None):
        raise CallbackRefused(400, "code_xor_error", flow)
    provider = settings.providers.get(flow.provider)
    await session.commit()  # the reads are done: no connection waits on the provider's discovery
    if isinstance(provider, OAuthProviderSettings) and not await _issuer_ok(
        grants, provider, params.get("iss")
    ):
        raise CallbackRefused(400, "issuer_mismatch", flow)
    return flow, state


async def _issuer_ok(
    grants: OAuthGrants, provider: OAuthProviderSettings, issuer: str | None
) -> bool:
    """RFC 9207: a differing `iss` is refused; a missing one too when the provider says it sends
    one (mix-up defence, SECURITY.md E14)."""
    if provider.issuer is None:
        return True
    if issuer is not None:
        return issuer == provider.issuer
    try:
        metadata = await grants.issuer_metadata(provider.issuer)
    except JwksUnavailable:
        return True  # discovery is down: the exchange itself will fail closed
    return metadata.get("authorization_response_iss_parameter_supported") is not True


async def _exchange_and_store(
    session: AsyncSession,
    grants: OAuthGrants,
    revoker: Revoker,
    flow: FlowView,
    provider: OAuthProviderSettings,
    code: str,
    state: str,
    verifier: str,
) -> None:
    """Exchange the code, then store the tokens and complete the flow, committed here. Tokens
    obtained but not stored (their ID token refused, the flow moved on meanwhile, or an error
    while storing them) are revoked at the provider as far as that ends no one's connection
    (`Revoker.discard`)."""
    try:
        target = await grants.endpoints(provider)
        tokens = await oauth.exchange_code(
            provider,
            grants.http,
            token_url=target.token_url,
            code=code,
            redirect_uri=grants.redirect_uri(flow.provider),
            verifier=verifier,
            requested=flow.scopes,
        )
    except oauth.UpstreamError as exc:
        logger.warning("token_exchange.failed flow_id=%s reason=%s", flow.id, exc.reason)
        await oauth_service.fail(session, flow=flow, reason=exc.reason)
        return
    issued = Issued(flow.principal, flow.provider, flow.audience, None)
    why = "not_stored"  # why the tokens are not kept, should any step below fail
    try:
        try:
            id_claims = await grants.verify_id_token(provider, tokens, state)
        except oauth.UpstreamError as exc:
            logger.warning("token_exchange.failed flow_id=%s reason=%s", flow.id, exc.reason)
            why, stored = exc.reason, False
            await oauth_service.fail(session, flow=flow, reason=exc.reason)
        else:
            account = await oauth.account_identity(provider, grants.http, tokens, id_claims)
            issued = replace(issued, account_id=account.account_id)
            stored = await grants.complete(
                session, provider=provider, flow=flow, tokens=tokens, account=account
            )
            why = "not_stored" if stored else "flow_moved_on"  # the lease ran out meanwhile
        await session.commit()  # before the browser is told, and before any revocation
    except Exception:
        with contextlib.suppress(*DATABASE_ERRORS):  # ends the write (SQLite: hands its turn on)
            await session.rollback()
        await revoker.discard(issued, tokens, why=why, about=f"flow_id={flow.id}")
        raise
    if not stored:
        await revoker.discard(issued, tokens, why=why, about=f"flow_id={flow.id}")


async def _release(session: AsyncSession, flow: FlowView) -> None:
    """After an unexpected error mid-exchange, undo this request's writes and put the claimed
    flow back to `pending` (its page then says to try again) at once, instead of leaving it
    `exchanging` until its lease runs out. When the database is what failed, the lease
    (app/tables/flows.py `release_exchanges`) still frees the flow later."""
    try:
        await session.rollback()
        await oauth_service.fail(session, flow=flow, reason="internal_error")
        await session.commit()
    except DATABASE_ERRORS as exc:
        logger.warning(
            "token_exchange.release_failed flow_id=%s error=%s", flow.id, type(exc).__name__
        )


REFUSALS = {
    "session_mismatch": (
        "This sign-in belongs to a different account",
        "The provider sent you back here for a connection started by another account, or you "
        "are not signed in. Nothing was stored.",
    ),
    "expired": ("This link has expired", "Nothing was stored."),
}


def _refusal(request: Request, refused: CallbackRefused) -> Response:
    if refused.status == 303 and refused.flow is not None:
        return _see_other(f"/connect/{refused.flow.id}")
    title, message = REFUSALS.get(
        refused.reason,
        (
            "This sign-in response cannot be used",
            "It is incomplete, was already used, or does not belong to a connect link.",
        ),
    )
    return render(
        request,
        "errors/error.html",
        status_code=refused.status,
        title=title,
        message=message,
        next_step="Go back to your MCP client and ask it to try again for a new link.",
    )
