"""/api/v1: the integration API for sibling MCP servers (documented by the app's OpenAPI).
The credential fetch, its hot path, is a plain route of its own (credential_route.py).

A sibling authenticates as itself (`Authorization: Bearer <service secret>`) and names the user
it verified from its own MCP token; it never forwards that token, unless it is configured with
`user_proof = "token"`: then it sends the token instead of naming the user (`subject_token` in
require and resume, the `Subject-Token` header to list and disconnect, or the exchange at
/api/v1/token), and a user named instead is refused (app/integration_api/user_proof.py). It asks
for a credential and
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

from fastapi import APIRouter, Depends, Header, Query, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from app import credentials
from app.audit import Actor
from app.auth.bearer import MAX_TOKEN_LENGTH
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
    AccountRequired,
    InvalidServiceCredentials,
    NotConnected,
    ProblemRoute,
    ProviderNotAllowed,
    TooManyFailedAuthentications,
    UnknownIssuer,
    UnknownProvider,
    UserProofRequired,
    invalid_request,
    problem_response,
    problem_responses,
)
from app.integration_api.services import Service
from app.integration_api.user_proof import UserProofs
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
    and a field typed `Any` would carry them to the database or to the answer. A body that is not
    UTF-8 is refused first, as one that is not JSON (422 `json_invalid`; RFC 8259 JSON is UTF-8):
    FastAPI's parser (`json.loads` of the bytes) would read the bytes of a surrogate, or UTF-16,
    into unpaired surrogates that no escape shows.
    """

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handle = super().get_route_handler()

        async def authenticated_first(request: Request) -> Response:
            try:
                request.state.service = await authenticate_service(request)
            except (InvalidServiceCredentials, TooManyFailedAuthentications) as exc:
                return problem_response(request, exc)
            if self.body_field is not None:
                body = await request.body()  # kept by the request for FastAPI's own read
                error = _refused_body(body)
                if error is not None:
                    return invalid_request(request, RequestValidationError([error]))
            return await handle(request)

        return authenticated_first


def _refused_body(body: bytes) -> dict[str, Any] | None:
    """Why `body` is refused before FastAPI reads it (a validation error), or None."""
    if not _read_as_utf8(body):
        return {"loc": ("body",), "msg": "The body must be UTF-8 JSON", "type": "json_invalid"}
    reason = _unusable_body_text(body)
    if reason is not None:
        msg = f"Strings must not hold {reason}"
        return {"loc": ("body",), "msg": msg, "type": "string_unusable"}
    return None


