"""Out-of-band pages: open a connect link, enter an API key, decline, list connections.

Every page first requires the broker's own login, then checks that the browser's identity is the
flow's (MCP elicitation §Phishing): a forwarded link shows a refusal and changes nothing. GET never
moves a flow; POSTs need the session's CSRF token and a same-origin request, and end in a 303 to
`GET /connect/{flow_id}`, which shows the form or the flow's outcome.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any
from urllib.parse import quote

from fastapi import APIRouter, Request
from starlette.responses import RedirectResponse, Response

from app import credentials
from app.audit import Actor
from app.auth.browser import BrowserSessions, BrowserUser
from app.config import Settings
from app.connect import disconnect as disconnection
from app.connect import service as flows
from app.connect.service import FlowView
from app.deps import (
    BrowserSessionsDep,
    BrowserUserDep,
    HttpDep,
    KeysDep,
    NotifierDep,
    RevokerDep,
    SecurityDep,
    SessionDep,
    SettingsDep,
)
from app.errors import BrokerError, NotFound
from app.models import BROKER_AUDIENCE, OPEN_FLOW_STATUSES, SERVICE_NAME, FlowStatus
from app.pages.access import FLOW_ID, SignedInPost, flow_for_user
from app.providers.api_key import KeyRejected, ProbeUnavailable, check_shape, probe
from app.providers.settings import (
    ApiKeyProviderSettings,
    OAuthProviderSettings,
    ProviderSettings,
)
from app.templating import render

router = APIRouter(include_in_schema=False)

OUTCOME_STATUS: dict[str, int] = {FlowStatus.expired: 410}
# Exchanges the provider completed without a token the broker can use (app/providers/oauth.py)
UNUSABLE_GRANT_FAILURES = frozenset({"missing_access_token", "unsupported_token_type"})


class UnexpectedFields(BrokerError):
    code = "unexpected_fields"
    title = "This form cannot be used that way"
    message = "The form was sent with fields it does not accept. Nothing was stored."
    next_step = "Reload the page and enter only the key."


def _login_redirect(path: str) -> Response:
    return RedirectResponse(f"/login?next={quote(path, safe='/')}", status_code=303)


@router.get("/connect/{flow_id}", name="connect:page")
async def connect_page(
    request: Request,
    flow_id: str,
    user: BrowserUserDep,
    session: SessionDep,
    settings: SettingsDep,
    sessions: BrowserSessionsDep,
    security: SecurityDep,
) -> Response:
    if user is None:
        if not FLOW_ID.fullmatch(flow_id):
            raise NotFound()
        return _login_redirect(f"/connect/{flow_id}")
    flow = await flow_for_user(session, flow_id, user, sessions=sessions, security=security)
    return show_flow(request, settings, sessions, flow, user)


def show_flow(
    request: Request,
    settings: Settings,
    sessions: BrowserSessions,
    flow: FlowView,
    user: BrowserUser,
    *,
    error: str | None = None,
    status_code: int = 200,
) -> Response:
    provider = settings.providers.get(flow.provider)
    context: dict[str, Any] = {
        "flow_id": flow.id,
        "provider_name": provider.display_name if provider else flow.provider,
        **_client(settings, flow),
        **_signed_in_as(user),
        "csrf_token": sessions.csrf_token(user),
        "account_label": flow.account_label,
    }
    outcome = flow.outcome
    if outcome in OPEN_FLOW_STATUSES and isinstance(provider, OAuthProviderSettings):
        return render(
            request,
            "connect/consent.html",
            status_code=status_code,
            scopes=flow.scopes,
            in_progress=flow.status == FlowStatus.exchanging,
            failure=error or _failure_text(flow.failure, provider.display_name),
            **context,
        )
    if outcome in OPEN_FLOW_STATUSES and isinstance(provider, ApiKeyProviderSettings):
        return render(
            request,
            "connect/api_key.html",
            status_code=status_code,
            label=provider.label,
            help_url=provider.help_url,
            error=error,
            **context,
        )
    return render(
        request,
        "connect/outcome.html",
        status_code=OUTCOME_STATUS.get(outcome, 200),
        outcome="completed" if outcome == FlowStatus.consumed else outcome,
        **context,
    )


@router.post("/connect/{flow_id}/api-key", name="connect:api_key")
async def submit_api_key(
    request: Request,
    flow_id: str,
    posted: SignedInPost,
    session: SessionDep,
    settings: SettingsDep,
    sessions: BrowserSessionsDep,
    security: SecurityDep,
    keys: KeysDep,
    http: HttpDep,
    notifier: NotifierDep,
) -> Response:
    user, values = posted.user, posted.values
    flow = await flow_for_user(session, flow_id, user, sessions=sessions, security=security)
    provider = settings.providers.get(flow.provider)
    if set(values) - {"csrf", "api_key"} or not isinstance(provider, ApiKeyProviderSettings):
        raise UnexpectedFields()  # e.g. a base_url: provider URLs are configuration (T16)
    if not flow.is_open:
        return RedirectResponse(f"/connect/{flow.id}", status_code=303)
    # The provider may take its time (up to the probe's deadline): end the reads so far and hand
    # the connection back, or slow checks would hold every pooled connection and fail other
    # users' requests. The completion below is conditional on the flow being open still.
    await session.commit()
    try:
        key = check_shape(provider, values.get("api_key", ""))
        await probe(provider, key, http=http)
    except KeyRejected as rejected:
        return show_flow(
            request, settings, sessions, flow, user, error=rejected.message, status_code=400
        )
    except ProbeUnavailable:
        return show_flow(
            request,
            settings,
            sessions,
            flow,
            user,
            status_code=502,
            error=f"{provider.display_name} could not be reached to check the key. Try again.",
        )
    won = await flows.transition(
        session,
        flow_id=flow.id,
        principal=user.principal,
        from_statuses=OPEN_FLOW_STATUSES,
        to_status=FlowStatus.completed,
        event="flow.completed",
        actor=Actor.user(user.principal),
    )
    if won:  # the credential and the completion commit together, or not at all
        await credentials.store(
            session,
            keys=keys.sealing,
            principal=user.principal,
            provider=flow.provider,
            audience=flow.audience,
            secret={"api_key": key},
        )
        await notifier.publish(session, flow.id)
        security.event("credential.stored", flow_id=flow.id)
    return RedirectResponse(f"/connect/{flow.id}", status_code=303)


@router.post("/connect/{flow_id}/decline", name="connect:decline")
async def decline(
    flow_id: str,
    posted: SignedInPost,
    session: SessionDep,
    sessions: BrowserSessionsDep,
    security: SecurityDep,
    notifier: NotifierDep,
) -> Response:
    user = posted.user
    flow = await flow_for_user(session, flow_id, user, sessions=sessions, security=security)
    if await flows.transition(
        session,
        flow_id=flow.id,
        principal=user.principal,
        from_statuses=OPEN_FLOW_STATUSES,
        to_status=FlowStatus.declined,
        event="flow.declined",
        actor=Actor.user(user.principal),
        state_digest=None,
        sealed_pkce_verifier=None,
    ):
        await notifier.publish(session, flow.id)
    return RedirectResponse(f"/connect/{flow.id}", status_code=303)


@router.get("/connections", name="connections:list")
async def connections_page(
    request: Request,
    user: BrowserUserDep,
    session: SessionDep,
    settings: SettingsDep,
    sessions: BrowserSessionsDep,
) -> Response:
    if user is None:
        return _login_redirect("/connections")
    rows = await credentials.list_for(session, principal=user.principal, audience=None)
    providers = settings.providers
    return render(
        request,
        "connections.html",
        **_signed_in_as(user),
        csrf_token=sessions.csrf_token(user),
        connections=[
            {
                "provider": row.provider,
                "provider_name": p.display_name
                if (p := providers.get(row.provider))
                else row.provider,
                "audience": row.audience,
                "used_by": _used_by(settings, row.audience),
                "account": row.account,
                "status": row.status,
                "connected_at": row.connected_at.strftime("%Y-%m-%d %H:%M UTC"),
            }
            for row in rows
        ],
    )


@router.post("/connections/{provider}/disconnect", name="connections:disconnect")
async def disconnect(
    request: Request,
    provider: str,
    posted: SignedInPost,
    session: SessionDep,
    settings: SettingsDep,
    revoker: RevokerDep,
) -> Response:
    if provider not in settings.providers:
        raise NotFound("There is no such provider.", next_step="Go back to your connections.")
    audience = posted.values.get("audience") or BROKER_AUDIENCE  # forms without it predate siblings
    if not audience_shown(audience):
        raise BrokerError("This connection cannot be one of yours.", next_step=BACK)
    account = posted.values.get("account") or None  # a sole unnamed account has no name
    if account is not None and not accounts_shown(account):
        raise BrokerError("This account name cannot be one of yours.", next_step=BACK)
    outcome = await disconnection.disconnect(
        session,
        revoker,
        principal=posted.user.principal,
        provider=provider,
        audience=audience,
        actor=Actor.user(posted.user.principal),
        account=account,
    )
    if outcome.choose_from:
        raise BrokerError("Several accounts of this provider are connected.", next_step=BACK)

    if outcome.upstream_failed:
        return render(
            request,
            "errors/error.html",
            title="Disconnected here; the provider has not confirmed yet",
            message="The connection was removed from the broker, but the provider could not "
            "confirm revoking its grant yet. The broker keeps asking it for a few hours.",
            next_step="To end the grant at once, revoke the app's access in the provider's "
            "settings.",
        )
    return RedirectResponse("/connections", status_code=303)


BACK = "Go back to your connections and use the Disconnect button on the account's row."


def audience_shown(audience: str) -> bool:
    """An audience as this page lists them: the broker's own, or a registered service's name.
    Checked before any query: the form field is request input (a NUL in it would make
    PostgreSQL refuse the statement, a 503 for what is only a wrong value)."""
    return audience == BROKER_AUDIENCE or SERVICE_NAME.fullmatch(audience) is not None


def accounts_shown(name: str) -> bool:
    """An account name as this page lists them: a valid name, and printable throughout."""
    return credentials.account_name_valid(name) and name.isprintable()


def _client(settings: Settings, flow: FlowView) -> dict[str, str | None]:
    """Who asks, for the page: the name a client declared for itself (shown as its own claim),
    its client id, and for a sibling's flow the registered service relaying it (its stored
    name reads "<service> (via <declared name>)", app/integration_api/broker.py)."""
    if flow.audience == BROKER_AUDIENCE:
        return {"client_name": flow.client_name, "client_id": flow.client_id, "service": None}
    service = settings.service_display_name(flow.audience)
    stored = flow.client_name or service
    prefix = f"{service} (via "
    if stored.startswith(prefix) and stored.endswith(")"):
        return {"client_name": stored[len(prefix) : -1], "client_id": None, "service": service}
    return {"client_name": None, "client_id": None, "service": stored}


def _signed_in_as(user: BrowserUser) -> dict[str, Any]:
    """Who the page says is signed in: the identity the broker checks (a display name can say
    anything, e.g. `preferred_username`), and the IdP's name for them when that differs."""
    identity = user.principal.subject
    idp_name = user.display_name if user.display_name != identity else None
    return {"user_name": identity, "idp_name": idp_name}


def _used_by(settings: Settings, audience: str) -> str:
    """Who made a connection, as the user knows it: the broker's tools, or a sibling server."""
    if audience == BROKER_AUDIENCE:
        return "Connect Broker tools"
    return settings.service_display_name(audience)


def _display_name(providers: Mapping[str, ProviderSettings], name: str) -> str:
    provider = providers.get(name)
    return provider.display_name if provider else name


def _failure_text(failure: str | None, provider_name: str) -> str | None:
    """What to tell the user after a failed exchange (the reason code itself stays in logs)."""
    if failure is None:
        return None
    if failure == "timeout":
        return f"{provider_name} did not answer in time. Nothing was stored; try again."
    if failure in UNUSABLE_GRANT_FAILURES:
        return (
            f"{provider_name} granted no token for your own account (at most a token of another "
            "kind, such as an app's or a workspace's). Nothing was stored. Try again and approve "
            "the permissions asked for your account; if this happens again, the provider's app "
            "needs its administrator's attention."
        )
    return (
        f"{provider_name} had a problem completing the connection. Nothing was stored; try again."
    )
