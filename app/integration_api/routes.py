"""/api/v1: the integration API for sibling MCP servers (documented by the app's OpenAPI).

A sibling authenticates as itself (`Authorization: Bearer <service secret>`) and names the user
it verified from its own MCP token; it never forwards that token. It asks for a credential and
gets either the credential, an input-required payload to return verbatim as its own
`InputRequiredResult` (a URL-mode elicitation for a flow the page attributes to the sibling), or a
missing-capability answer to turn into `-32021`. Connections it creates belong to its audience;
it reads only those, plus the audiences `[services.<name>] share_from` names.
Errors are `application/problem+json` with a stable `type`.
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Depends, Query, Request

from app import credentials
from app.auth.principal import Principal
from app.connect import disconnect as disconnection
from app.deps import RuntimeDep, SessionDep
from app.errors import BrokerError
from app.integration_api import services
from app.integration_api.broker import (
    ConnectOutcome,
    CredentialView,
    RequireRequest,
    ResumeRequest,
    readable_audiences,
    require_connection,
    resume_connection,
    usable_for,
)
from app.integration_api.services import Service
from app.runtime import Runtime

router = APIRouter(prefix="/api/v1", tags=["integration"])


class InvalidServiceCredentials(BrokerError):
    status_code = 401
    code = "invalid_service_credentials"
    title = "Unknown or revoked service secret"
    message = "Send Authorization: Bearer <service secret> of a registered, unrevoked service."


class ProviderNotAllowed(BrokerError):
    status_code = 403
    code = "provider_not_allowed"
    title = "Provider not allowed for this service"
    message = "This service is not registered for that provider."


class UnknownProvider(BrokerError):
    status_code = 404
    code = "unknown_provider"
    title = "Unknown provider"
    message = "No provider with that name is configured."


class NotConnected(BrokerError):
    status_code = 404
    code = "not_connected"
    title = "Not connected"
    message = "The user has no usable connection to this provider visible to this service."


class UnknownIssuer(BrokerError):
    status_code = 400
    code = "unknown_issuer"
    title = "Unknown issuer"
    message = "The user's issuer must be the identity provider this broker trusts."


async def calling_service(request: Request, runtime: RuntimeDep, session: SessionDep) -> Service:
    authorization = request.headers.get("authorization", "")
    scheme, _, secret = authorization.partition(" ")
    service = None
    if scheme.lower() == "bearer" and secret:
        service = await services.authenticate(
            session, keys=runtime.signing_keys, secret=secret.strip()
        )
    if service is None:
        raise InvalidServiceCredentials()
    return service


CallingService = Annotated[Service, Depends(calling_service)]


def _provider(runtime: Runtime, service: Service, name: str) -> None:
    if name not in runtime.settings.providers:
        raise UnknownProvider()
    if not service.may_use(name):
        raise ProviderNotAllowed()


def _principal(runtime: Runtime, issuer: str, subject: str) -> Principal:
    if issuer != runtime.settings.identity.issuer or not subject or len(subject) > 255:
        raise UnknownIssuer()
    return Principal(issuer, subject)


@router.post(
    "/connections/{provider}/require",
    response_model=ConnectOutcome,
    response_model_exclude_none=True,
)
async def require(
    provider: str, body: RequireRequest, runtime: RuntimeDep, service: CallingService
) -> ConnectOutcome:
    """The user's credential, or the input-required payload to return to the MCP client."""
    _provider(runtime, service, provider)
    principal = _principal(runtime, body.user.issuer, body.user.subject)
    return await require_connection(runtime, service, provider, principal, body)


@router.post(
    "/connections/{provider}/resume",
    response_model=ConnectOutcome,
    response_model_exclude_none=True,
)
async def resume(
    provider: str, body: ResumeRequest, runtime: RuntimeDep, service: CallingService
) -> ConnectOutcome:
    """On the client's retry: the echoed requestState and the client's inputResponses entry."""
    _provider(runtime, service, provider)
    principal = _principal(runtime, body.user.issuer, body.user.subject)
    return await resume_connection(runtime, service, provider, principal, body)


@router.get(
    "/credentials/{provider}", response_model=CredentialView, response_model_exclude_none=True
)
async def credential(
    provider: str,
    runtime: RuntimeDep,
    service: CallingService,
    issuer: Annotated[str, Query()],
    subject: Annotated[str, Query()],
) -> CredentialView:
    """A usable credential (OAuth access tokens are refreshed first when they expire soon)."""
    _provider(runtime, service, provider)
    found = await usable_for(runtime, service, provider, _principal(runtime, issuer, subject))
    if found is None:
        raise NotConnected()
    return found


@router.get("/connections")
async def list_connections(
    runtime: RuntimeDep,
    session: SessionDep,
    service: CallingService,
    issuer: Annotated[str, Query()],
    subject: Annotated[str, Query()],
) -> dict[str, Any]:
    principal = _principal(runtime, issuer, subject)
    items = []
    for audience in readable_audiences(runtime, service):
        for row in await credentials.list_for(session, principal=principal, audience=audience):
            if service.may_use(row.provider):
                items.append(
                    {
                        "provider": row.provider,
                        "account": row.account_label,
                        "status": row.status,
                        "owner": audience,
                        "connected_at": row.connected_at.isoformat(),
                    }
                )
    return {"connections": items}


@router.delete("/connections/{provider}")
async def delete_connection(
    provider: str,
    runtime: RuntimeDep,
    session: SessionDep,
    service: CallingService,
    issuer: Annotated[str, Query()],
    subject: Annotated[str, Query()],
) -> dict[str, Any]:
    """Revoke upstream (where supported) and delete the service's own connection."""
    _provider(runtime, service, provider)
    outcome = await disconnection.disconnect(
        session,
        runtime,
        principal=_principal(runtime, issuer, subject),
        provider=provider,
        audience=service.name,
    )
    if not outcome.existed:
        raise NotConnected()
    return {
        "provider": provider,
        "status": "disconnected",
        "revoked_upstream": outcome.revoked_upstream,
        "upstream_failed": outcome.upstream_failed,
    }
