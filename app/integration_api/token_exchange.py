"""POST /api/v1/token: the user's access token exchanged for their provider credential (RFC 8693).

For services with `user_proof = "token"` (app/integration_api/user_proof.py). The service
authenticates with its secret (`Authorization: Bearer <service secret>`, checked before the body is
read, as on every /api/v1 route) and sends an RFC 8693 §2.1 form:

    grant_type=urn:ietf:params:oauth:grant-type:token-exchange
    subject_token=<the user's access token for the service's token_audience>
    subject_token_type=urn:ietf:params:oauth:token-type:access_token
    requested_token_type=urn:connect-broker:credential:<provider>

The answer is an RFC 8693 §2.2.1 document carrying the credential (`token_type` `Bearer` for an
OAuth access token, `N_A` for an API key). Refusals are RFC 6749 §5.2 JSON, as OAuth clients
expect, with the broker's problem `type` beside `error`: the standard codes are coarse (RFC 8693
§2.2.2 makes every unacceptable subject token `invalid_request`), `type` tells each refusal apart,
and `instance` finds its log lines. Every answer carries `Cache-Control: no-store`.
"""

from __future__ import annotations

from typing import Annotated, Any
from urllib.parse import parse_qsl

from fastapi import APIRouter, Depends, Request
from fastapi.security import HTTPAuthorizationCredentials
from pydantic import BaseModel, Field
from starlette.responses import JSONResponse, Response

from app.clock import utcnow
from app.credentials import account_name_valid
from app.errors import BrokerError, problem_instance
from app.integration_api.broker import (
    ConnectApi,
    UsableCredential,
    named_for,
    usable_for,
)
from app.integration_api.problems import (
    IdentityProviderUnavailable,
    InvalidServiceCredentials,
    NotConnected,
    ProviderNotAllowed,
    TooManyFailedAuthentications,
    UserProofNotEnabled,
)
from app.integration_api.routes import (
    authenticate_service,
    check_provider,
    service_secret,
    user_proofs,
)
from app.limits import client_key
from app.storable import unstorable_reason

PATH = "/token"
GRANT_TYPE = "urn:ietf:params:oauth:grant-type:token-exchange"
ACCESS_TOKEN_TYPE = "urn:ietf:params:oauth:token-type:access_token"  # noqa: S105 (a URN)
CREDENTIAL_TYPE = "urn:connect-broker:credential:"  # followed by the provider's name
FORM = "application/x-www-form-urlencoded"
MAX_FIELDS = 16
NO_STORE = {"Cache-Control": "no-store", "Pragma": "no-cache"}
REQUIRED = ("grant_type", "subject_token", "subject_token_type", "requested_token_type")


class TokenRequestInvalid(BrokerError):
    status_code = 400
    code = "invalid_request"
    title = "Invalid token request"
    message = "The request is not a form-encoded RFC 8693 token exchange."


class UnsupportedGrantType(BrokerError):
    status_code = 400
    code = "unsupported_grant_type"
    title = "Unsupported grant type"
    message = f"grant_type must be {GRANT_TYPE}."


class UnsupportedSubjectTokenType(BrokerError):
    status_code = 400
    code = "unsupported_subject_token_type"
    title = "Unsupported subject token type"
    message = f"subject_token_type must be {ACCESS_TOKEN_TYPE}."


class UnsupportedRequestedTokenType(BrokerError):
    status_code = 400
    code = "unsupported_requested_token_type"
    title = "Unsupported requested token type"
    message = f"requested_token_type must be {CREDENTIAL_TYPE}<provider>."


# The broker's refusal → RFC 6749 §5.2 / RFC 8693 §2.2.2 `error`; any other: invalid_request
OAUTH_ERRORS = {
    InvalidServiceCredentials.code: "invalid_client",
    UserProofNotEnabled.code: "unauthorized_client",
    ProviderNotAllowed.code: "unauthorized_client",
    UnsupportedGrantType.code: "unsupported_grant_type",
    NotConnected.code: "invalid_target",
    TooManyFailedAuthentications.code: "temporarily_unavailable",
    IdentityProviderUnavailable.code: "temporarily_unavailable",
}


class IssuedCredential(BaseModel):
    """RFC 8693 §2.2.1, carrying the credential."""

    access_token: str = Field(description="the OAuth access token or the API key")
    issued_token_type: str = Field(examples=[f"{CREDENTIAL_TYPE}github"])
    token_type: str = Field(description="`Bearer` for an OAuth access token, `N_A` for an API key")
    expires_in: int | None = Field(default=None, description="seconds, when known")
    scope: str | None = Field(default=None, description="the scopes it holds, space-separated")
    account: str | None = Field(default=None, description="the provider account, when known")


class TokenError(BaseModel):
    """RFC 6749 §5.2, with the broker's problem `type` and the request's `instance`."""

    error: str = Field(examples=["invalid_request"])
    error_description: str
    type: str = Field(examples=["urn:connect-broker:error:subject_token_expired"])
    instance: str


def _error_answers(*statuses: int) -> dict[int | str, dict[str, Any]]:
    return {
        status: {"description": "RFC 6749 §5.2 error", "model": TokenError} for status in statuses
    }


