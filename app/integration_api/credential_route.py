"""GET /api/v1/credentials/{provider}: the user's usable credential, for a sibling.

The integration API's hot path, served by a plain Starlette route rather than a FastAPI path
operation: dependency solving and response-model validation would cost three times the rest of
the request (docs/adr/0003-hot-path-dispatch.md). What FastAPI would do for it is done here,
explicitly: `read_user` checks the query, `UsableCredential.document` serialises the answer, and
`add_operation` puts the route in the app's OpenAPI document.

The order is that of the other /api/v1 routes (`ServiceRoute`): the service secret first (401,
or 429 for an address past its failed authentications), then the query (422), then provider,
user and connection. A service that proves its users with their tokens (`user_proof = "token"`)
is refused (403) before the named user's credential is opened: it uses the exchange at
/api/v1/token. A provider not configured never reaches a statement (SECURITY.md L6): the service
is then authenticated by its secret's digest alone (401 still comes first) and the answer is
404; a configured one is read together with the service and its connection, in one statement.
"""

from __future__ import annotations

import functools
from typing import Any
from urllib.parse import unquote_plus

from fastapi.exceptions import RequestValidationError
from fastapi.openapi.models import Operation
from fastapi.security.utils import get_authorization_scheme_param
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from app.asgi_route import AsgiRoute
from app.auth.principal import Principal
from app.config import Settings
from app.credentials import account_name_valid
from app.direct import ConnectionRecord
from app.errors import BrokerError
from app.integration_api import services
from app.integration_api.broker import (
    ConnectApi,
    CredentialView,
    UsableCredential,
    named_for,
    usable_for,
)
from app.integration_api.problems import (
    InvalidServiceCredentials,
    NotConnected,
    UserProofRequired,
    invalid_request,
    problem_response,
    problem_responses,
)
from app.integration_api.routes import (
    NO_STORE,
    ServiceSecrets,
    check_provider,
    known_principal,
    service_secret,
)
from app.integration_api.services import Service
from app.integration_api.user_proof import UserProofs
from app.json_message import JsonMessage
from app.limits import client_key
from app.middleware import first_header
from app.storable import unstorable_reason

PATH = "/api/v1/credentials/{provider}"
MAX_QUERY_VALUE = 255
USER_PARAMETERS = {  # the query, each parameter with its OpenAPI description
    "issuer": "the user's `iss`",
    "subject": "the user's identity claim (`sub`)",
}
ACCOUNT_PARAMETER = (
    "one of the user's accounts at the provider, as `GET /connections` names it; without it, "
    "the default account (the one most recently connected or chosen)"
)
DESCRIPTION = "A usable credential (OAuth access tokens are refreshed first when they expire soon)."


def read_user(query_string: bytes) -> tuple[str, str]:
    """(issuer, subject) from the query (see `read_query`)."""
    issuer, subject, _ = read_query(query_string)
    return issuer, subject


def read_query(query_string: bytes) -> tuple[str, str, str | None]:
    """(issuer, subject, account) from the query, decoded as Starlette decodes one; else
    RequestValidationError with every fault, shaped as FastAPI's (`loc`, `msg`, `type`):
    the two user parameters and at most an `account`, once each, each 1-255 characters of
    storable text (`account` also without control characters)."""
    values: dict[str, list[str]] = {}
    for field in query_string.decode("latin-1").split("&"):
        if field:  # `parse_qsl(…, keep_blank_values=True)`, as Starlette reads a query
            name, _, value = field.partition("=")
            values.setdefault(_unquoted(name), []).append(_unquoted(value))
    errors = [
        _fault(name, "Extra inputs are not permitted", "extra_forbidden")
        for name in values
        if name not in USER_PARAMETERS and name != "account"
    ]
    for name in (*USER_PARAMETERS, "account") if "account" in values else USER_PARAMETERS:
        given = values.get(name, ())
        if len(given) != 1:
            errors.append(
                _fault(name, "Field required", "missing")
                if not given
                else _fault(name, "Give this parameter once", "duplicate")
            )
        elif not given[0]:
            errors.append(
                _fault(name, "String should have at least 1 character", "string_too_short")
            )
        elif len(given[0]) > MAX_QUERY_VALUE:
            message = f"String should have at most {MAX_QUERY_VALUE} characters"
            errors.append(_fault(name, message, "string_too_long"))
        elif reason := unstorable_reason(given[0]):
            errors.append(
                _fault(name, f"Value error, the value must not hold {reason}", "value_error")
            )
        elif name == "account" and not account_name_valid(given[0]):
            message = "Value error, the value must not hold control characters"
            errors.append(_fault(name, message, "value_error"))
    if errors:
        raise RequestValidationError(errors)
    account = values["account"][0] if "account" in values else None
    return values["issuer"][0], values["subject"][0], account


def _unquoted(text: str) -> str:
    """`unquote_plus`, skipped for text it would not change; the issuer (the same URL on nearly
    every request, always escaped) comes from a small cache, which holds nothing longer than an
    accepted value could be escaped."""
    if "%" not in text and "+" not in text:
        return text
    return _cached_unquote(text) if len(text) <= MAX_QUERY_VALUE * 3 else unquote_plus(text)


@functools.lru_cache(maxsize=256)
def _cached_unquote(text: str) -> str:
    return unquote_plus(text)


def _fault(name: str, message: str, kind: str) -> dict[str, Any]:
    return {"loc": ("query", name), "msg": message, "type": kind}


