"""/api/v1: the integration API for sibling MCP servers (documented by the app's OpenAPI).

A sibling authenticates as itself (`Authorization: Bearer <service secret>`) and names the user
it verified from its own MCP token; it never forwards that token. It asks for a credential and
gets either the credential, an input-required payload to return verbatim as its own
`InputRequiredResult` (a URL-mode elicitation for a flow the page attributes to the sibling), or a
missing-capability answer to turn into `-32021`. Connections it creates belong to its audience;
it reads only those, plus the audiences `[services.<name>] share_from` names.
Errors are `application/problem+json` with a stable `type`, including a body or query that does not
match the schema (FastAPI's default 422 would be plain JSON echoing the input back).
"""

from __future__ import annotations

from collections.abc import Callable, Coroutine, Mapping
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.routing import APIRoute
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from pydantic import BaseModel, Field
from starlette.responses import JSONResponse, Response

from app import credentials
from app.auth.principal import Principal
from app.connect import disconnect as disconnection
from app.deps import RuntimeDep, SessionDep
from app.direct import ConnectionRecord
from app.errors import BrokerError, render_error
from app.integration_api import services
from app.integration_api.broker import (
    ConnectionItem,
    ConnectionList,
    ConnectOutcome,
    CredentialView,
    Disconnection,
    RequireRequest,
    ResumeRequest,
    readable_audiences,
    require_connection,
    resume_connection,
    usable_for,
)
from app.integration_api.services import Service
from app.runtime import Runtime


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


class InvalidRequest(BrokerError):
    status_code = 422
    code = "invalid_request"
    title = "Invalid request"
    message = "The request body or query does not match the documented schema; see `errors`."


class Problem(BaseModel):
    """RFC 9457 problem details; `type` is stable per error."""

    type: str = Field(examples=["urn:connect-broker:error:not_connected"])
    title: str
    status: int
    detail: str
    errors: list[dict[str, Any]] | None = Field(
        default=None, description="422 only: where the request is wrong (`loc`, `msg`, `type`)"
    )


def _problems(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """OpenAPI entries for the problem responses a route can give."""
    content = {"application/problem+json": {"schema": Problem.model_json_schema()}}
    return {status: {"description": "problem details", "content": content} for status in statuses}


def _invalid_request(exc: RequestValidationError) -> Response:
    """422 as problem JSON. Only where and what: pydantic's `input` and `ctx` echo the caller's
    values back (a secret sent in the wrong field would land in the response and in logs)."""
    problem = Problem(
        type=f"urn:connect-broker:error:{InvalidRequest.code}",
        title=InvalidRequest.title,
        status=InvalidRequest.status_code,
        detail=InvalidRequest.message,
        errors=[
            {"loc": list(error.get("loc", ())), "msg": error.get("msg"), "type": error.get("type")}
            for error in exc.errors()
        ],
    )
    return JSONResponse(
        problem.model_dump(),
        status_code=InvalidRequest.status_code,
        media_type="application/problem+json",
    )


def problem_response(request: Request, exc: BrokerError) -> Response:
    """A failure as problem JSON; a 401 also names the scheme (`WWW-Authenticate`)."""
    response = render_error(request, exc)
    if isinstance(exc, InvalidServiceCredentials):
        response.headers["WWW-Authenticate"] = 'Bearer realm="connect-broker"'
    return response


class ProblemRoute(APIRoute):
    """Renders this router's own failures that the app-wide handlers render differently.

    A request that fails validation becomes problem JSON (the app's default handler answers plain
    JSON, and only /api/v1 promises problem JSON everywhere); a 401 carries `WWW-Authenticate`.
    """

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handle = super().get_route_handler()

        async def handle_with_problems(request: Request) -> Response:
            try:
                return await handle(request)
            except RequestValidationError as exc:
                return _invalid_request(exc)
            except InvalidServiceCredentials as exc:
                return problem_response(request, exc)

        return handle_with_problems


router = APIRouter(
    prefix="/api/v1",
    tags=["integration"],
    route_class=ProblemRoute,
    responses=_problems(401, 422),
)
service_secret = HTTPBearer(
    auto_error=False,
    scheme_name="ServiceSecret",
    description="The secret `connect-broker service create` printed (`cbs_…`).",
)
UserIssuer = Annotated[str, Query(min_length=1, max_length=255, description="the user's `iss`")]
UserSubject = Annotated[
    str, Query(min_length=1, max_length=255, description="the user's identity claim (`sub`)")
]


async def calling_service(
    runtime: RuntimeDep,
    presented: Annotated[HTTPAuthorizationCredentials | None, Depends(service_secret)],
) -> Service:
    """The authenticated sibling (looked up through the direct store, holding no session)."""
    service = None
    if presented is not None:
        service = await services.authenticate(
            runtime.direct, keys=runtime.signing_keys, secret=presented.credentials
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
    responses=_problems(400, 403, 404),
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
    responses=_problems(400, 403, 404),
)
async def resume(
    provider: str, body: ResumeRequest, runtime: RuntimeDep, service: CallingService
) -> ConnectOutcome:
    """On the client's retry: the echoed requestState and the client's inputResponses entry."""
    _provider(runtime, service, provider)
    principal = _principal(runtime, body.user.issuer, body.user.subject)
    return await resume_connection(runtime, service, provider, principal, body)


@router.get(
    "/credentials/{provider}",
    response_model=CredentialView,
    response_model_exclude_none=True,
    responses=_problems(400, 403, 404),
)
async def credential(
    provider: str,
    runtime: RuntimeDep,
    service: CallingService,
    issuer: UserIssuer,
    subject: UserSubject,
) -> CredentialView:
    """A usable credential (OAuth access tokens are refreshed first when they expire soon)."""
    return await credential_for(runtime, service, provider, issuer, subject)


async def credential_for(
    runtime: Runtime,
    service: Service,
    provider: str,
    issuer: str,
    subject: str,
    *,
    known: Mapping[str, ConnectionRecord | None] | None = None,
) -> CredentialView:
    """The credential route's answer, also given by its fast path (credential_fetch.py), which
    passes the service's own connection row, read with the service (`known`, by audience)."""
    _provider(runtime, service, provider)
    found = await usable_for(
        runtime, service, provider, _principal(runtime, issuer, subject), known=known
    )
    if found is None:
        raise NotConnected()
    return found


@router.get("/connections", responses=_problems(400))
async def list_connections(
    runtime: RuntimeDep,
    session: SessionDep,
    service: CallingService,
    issuer: UserIssuer,
    subject: UserSubject,
) -> ConnectionList:
    """The user's connections this service can read: its own and those it shares from."""
    principal = _principal(runtime, issuer, subject)
    items = []
    for audience in readable_audiences(runtime, service):
        for row in await credentials.list_for(session, principal=principal, audience=audience):
            if service.may_use(row.provider):
                items.append(
                    ConnectionItem(
                        provider=row.provider,
                        account=row.account_label,
                        status=row.status,
                        owner=audience,
                        connected_at=row.connected_at,
                    )
                )
    return ConnectionList(connections=items)


@router.delete("/connections/{provider}", responses=_problems(400, 403, 404))
async def delete_connection(
    provider: str,
    runtime: RuntimeDep,
    session: SessionDep,
    service: CallingService,
    issuer: UserIssuer,
    subject: UserSubject,
) -> Disconnection:
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
    return Disconnection(
        provider=provider,
        revoked_upstream=outcome.revoked_upstream,
        upstream_failed=outcome.upstream_failed,
    )