router = APIRouter(prefix="/api/v1", tags=["integration"])
FORM_SCHEMA = {
    "type": "object",
    "required": list(REQUIRED),
    "properties": {
        "grant_type": {"type": "string", "const": GRANT_TYPE},
        "subject_token": {"type": "string", "description": "the user's access token"},
        "subject_token_type": {"type": "string", "const": ACCESS_TOKEN_TYPE},
        "requested_token_type": {"type": "string", "pattern": f"^{CREDENTIAL_TYPE}[a-z0-9_-]+$"},
        "account": {
            "type": "string",
            "minLength": 1,
            "maxLength": 255,
            "description": "one of the user's accounts at the provider, as GET /connections "
            "names it; without it, the default account (the latest connected or chosen)",
        },
    },
}


@router.post(
    PATH,
    response_model=IssuedCredential,
    response_model_exclude_none=True,
    responses=_error_answers(400, 401, 403, 413, 429, 503),
    openapi_extra={"requestBody": {"required": True, "content": {FORM: {"schema": FORM_SCHEMA}}}},
)
async def exchange(
    request: Request,
    _presented: Annotated[HTTPAuthorizationCredentials | None, Depends(service_secret)],
) -> Response:
    """The user's credential for the provider `requested_token_type` names, for a service with
    `user_proof = "token"`; the user is the one `subject_token` stands for."""
    try:
        usable, provider = await _exchange(request)
    except BrokerError as exc:
        return oauth_error(request, exc)
    return JSONResponse(issued(usable, provider), headers=NO_STORE)


async def _exchange(request: Request) -> tuple[UsableCredential, str]:
    service = await authenticate_service(request)
    proofs = user_proofs(request)
    if not proofs.required(service.name):
        raise UserProofNotEnabled()
    form = await read_form(request)
    provider = _provider(form)
    check_provider(request.app.state.settings, service, provider)
    address = client_key(request.scope.get("client"))
    principal = await proofs.principal(service, form["subject_token"], address)
    api: ConnectApi = request.app.state.connect_api
    account = form.get("account")  # ours: one of several accounts, as GET /connections names it
    if account is not None and not account_name_valid(account):
        raise TokenRequestInvalid("account must be 1 to 255 characters, no control characters.")
    if account is not None:
        usable = await named_for(api, service, provider, principal, account)
    else:
        usable = await usable_for(api, service, provider, principal)
    if usable is None:
        raise NotConnected()
    return usable, provider


async def read_form(request: Request) -> dict[str, str]:
    """The form's parameters: each once (RFC 6749 §3.2), the required ones present and
    non-empty, all storable text; others are ignored (RFC 6749 §3.2) but for `actor_token`."""
    media = request.headers.get("content-type", "").partition(";")[0].strip().lower()
    if media != FORM:
        raise TokenRequestInvalid(f"Send the parameters as {FORM}.")
    try:
        fields = parse_qsl(
            (await request.body()).decode(), keep_blank_values=True, max_num_fields=MAX_FIELDS
        )
    except (UnicodeDecodeError, ValueError):
        raise TokenRequestInvalid("The form is not UTF-8 or has too many parameters.") from None
    form: dict[str, str] = {}
    for name, value in fields:
        if name in form:
            raise TokenRequestInvalid(f"{name} is given more than once.")
        if unstorable_reason(value):
            raise TokenRequestInvalid(f"{name} holds characters a token never holds.")
        form[name] = value
    missing = [name for name in REQUIRED if not form.get(name)]
    if missing:
        raise TokenRequestInvalid(f"Missing: {', '.join(missing)}.")
    if "actor_token" in form:
        raise TokenRequestInvalid("Delegation (actor_token) is not supported.")
    return form


def _provider(form: dict[str, str]) -> str:
    if form["grant_type"] != GRANT_TYPE:
        raise UnsupportedGrantType()
    if form["subject_token_type"] != ACCESS_TOKEN_TYPE:
        raise UnsupportedSubjectTokenType()
    requested = form["requested_token_type"]
    provider = requested.removeprefix(CREDENTIAL_TYPE)
    if provider == requested or not provider:
        raise UnsupportedRequestedTokenType()
    return provider


def issued(usable: UsableCredential, provider: str) -> dict[str, Any]:
    """The RFC 8693 §2.2.1 document of a credential."""
    found = usable.credential
    document: dict[str, Any] = {
        "access_token": found.secret,
        "issued_token_type": CREDENTIAL_TYPE + provider,
        "token_type": "Bearer" if usable.kind == "oauth2" else "N_A",
    }
    if found.expires_at is not None:
        document["expires_in"] = max(0, int((found.expires_at - utcnow()).total_seconds()))
    if found.scopes:
        document["scope"] = " ".join(sorted(found.scopes))
    if found.account_label is not None:
        document["account"] = found.account_label
    return document


def oauth_error(request: Request, exc: BrokerError) -> Response:
    """A refusal as RFC 6749 §5.2 JSON; a 401 names the scheme, a 429 or 503 says when to retry."""
    body = {
        "error": OAUTH_ERRORS.get(exc.code, "invalid_request"),
        "error_description": _description(exc.public_message),
        "type": f"urn:connect-broker:error:{exc.code}",
        "instance": problem_instance(request),
    }
    headers = dict(NO_STORE)
    if isinstance(exc, InvalidServiceCredentials):
        headers["WWW-Authenticate"] = 'Bearer realm="connect-broker"'
    elif isinstance(exc, TooManyFailedAuthentications):
        headers["Retry-After"] = exc.retry_after
    elif isinstance(exc, IdentityProviderUnavailable):
        headers["Retry-After"] = "5"
    return JSONResponse(body, status_code=exc.status_code, headers=headers)


def _description(text: str) -> str:
    """Only the characters RFC 6749 §5.2 allows in `error_description`."""
    return "".join(c if " " <= c <= "~" and c not in '"\\' else "'" for c in text)
