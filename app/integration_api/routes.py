"""/api/v1: the integration API for sibling MCP servers (documented by the app's OpenAPI).
The credential fetch, its hot path, is a plain route of its own (credential_route.py).

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

import json
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Annotated, Any, TypeVar

from fastapi import APIRouter, Depends, Query, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from app import credentials
from app.audit import Actor
from app.auth.principal import Principal
from app.config import Settings
from app.connect import disconnect as disconnection
from app.connect.require import service_audiences
from app.crypto import Keyring
from app.deps import RevokerDep, SessionDep, SettingsDep
from app.direct import DirectStore
from app.integration_api import services
from app.integration_api.broker import (
    ConnectApi,
    ConnectionItem,
    ConnectionList,
    ConnectOutcome,
    Disconnection,
    RequireRequest,
    ResumeRequest,
    require_connection,
    resume_connection,
)
from app.integration_api.problems import (
    InvalidServiceCredentials,
    NotConnected,
    ProblemRoute,
    ProviderNotAllowed,
    TooManyFailedAuthentications,
    UnknownIssuer,
    UnknownProvider,
    invalid_request,
    problem_response,
    problem_responses,
)
from app.integration_api.services import Service
from app.jsonbytes import may_hold_unusable_text, unusable_text
from app.limits import RateLimits, client_key
from app.security_log import SecurityLog
from app.storable import StorableText

service_secret = HTTPBearer(
    auto_error=False,
    scheme_name="ServiceSecret",
    description="The secret `connect-broker service create` printed (`cbs_…`).",
)


class ServiceRoute(ProblemRoute):
    """Authenticates the calling service first, then reads and checks the body, then runs the
    route.

    FastAPI reads and parses a body before it solves the route's dependencies: with the secret
    checked as a dependency, anyone who can reach the port could have any body read and parsed
    (memory and CPU). Read here, the body also meets the cap (app/middleware.py `BodyLimit`)
    outside FastAPI's read, which would turn the 413 into a 400. A string holding a NUL or an
    unpaired surrogate is refused (422) here, for every field: FastAPI's JSON parser accepts both,
    and a field typed `Any` would carry them to the database or to the answer.
    """

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handle = super().get_route_handler()

        async def authenticated_first(request: Request) -> Response:
            try:
                request.state.service = await _authenticate(request)
            except (InvalidServiceCredentials, TooManyFailedAuthentications) as exc:
                return problem_response(request, exc)
            if self.body_field is not None:
                body = await request.body()  # kept by the request for FastAPI's own read
                reason = _unusable_body_text(body)
                if reason is not None:
                    error = {"loc": ("body",), "msg": f"Strings must not hold {reason}"}
                    return invalid_request(
                        request, RequestValidationError([{**error, "type": "string_unusable"}])
                    )
            return await handle(request)

        return authenticated_first


def _unusable_body_text(body: bytes) -> str | None:
    if not may_hold_unusable_text(body):
        return None
    try:
        document = json.loads(body)
    except (ValueError, RecursionError):
        return None  # not JSON: FastAPI's own read answers
    return unusable_text(document)


T = TypeVar("T")
router = APIRouter(
    prefix="/api/v1",
    tags=["integration"],
    route_class=ServiceRoute,
    responses=problem_responses(401, 422, 429),
)
UserIssuer = Annotated[
    StorableText, Query(min_length=1, max_length=255, description="the user's `iss`")
]
NO_STORE = {"Cache-Control": "no-store"}  # on every answer that carries a credential
UserSubject = Annotated[
    StorableText,
    Query(min_length=1, max_length=255, description="the user's identity claim (`sub`)"),
]


async def calling_service(
    request: Request,
    _presented: Annotated[HTTPAuthorizationCredentials | None, Depends(service_secret)],
) -> Service:
    """The sibling `ServiceRoute` authenticated (the parameter documents the scheme)."""
    service: Service = request.state.service
    return service


@dataclass(frozen=True, slots=True)
class ServiceSecrets:
    """What checking a sibling's service secret uses."""

    store: DirectStore  # services looked up by the digest of their secret
    signing: Keyring  # that digest's key
    security: SecurityLog  # wrong secrets, counted per address
    limits: RateLimits  # secrets verified before, let through a spent address

    def refuse_spent_address(self, address: str, secret: str) -> None:
        """429 for an address that has spent its budget of failed authentications: its secret
        is not looked up, unless this process has verified that secret before
        (app/limits.py)."""
        wait = self.security.failed_auth_wait(address, secret)
        if wait:
            raise TooManyFailedAuthentications(wait)

    def verified(self, address: str, secret: str, found: T | None) -> T:
        """What the secret's lookup found; a secret that found nothing counts against
        `address`."""
        if found is None:
            self.security.note_failed_authentication(address)
            raise InvalidServiceCredentials()
        self.limits.remember_secret(secret)
        return found


