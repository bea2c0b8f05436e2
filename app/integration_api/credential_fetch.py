"""GET /api/v1/credentials/{provider}, the integration API's hot path, without FastAPI's
per-request machinery (routing, dependency solving, response-model validation: most of the CPU
such a request costs).

Only well-formed requests come here: exactly the `issuer` and `subject` query parameters, each
1-255 characters of storable text (app/storable.py). Everything else (a missing or extra
parameter, any other method) goes to the FastAPI route, which answers it the documented way
(422 problem JSON and so on). Both give the same responses: this path runs the route's own
function (`credential_for`), having read the service and its own connection for the user in one
statement.
"""

from __future__ import annotations

import functools
from urllib.parse import unquote_plus

from fastapi.security.utils import get_authorization_scheme_param
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from app.auth.principal import Principal
from app.errors import (
    DATABASE_ERRORS,
    BrokerError,
    on_database_error,
    on_unexpected_error,
)
from app.integration_api import services
from app.integration_api.problems import InvalidServiceCredentials, problem_response
from app.integration_api.routes import NO_STORE, credential_for, refuse_spent_address
from app.json_message import JsonMessage
from app.limits import client_key
from app.middleware import first_header
from app.runtime import Runtime
from app.storable import unstorable_reason

PREFIX = "/api/v1/credentials/"
ROUTE = PREFIX + "{provider}"  # the FastAPI route's template, as metrics name it
USER_KEY = (
    "connect_broker.user"  # the scope entry where the dispatcher leaves `user_query`'s answer
)
MAX_QUERY_VALUE = 255


def user_query(scope: Scope) -> tuple[str, str] | None:
    """(issuer, subject) of a plain credential fetch, or None to leave it to FastAPI."""
    if scope["type"] != "http" or scope["method"] != "GET":
        return None
    provider = scope["path"].removeprefix(PREFIX)
    if not provider or "/" in provider or provider == scope["path"]:
        return None
    values = _two_fields(scope["query_string"].decode("latin-1"))
    if values is None or values.keys() != {"issuer", "subject"}:
        return None
    issuer, subject = values["issuer"], values["subject"]
    if not (0 < len(issuer) <= MAX_QUERY_VALUE and 0 < len(subject) <= MAX_QUERY_VALUE):
        return None
    if unstorable_reason(issuer) or unstorable_reason(subject):
        return None  # the route authenticates the secret alone, then refuses the value
    return issuer, subject


def _two_fields(query: str) -> dict[str, str] | None:
    """`a=1&b=2` decoded as Starlette decodes a query (`parse_qsl`: UTF-8, `+` is a space), or
    None for anything but two `name=value` fields."""
    first, separator, second = query.partition("&")
    if not separator or "&" in second:
        return None
    values: dict[str, str] = {}
    for field in (first, second):
        name, equals, value = field.partition("=")
        if not equals:
            return None
        values[_unquote(name)] = _unquote(value)
    return values


def _unquote(text: str) -> str:
    """`unquote_plus`, skipped for text it would not change; the issuer (the same URL on most
    requests, always percent-encoded) comes from a small cache. Text longer than any accepted
    value, fully escaped, is never cached: the cache holds no attacker-sized strings."""
    if "%" not in text and "+" not in text:
        return text
    return _cached_unquote(text) if len(text) <= MAX_QUERY_VALUE * 3 else unquote_plus(text)


@functools.lru_cache(maxsize=256)
def _cached_unquote(text: str) -> str:
    return unquote_plus(text)


async def credential_fetch(scope: Scope, receive: Receive, send: Send) -> None:
    runtime: Runtime = scope["app"].state.runtime
    issuer, subject = scope[USER_KEY]
    provider = scope["path"].removeprefix(PREFIX)
    try:
        scheme, secret = get_authorization_scheme_param(first_header(scope, b"authorization"))
        if scheme.lower() != "bearer" or not secret:
            raise InvalidServiceCredentials()
        address = client_key(scope.get("client"))
        refuse_spent_address(runtime, address, secret)
        found = await services.authenticate_with_own_connection(
            runtime.direct,
            keys=runtime.signing_keys,
            secret=secret,
            principal=Principal(issuer, subject),
            provider=provider,
        )
        if found is None:
            runtime.note_failed_authentication(address)
            raise InvalidServiceCredentials()
        runtime.limits.remember_secret(secret)
        service, own = found
        usable = await credential_for(
            runtime, service, provider, issuer, subject, known={(provider, service.name): own}
        )
        response: Response = JsonMessage(usable.document(), 200, NO_STORE)
    except BrokerError as exc:
        response = problem_response(Request(scope, receive), exc)
    except DATABASE_ERRORS as exc:
        response = await on_database_error(Request(scope, receive), exc)
    except Exception as exc:  # a bug: answered like any other route's, and logged
        response = await on_unexpected_error(Request(scope, receive), exc)
    await response(scope, receive, send)
