"""The operators' HTTP API, under /api/v1/admin: off unless `[admin] token` is set.

`DELETE /api/v1/admin/users?issuer=…&subject=…` erases a user (app/connect/erasure.py, the same
function as `connect-broker users erase`). The user is named in the query, as everywhere in this
API (a DELETE body is dropped by some proxies; the access log never shows a query). The caller
presents `Authorization: Bearer <[admin] token>`, compared in constant time; wrong tokens count
against the address's failed-authentication budget like wrong service secrets. Without a
configured token every path here answers 404.
"""

from __future__ import annotations

import hashlib
from typing import Annotated

from fastapi import APIRouter, Depends, Query, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from pydantic import BaseModel

from app.audit import Actor
from app.auth.principal import Principal
from app.connect.erasure import erase_user
from app.crypto import constant_time_equal
from app.deps import KeysDep, SecurityDep, SessionDep, SettingsDep
from app.errors import BrokerError
from app.integration_api.problems import (
    InvalidServiceCredentials,
    ProblemRoute,
    TooManyFailedAuthentications,
    problem_responses,
)
from app.limits import client_key
from app.storable import StorableText

ADMIN_API = Actor.operator("admin-api")

admin_token = HTTPBearer(
    auto_error=False, scheme_name="AdminToken", description="The `[admin] token`."
)


class AdminApiDisabled(BrokerError):
    status_code = 404
    code = "not_found"
    title = "Not found"
    message = "There is nothing at this path."


class InvalidAdminToken(InvalidServiceCredentials):
    """Answered like a wrong service secret (401 naming the Bearer scheme)."""

    code = "invalid_admin_token"
    title = "Missing or wrong admin token"
    message = "Send Authorization: Bearer <the token configured as [admin] token>."


class ErasedUser(BaseModel):
    """What the erasure removed: counts only."""

    connections: int
    revocations_queued: int
    account_choices: int
    flows: int
    sessions: int
    audit_events: int


async def operator(
    request: Request,
    settings: SettingsDep,
    security: SecurityDep,
    presented: Annotated[HTTPAuthorizationCredentials | None, Depends(admin_token)],
) -> None:
    """Let through only a caller presenting the configured token (404 when there is none).

    As for service secrets (app/limits.py), an address past its failed authentications is
    refused unchecked, unless the token presented is one this process has verified before: an
    operator behind the address a misbehaving sibling shares is not locked out, while the 429
    still tells a guesser nothing.
    """
    token = settings.admin.token
    if token is None:
        raise AdminApiDisabled()
    address = client_key(request.scope.get("client"))
    digest = _digest(presented.credentials) if presented is not None else None
    wait = security.failed_auth_wait(address, digest)
    if wait:
        raise TooManyFailedAuthentications(wait)
    if presented is None or not constant_time_equal(
        presented.credentials, token.get_secret_value()
    ):
        security.note_failed_authentication(address)
        raise InvalidAdminToken()
    if digest is not None:
        security.limits.remember_secret(digest)


def _digest(token: str) -> str:
    """How the verified-secrets memory knows the admin token (apart from services' digests)."""
    return "admin:" + hashlib.sha256(token.encode()).hexdigest()


ErasedIssuer = Annotated[StorableText, Query(min_length=1, max_length=255, description="`iss`")]
ErasedSubject = Annotated[
    StorableText, Query(min_length=1, max_length=255, description="the identity claim (`sub`)")
]

# Not in /api/v1/openapi.json: that document is the siblings' contract; this API is documented
# for operators in docs/operations.md.
router = APIRouter(
    prefix="/api/v1/admin",
    include_in_schema=False,
    tags=["admin"],
    route_class=ProblemRoute,
    dependencies=[Depends(operator)],
    responses=problem_responses(401, 404, 422, 429),
)


@router.delete("/users")
async def erase(
    issuer: ErasedIssuer,
    subject: ErasedSubject,
    settings: SettingsDep,
    keys: KeysDep,
    session: SessionDep,
) -> ErasedUser:
    """Erase the user: revoke every grant (queued), delete their connections, flows, browser
    sessions and audit events older than `[audit] erase_hold_days`."""
    erased = await erase_user(
        session,
        principal=Principal(issuer, subject),
        sealing=keys.sealing,
        providers=settings.providers,
        hold_days=settings.audit.erase_hold_days,
        actor=ADMIN_API,
    )
    return ErasedUser(**vars(erased))