async def _authenticate(request: Request) -> Service:
    """The sibling presenting the secret (looked up through the direct store, holding no
    session)."""
    secrets: ServiceSecrets = request.app.state.service_secrets
    presented = await service_secret(request)
    if presented is None:
        raise InvalidServiceCredentials()
    address = client_key(request.scope.get("client"))
    secrets.refuse_spent_address(address, presented.credentials)
    service = await services.authenticate(
        secrets.store, keys=secrets.signing, secret=presented.credentials
    )
    return secrets.verified(address, presented.credentials, service)


CallingService = Annotated[Service, Depends(calling_service)]


async def connect_api(request: Request) -> ConnectApi:
    api: ConnectApi = request.app.state.connect_api
    return api


ConnectApiDep = Annotated[ConnectApi, Depends(connect_api)]


def check_provider(settings: Settings, service: Service, name: str) -> None:
    """404 for a provider not configured, 403 for one the service is not registered for."""
    if name not in settings.providers:
        raise UnknownProvider()
    if not service.may_use(name):
        raise ProviderNotAllowed()


def known_principal(settings: Settings, issuer: str, subject: str) -> Principal:
    """The user, if of the identity provider this broker trusts (else 400)."""
    if issuer != settings.identity.issuer or not subject or len(subject) > 255:
        raise UnknownIssuer()
    return Principal(issuer, subject)


@router.post(
    "/connections/{provider}/require",
    response_model=ConnectOutcome,
    response_model_exclude_none=True,
    responses=problem_responses(400, 403, 404),
)
async def require(
    provider: str,
    body: RequireRequest,
    settings: SettingsDep,
    api: ConnectApiDep,
    service: CallingService,
    response: Response,
) -> ConnectOutcome:
    """The user's credential, or the input-required payload to return to the MCP client."""
    check_provider(settings, service, provider)
    principal = known_principal(settings, body.user.issuer, body.user.subject)
    return _not_stored(response, await require_connection(api, service, provider, principal, body))


@router.post(
    "/connections/{provider}/resume",
    response_model=ConnectOutcome,
    response_model_exclude_none=True,
    responses=problem_responses(400, 403, 404),
)
async def resume(
    provider: str,
    body: ResumeRequest,
    settings: SettingsDep,
    api: ConnectApiDep,
    service: CallingService,
    response: Response,
) -> ConnectOutcome:
    """On the client's retry: the echoed requestState and the client's inputResponses entry."""
    check_provider(settings, service, provider)
    principal = known_principal(settings, body.user.issuer, body.user.subject)
    return _not_stored(response, await resume_connection(api, service, provider, principal, body))


def _not_stored(response: Response, outcome: ConnectOutcome) -> ConnectOutcome:
    """An answer carrying a credential must not be kept by any cache on the way."""
    if outcome.credential is not None:
        response.headers.update(NO_STORE)
    return outcome


@router.get("/connections", responses=problem_responses(400))
async def list_connections(
    settings: SettingsDep,
    session: SessionDep,
    service: CallingService,
    issuer: UserIssuer,
    subject: UserSubject,
) -> ConnectionList:
    """The user's connections this service can read: its own and those it shares from."""
    principal = known_principal(settings, issuer, subject)
    items = []
    for audience in service_audiences(settings, service.name):
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


@router.delete("/connections/{provider}", responses=problem_responses(400, 403, 404))
async def delete_connection(
    provider: str,
    settings: SettingsDep,
    revoker: RevokerDep,
    session: SessionDep,
    service: CallingService,
    issuer: UserIssuer,
    subject: UserSubject,
) -> Disconnection:
    """Revoke upstream (where supported) and delete the service's own connection."""
    check_provider(settings, service, provider)
    outcome = await disconnection.disconnect(
        session,
        revoker,
        principal=known_principal(settings, issuer, subject),
        provider=provider,
        audience=service.name,
        actor=Actor.service(service.name),
    )
    if not outcome.existed:
        raise NotConnected()
    return Disconnection(
        provider=provider,
        revoked_upstream=outcome.revoked_upstream,
        upstream_failed=outcome.upstream_failed,
    )