class CredentialFetch:
    """The route's ASGI endpoint, built with the parts of the process it uses (app/main.py
    `build_shared`): a request looks none of them up."""

    def __init__(
        self, settings: Settings, api: ConnectApi, secrets: ServiceSecrets, proofs: UserProofs
    ) -> None:
        self.settings = settings
        self.api = api
        self.secrets = secrets
        self.proofs = proofs

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["method"] != "GET":  # answered as the router answers one (not even HEAD)
            raise HTTPException(status_code=405, headers={"Allow": "GET"})
        try:
            response = await self._fetch(scope)
        except RequestValidationError as exc:
            response = invalid_request(Request(scope, receive), exc)
        except BrokerError as exc:  # 401 and 429 carry their headers (`problem_response`)
            response = problem_response(Request(scope, receive), exc)
        await response(scope, receive, send)

    async def _fetch(self, scope: Scope) -> Response:
        """The answer; database errors and bugs go to the app's handlers, as on any route."""
        secrets = self.secrets
        scheme, secret = get_authorization_scheme_param(first_header(scope, b"authorization"))
        if scheme.lower() != "bearer" or not secret:
            raise InvalidServiceCredentials()
        address = client_key(scope.get("client"))
        digests = secrets.digests(secret)
        secrets.refuse_spent_address(address, digests)
        try:
            issuer, subject, account = read_query(scope["query_string"])
        except RequestValidationError:  # only the secret's holder learns what the query lacks
            service = await services.authenticate(secrets.store, digests)
            secrets.verified(address, digests, service)
            raise
        provider: str = scope["path_params"]["provider"]
        principal = Principal(issuer, subject)
        own: ConnectionRecord | None = None
        if provider in self.settings.providers:
            found = await services.authenticate_with_own_connection(
                secrets.store, digests, principal=principal, provider=provider
            )
            service, own = secrets.verified(address, digests, found)
        else:  # never a statement with unchecked input; `credential_for` answers 404
            found_service = await services.authenticate(secrets.store, digests)
            service = secrets.verified(address, digests, found_service)
        if self.proofs.required(service.name):  # the named user is not read for it
            raise UserProofRequired()
        usable = await credential_for(
            self.settings, self.api, service, provider, principal, own, account
        )
        return JsonMessage(usable.document(), 200, NO_STORE)


async def credential_for(
    settings: Settings,
    api: ConnectApi,
    service: Service,
    provider: str,
    principal: Principal,
    own: ConnectionRecord | None,
    account: str | None = None,
) -> UsableCredential:
    """The credential `service` may use, given its own connection for the user and provider
    (`own`, the default account's, read with the service); `account` names another one."""
    check_provider(settings, service, provider)
    known_principal(settings, principal)
    if account is not None:
        found = await named_for(api, service, provider, principal, account)
    else:
        found = await usable_for(
            api, service, provider, principal, known={(provider, service.name): own}
        )
    if found is None:
        raise NotConnected()
    return found


def route(
    settings: Settings, api: ConnectApi, secrets: ServiceSecrets, proofs: UserProofs
) -> AsgiRoute:
    """Every method comes to the endpoint: a GET route of Starlette's would also take HEAD."""
    return AsgiRoute(PATH, CredentialFetch(settings, api, secrets, proofs))


def add_operation(openapi: dict[str, Any]) -> None:
    """The route in the app's OpenAPI document, described as FastAPI describes the other
    /api/v1 operations."""
    parameters: list[dict[str, Any]] = [
        {
            "in": "path",
            "name": "provider",
            "required": True,
            "schema": {"title": "Provider", "type": "string"},
        },
    ]
    for name, description in USER_PARAMETERS.items():
        schema = {
            "description": description,
            "maxLength": MAX_QUERY_VALUE,
            "minLength": 1,
            "title": name.title(),
            "type": "string",
        }
        parameters.append(
            {
                "description": description,
                "in": "query",
                "name": name,
                "required": True,
                "schema": schema,
            }
        )
    parameters.append(
        {
            "description": ACCOUNT_PARAMETER,
            "in": "query",
            "name": "account",
            "required": False,
            "schema": {
                "description": ACCOUNT_PARAMETER,
                "maxLength": MAX_QUERY_VALUE,
                "minLength": 1,
                "title": "Account",
                "type": "string",
            },
        }
    )
    success = {"application/json": {"schema": {"$ref": "#/components/schemas/CredentialView"}}}
    problems = problem_responses(400, 401, 403, 404, 422, 429)
    operation = {
        "tags": ["integration"],
        "summary": "Credential",
        "description": DESCRIPTION,
        "operationId": "credential_api_v1_credentials__provider__get",
        "security": [{service_secret.scheme_name: []}],
        "parameters": parameters,
        "responses": {
            "200": {"description": "Successful Response", "content": success},
            **{str(status): answer for status, answer in problems.items()},
        },
    }
    # checked as FastAPI checks its own operations, and dumped the same way (no nulls)
    checked = Operation.model_validate(operation)
    openapi["paths"][PATH] = {
        "get": checked.model_dump(by_alias=True, exclude_none=True, mode="json")
    }
    components = openapi.setdefault("components", {})
    components.setdefault("securitySchemes", {}).setdefault(
        service_secret.scheme_name,
        service_secret.model.model_dump(by_alias=True, exclude_none=True, mode="json"),
    )
    components.setdefault("schemas", {}).setdefault(
        "CredentialView",
        CredentialView.model_json_schema(ref_template="#/components/schemas/{model}"),
    )