def _read_as_utf8(body: bytes) -> bool:
    """Whether `json.loads(body)` reads `body` as strict UTF-8, so that an unpaired surrogate can
    only be an escape (`may_hold_unusable_text`). It decodes with `surrogatepass`, in UTF-16 or
    UTF-32 when one of the first four bytes is a NUL: UTF-8 JSON text holds no raw NUL (control
    characters are escaped in strings, and are no whitespace)."""
    try:
        body.decode("utf-8")  # strict: the bytes of a surrogate (ED A0 80) are no UTF-8
    except UnicodeDecodeError:
        return False
    return b"\x00" not in body


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
    StorableText | None,
    Query(
        min_length=1,
        max_length=255,
        description="the user's `iss`; required unless `Subject-Token` is sent",
    ),
]
NO_STORE = {"Cache-Control": "no-store"}  # on every answer that carries a credential
AccountName = Annotated[
    StorableText | None,
    Query(
        min_length=1,
        max_length=255,
        pattern=r"^[^\x00-\x1f\x7f]+$",
        description="one of the user's accounts at the provider, as `GET /connections` names "
        "it; required when there are several",
    ),
]
UserSubject = Annotated[
    StorableText | None,
    Query(
        min_length=1,
        max_length=255,
        description="the user's identity claim (`sub`); required unless `Subject-Token` is sent",
    ),
]
SUBJECT_TOKEN_HEADER = "Subject-Token"  # noqa: S105 (a header name)
SubjectToken = Annotated[
    str | None,
    Header(
        alias=SUBJECT_TOKEN_HEADER,
        min_length=1,
        max_length=MAX_TOKEN_LENGTH,
        description=(
            'the user\'s own access token, for a service with user_proof = "token" (it replaces'
            " `issuer` and `subject`, which are then not read)"
        ),
    ),
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

    def digests(self, secret: str) -> list[str]:
        return services.digests(self.signing, secret)

    def refuse_spent_address(self, address: str, digests: list[str]) -> None:
        """429 for an address that has spent its budget of failed authentications: its secret
        is not looked up, unless this process has verified that secret before
        (app/limits.py)."""
        wait = self.security.failed_auth_wait(address, digests[0] if digests else None)
        if wait:
            raise TooManyFailedAuthentications(wait)

    def verified(self, address: str, digests: list[str], found: T | None) -> T:
        """What the lookup of a secret (by its `digests`) found; a secret that found nothing
        counts against `address`."""
        if found is None:
            self.security.note_failed_authentication(address)
            raise InvalidServiceCredentials()
        self.limits.remember_secret(digests[0])  # there is one: the digests found a service
        return found


async def authenticate_service(request: Request) -> Service:
    """The sibling presenting the secret (looked up through the direct store, holding no
    session)."""
    secrets: ServiceSecrets = request.app.state.service_secrets
    presented = await service_secret(request)
    if presented is None:
        raise InvalidServiceCredentials()
    address = client_key(request.scope.get("client"))
    digests = secrets.digests(presented.credentials)
    secrets.refuse_spent_address(address, digests)
    service = await services.authenticate(secrets.store, digests)
    return secrets.verified(address, digests, service)


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


def known_principal(settings: Settings, principal: Principal) -> Principal:
    """The user, if of the identity provider this broker trusts (else 400)."""
    subject = principal.subject
    if principal.issuer != settings.identity.issuer or not subject or len(subject) > 255:
        raise UnknownIssuer()
    return principal


def user_proofs(request: Request) -> UserProofs:
    proofs: UserProofs = request.app.state.user_proofs
    return proofs


async def body_principal(
    request: Request, settings: Settings, service: Service, body: RequireRequest
) -> Principal:
    """The user of a require or resume body: the one its `subject_token` stands for (a `user`
    named beside it is not read), else the one it names, unless the service must prove its
    users (403)."""
    proofs = user_proofs(request)
    if body.subject_token is not None:
        address = client_key(request.scope.get("client"))
        return await proofs.principal(service, body.subject_token, address)
    if proofs.required(service.name):
        raise UserProofRequired()
    if body.user is None:
        missing = {"loc": ("body", "user"), "msg": "Field required", "type": "missing"}
        raise RequestValidationError([missing])
    return known_principal(settings, Principal(body.user.issuer, body.user.subject))


async def query_principal(
    request: Request,
    settings: Settings,
    service: Service,
    token: str | None,
    issuer: str | None,
    subject: str | None,
) -> Principal:
    """The user of a route that names users in the query: the one the `Subject-Token` header's
    token stands for (the query's `issuer` and `subject` are then not read), else the one the
    query names, unless the service must prove its users (403)."""
    proofs = user_proofs(request)
    if token is not None:
        address = client_key(request.scope.get("client"))
        return await proofs.principal(service, token, address)
    if proofs.required(service.name):
        raise UserProofRequired()
    if issuer is None or subject is None:
        raise RequestValidationError(
            [
                {"loc": ("query", name), "msg": "Field required", "type": "missing"}
                for name, value in (("issuer", issuer), ("subject", subject))
                if value is None
            ]
        )
    return known_principal(settings, Principal(issuer, subject))


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
    request: Request,
    response: Response,
) -> ConnectOutcome:
    """The user's credential, or the input-required payload to return to the MCP client."""
    check_provider(settings, service, provider)
    principal = await body_principal(request, settings, service, body)
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
    request: Request,
    response: Response,
) -> ConnectOutcome:
    """On the client's retry: the echoed requestState and the client's inputResponses entry."""
    check_provider(settings, service, provider)
    principal = await body_principal(request, settings, service, body)
    return _not_stored(response, await resume_connection(api, service, provider, principal, body))


def _not_stored(response: Response, outcome: ConnectOutcome) -> ConnectOutcome:
    """An answer carrying a credential must not be kept by any cache on the way."""
    if outcome.credential is not None:
        response.headers.update(NO_STORE)
    return outcome


@router.get("/connections", responses=problem_responses(400, 403, 503))
async def list_connections(
    request: Request,
    settings: SettingsDep,
    session: SessionDep,
    service: CallingService,
    token: SubjectToken = None,
    issuer: UserIssuer = None,
    subject: UserSubject = None,
) -> ConnectionList:
    """The user's connections this service can read: its own and those it shares from. The
    user is named by `issuer` and `subject`, or, for a service with `user_proof = "token"`, is
    the one the `Subject-Token` header's access token stands for."""
    principal = await query_principal(request, settings, service, token, issuer, subject)
    items = []
    for audience in service_audiences(settings, service.name):
        rows = await credentials.list_for(session, principal=principal, audience=audience)
        for row in rows:
            if service.may_use(row.provider):
                items.append(
                    ConnectionItem(
                        provider=row.provider,
                        account=row.account,
                        account_id=row.account_id or None,
                        default=row.default,
                        status=row.status,
                        owner=audience,
                        connected_at=row.connected_at,
                    )
                )
    return ConnectionList(connections=items)


@router.delete("/connections/{provider}", responses=problem_responses(400, 403, 404, 409, 503))
async def delete_connection(
    provider: str,
    request: Request,
    settings: SettingsDep,
    revoker: RevokerDep,
    session: SessionDep,
    service: CallingService,
    token: SubjectToken = None,
    issuer: UserIssuer = None,
    subject: UserSubject = None,
    account: AccountName = None,
) -> Disconnection:
    """Revoke upstream (where supported) and delete the service's own connection of the user
    named as `GET /connections` names them: of the account `account` names, or of the only
    one (409 when there are several and none is named: nothing is deleted)."""
    check_provider(settings, service, provider)
    principal = await query_principal(request, settings, service, token, issuer, subject)
    outcome = await disconnection.disconnect(
        session,
        revoker,
        principal=principal,
        provider=provider,
        audience=service.name,
        actor=Actor.service(service.name),
        account=account,
    )
    if outcome.choose_from:
        raise AccountRequired()
    if not outcome.existed:
        raise NotConnected()
    return Disconnection(
        provider=provider,
        revoked_upstream=outcome.revoked_upstream,
        upstream_failed=outcome.upstream_failed,
    )
