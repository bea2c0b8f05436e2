"""The integration API's failures: `application/problem+json` (RFC 9457) with a stable `type`
per error, also for a request that fails validation and for a 401 (which names the scheme)."""

from __future__ import annotations

from collections.abc import Callable, Coroutine
from typing import Any

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.routing import APIRoute
from pydantic import BaseModel, Field
from starlette.responses import JSONResponse, Response

from app.errors import BrokerError, problem_instance, render_error
from app.limits import retry_after


class InvalidServiceCredentials(BrokerError):
    status_code = 401
    code = "invalid_service_credentials"
    title = "Unknown or revoked service secret"
    message = "Send Authorization: Bearer <service secret> of a registered, unrevoked service."


class TooManyFailedAuthentications(BrokerError):
    status_code = 429
    code = "too_many_failed_authentications"
    title = "Too many failed authentications"
    message = (
        "Too many unknown or revoked service secrets came from this address. Retry after the"
        " seconds `Retry-After` gives, with the secret `connect-broker service create` printed."
    )

    def __init__(self, seconds: float) -> None:
        super().__init__()
        self.retry_after = retry_after(seconds)


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


class AccountRequired(BrokerError):
    status_code = 409
    code = "account_required"
    title = "Several accounts"
    message = (
        "The user has several accounts of this provider through this service; name one with "
        "`account` (as GET /api/v1/connections names them). Nothing was deleted."
    )


class UnknownIssuer(BrokerError):
    status_code = 400
    code = "unknown_issuer"
    title = "Unknown issuer"
    message = "The user's issuer must be the identity provider this broker trusts."


class UserProofRequired(BrokerError):
    status_code = 403
    code = "user_proof_required"
    title = "The user's own token is required"
    message = (
        "This service is configured with user_proof = 'token': it cannot name a user. Exchange"
        " the user's access token at POST /api/v1/token, send it as `subject_token` to require"
        " and resume, or in the Subject-Token header to list and disconnect connections."
    )


class UserProofNotEnabled(BrokerError):
    status_code = 400
    code = "user_proof_not_enabled"
    title = "User proof not enabled for this service"
    message = (
        "Only a service configured with user_proof = 'token' sends the user's token; this"
        " service names the user instead."
    )


class SubjectTokenInvalid(BrokerError):
    status_code = 400
    code = "subject_token_invalid"
    title = "Invalid user token"
    message = (
        "The user's access token is malformed, not signed by the broker's IdP, or lacks a claim."
    )


class SubjectTokenWrongAudience(SubjectTokenInvalid):
    code = "subject_token_wrong_audience"
    title = "User token for another audience"
    message = "The user's access token is not for this service's token_audience."


class SubjectTokenExpired(SubjectTokenInvalid):
    code = "subject_token_expired"
    title = "Expired user token"
    message = "The user's access token has expired; send a current one."


class IdentityProviderUnavailable(BrokerError):
    status_code = 503
    code = "idp_unavailable"
    title = "Identity provider unavailable"
    message = "The broker cannot fetch its identity provider's keys right now; retry shortly."


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
    instance: str = Field(
        examples=["urn:connect-broker:request:5f3a9c1e0000002a"],
        description="This answer's request id: the reference the broker's log lines carry",
    )
    errors: list[dict[str, Any]] | None = Field(
        default=None, description="422 only: where the request is wrong (`loc`, `msg`, `type`)"
    )


def problem_responses(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """OpenAPI entries for the problem responses a route can give."""
    content = {"application/problem+json": {"schema": Problem.model_json_schema()}}
    return {status: {"description": "problem details", "content": content} for status in statuses}


def invalid_request(request: Request, exc: RequestValidationError) -> Response:
    """422 as problem JSON. Only where and what: pydantic's `input` and `ctx` echo the caller's
    values back (a secret sent in the wrong field would land in the response and in logs)."""
    problem = Problem(
        type=f"urn:connect-broker:error:{InvalidRequest.code}",
        title=InvalidRequest.title,
        status=InvalidRequest.status_code,
        detail=InvalidRequest.message,
        instance=problem_instance(request),
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
    """A failure as problem JSON; a 401 also names the scheme (`WWW-Authenticate`), a 429 says
    when to try again (`Retry-After`)."""
    response = render_error(request, exc)
    if isinstance(exc, InvalidServiceCredentials):
        response.headers["WWW-Authenticate"] = 'Bearer realm="connect-broker"'
    elif isinstance(exc, TooManyFailedAuthentications):
        response.headers["Retry-After"] = exc.retry_after
    return response


class ProblemRoute(APIRoute):
    """Renders this router's own failures that the app-wide handlers render differently.

    A request that fails validation becomes problem JSON (the app's default handler answers plain
    JSON, and only /api/v1 promises problem JSON everywhere); a 401 carries `WWW-Authenticate`,
    a 429 `Retry-After`.
    """

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handle = super().get_route_handler()

        async def handle_with_problems(request: Request) -> Response:
            try:
                return await handle(request)
            except RequestValidationError as exc:
                return invalid_request(request, exc)
            except (InvalidServiceCredentials, TooManyFailedAuthentications) as exc:
                return problem_response(request, exc)

        return handle_with_problems
