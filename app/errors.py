"""Expected failures of the browser pages and JSON endpoints, rendered per surface.

`/mcp` has its own JSON-RPC errors (app/mcp/protocol.py). Everything else raises a BrokerError
subclass: browser routes get an HTML page saying what happened and what to do next, the rest gets
problem JSON (RFC 9457). Internal detail goes to the log with the request id, never to the page.
"""

from __future__ import annotations

import logging
from typing import Any, ClassVar

from sqlalchemy.exc import DBAPIError, OperationalError
from sqlalchemy.exc import TimeoutError as PoolTimeout
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from app.bug_report import redacted_traceback
from app.templating import render

logger = logging.getLogger("broker.errors")

API_PREFIX = "/api/"
HTML_PREFIXES = ("/connect/", "/oauth/", "/login", "/logout", "/connections", "/dev-idp")


class BrokerError(Exception):
    """An expected failure we can explain to the caller. Bugs stay ordinary exceptions (500)."""

    status_code: ClassVar[int] = 400
    code: ClassVar[str] = "bad_request"
    title: ClassVar[str] = "Something is wrong with this request"
    message: ClassVar[str] = "The request could not be completed."
    next_step: ClassVar[str] = "Go back to your MCP client and try again."

    def __init__(
        self,
        message: str | None = None,
        *,
        next_step: str | None = None,
        page: dict[str, object] | None = None,
    ) -> None:
        self.public_message = message or self.message
        self.public_next_step = next_step or self.next_step
        self.page: dict[str, Any] = (
            page or {}
        )  # extra values for the HTML page (e.g. a sign-out form)
        super().__init__(self.public_message)


class NotFound(BrokerError):
    status_code = 404
    code = "not_found"
    title = "Link not found"
    message = "This link does not exist. It may be mistyped or may have been removed."
    next_step = "Ask your MCP client for a new link by calling the tool again."


class Forbidden(BrokerError):
    status_code = 403
    code = "forbidden"
    title = "Not allowed"
    message = "This request was refused."


class CsrfFailed(Forbidden):
    code = "csrf_failed"
    title = "The form expired"
    message = "This form could not be verified (it may be old or from another site)."
    next_step = "Reload the page and submit the form again."


class BadLogin(BrokerError):
    status_code = 400
    code = "login_failed"
    title = "Sign-in did not complete"
    message = "The sign-in response could not be verified."
    next_step = "Open the link from your MCP client again to sign in afresh."


class PayloadTooLarge(BrokerError):
    status_code = 413
    code = "payload_too_large"
    title = "Too much data"
    message = "The submitted form is too large."
    next_step = "Go back and check what you entered."


class BodyTooLarge(PayloadTooLarge):
    """A request body past the cap of its route (app/middleware.py `BodyLimit`)."""

    message = "The request body is too large for this address; nothing was changed."


class ServiceUnavailable(BrokerError):
    status_code = 503
    code = "unavailable"
    title = "Temporarily unavailable"
    message = "The broker cannot reach its database or identity provider right now."
    next_step = "Wait a moment, then reload this page."


def wants_html(request: Request) -> bool:
    return request.url.path.startswith(HTML_PREFIXES)


def render_error(request: Request, error: BrokerError) -> Response:
    if wants_html(request):
        return render(
            request,
            "errors/error.html",
            status_code=error.status_code,
            title=error.title,
            message=error.public_message,
            next_step=error.public_next_step,
            **error.page,
        )
    return JSONResponse(
        {
            "type": f"urn:connect-broker:error:{error.code}",
            "title": error.title,
            "status": error.status_code,
            "detail": error.public_message,
            "instance": problem_instance(request),
        },
        status_code=error.status_code,
        media_type="application/problem+json",
    )


def problem_instance(request: Request) -> str:
    """RFC 9457 `instance`: this answer's request id, the reference the log lines carry."""
    return f"urn:connect-broker:request:{getattr(request.state, 'request_id', '')}"


async def on_broker_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, BrokerError)
    return render_error(request, exc)


class MethodNotAllowed(BrokerError):
    status_code = 405
    code = "method_not_allowed"
    title = "Not available this way"
    message = "This address does not accept that kind of request."
    next_step = "Open the link from your MCP client again."


class NoSuchEndpoint(BrokerError):
    status_code = 404
    code = "no_such_endpoint"
    title = "No such endpoint"
    message = "The integration API has no endpoint at this path; see /api/v1/openapi.json."


class EndpointMethodNotAllowed(BrokerError):
    status_code = 405
    code = "method_not_allowed"
    title = "Method not allowed"
    message = "This endpoint does not take that method (see Allow and /api/v1/openapi.json)."


class UnreadableRequest(BrokerError):
    """What Starlette refused before a page's own code ran (a form it cannot parse, too many
    fields), on a browser path; answered with the status Starlette chose."""

    code = "unreadable_request"
    title = "This request could not be read"
    message = "The browser sent something this page cannot read; nothing was changed."
    next_step = "Go back, reload the page and try again."


async def on_http_exception(request: Request, exc: Exception) -> Response:
    """Starlette's own errors: on browser paths our page (its security headers, a next step)
    whatever the status; under /api/ problem JSON for routing misses (404/405), as the rest of
    those paths answer, instead of Starlette's `{"detail": …}`. The exception's headers are kept
    (a 405's `Allow`, RFC 9110), never over the page's own."""
    assert isinstance(exc, StarletteHTTPException)
    error: BrokerError | None = None
    if wants_html(request):
        if exc.status_code == 404:
            error = NotFound()
        elif exc.status_code == 405:
            error = MethodNotAllowed()
        else:
            error = UnreadableRequest()
    elif exc.status_code in (404, 405) and request.url.path.startswith(API_PREFIX):
        error = NoSuchEndpoint() if exc.status_code == 404 else EndpointMethodNotAllowed()
    if error is None:
        return JSONResponse(
            {"detail": exc.detail},
            status_code=exc.status_code,
            headers=getattr(exc, "headers", None),
        )
    response = render_error(request, error)
    response.status_code = exc.status_code
    for name, value in (exc.headers or {}).items():
        response.headers.setdefault(name, value)
    return response


class ProviderUnavailable(TimeoutError):
    """A provider the answer needs could not be reached now (a credential's refresh): answered
    as a short unavailability, as the database's is (503 and `Retry-After`; on `/mcp`,
    JSON-RPC's retry-shortly error), but said and logged as the provider's."""


class ProviderTemporarilyUnavailable(BrokerError):
    status_code = 503
    code = "provider_unavailable"
    title = "The provider is temporarily unavailable"
    message = "The credential's provider could not be reached to refresh it; nothing changed."
    next_step = "Retry in a moment."


async def on_provider_unavailable(request: Request, exc: Exception) -> Response:
    logger.warning("provider.unavailable error=%s", type(exc).__name__)
    return _retry_shortly(request, ProviderTemporarilyUnavailable())


async def on_database_error(request: Request, exc: Exception) -> Response:
    logger.error("database.unavailable error=%s", type(exc).__name__)
    return _retry_shortly(request, ServiceUnavailable())


def _retry_shortly(request: Request, error: BrokerError) -> Response:
    response = render_error(request, error)
    response.headers["Retry-After"] = "5"
    return response


class InternalError(BrokerError):
    status_code = 500
    code = "internal_error"
    title = "Something went wrong"
    message = "An unexpected error occurred; it has been logged under this answer's reference."
    next_step = "Try again; if it keeps happening, tell your administrator the reference."


async def on_client_disconnect(request: Request, _exc: Exception) -> Response:
    """The client went away before its request body arrived (a closed tab, a dropped link).

    Nobody reads the answer and nothing failed on our side: an info line, no traceback. The
    request's database session is rolled back as on any other error (app/db.py `get_session`).
    """
    logger.info("request.client_disconnected rid=%s", getattr(request.state, "request_id", ""))
    return Response(status_code=400)


# The scope key under which `on_unexpected_error` records the exception it has logged.
LOGGED_ERROR_KEY = "broker.logged_error"


async def on_unexpected_error(request: Request, exc: Exception) -> Response:
    """A bug: one traceback in the log (messages withheld, app/bug_report.py), tagged with the
    request id the 500 answer shows."""
    rid = getattr(request.state, "request_id", "")
    logger.error("unexpected error rid=%s\n%s", rid, redacted_traceback(exc))
    request.scope[LOGGED_ERROR_KEY] = exc
    return render_error(request, InternalError())


# connection failures surface as OSError subclasses before SQLAlchemy can wrap them
DATABASE_ERRORS = (OperationalError, DBAPIError, PoolTimeout, ConnectionError, TimeoutError)
