"""POST /mcp: the Streamable HTTP transport (GET/DELETE answer 405).

Answers are one JSON response, or an event stream for a request that asked for progress and whose
tool reports some (app/mcp/progress.py).

Order: Origin allow-list (403) → bearer token (401/403; 429 from an address past its failed
authentications) → Content-Type (415) → body size (413) → JSON-RPC envelope (400) → headers and
_meta (400) → method (404) → the user's request budget (429) → dispatch. A raw ASGI endpoint
(`McpEndpoint`), the first route of the app: this is the hot path and needs no request object or
dependency injection.
"""

from __future__ import annotations

import functools
import logging
from typing import Any

from sqlalchemy.exc import DBAPIError, OperationalError
from sqlalchemy.exc import TimeoutError as PoolTimeout
from starlette.requests import ClientDisconnect
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from app import jsonbytes
from app.auth.bearer import IdpUnavailable, InvalidToken, bearer_token, challenge
from app.auth.principal import McpCaller
from app.bug_report import redacted_traceback
from app.errors import ProviderUnavailable
from app.json_message import JsonMessage
from app.limits import client_key
from app.mcp.envelope import HeaderMap, Message, check_message, header_map, parse_body
from app.mcp.methods import METHODS, Method
from app.mcp.progress import ProgressAnswer, ProgressReporter, accepts_event_stream
from app.mcp.protocol import (
    INTERNAL_ERROR,
    INVALID_REQUEST,
    LEGACY_HANDSHAKE,
    META_PROGRESS_TOKEN,
    META_SERVER_INFO,
    METHOD_NOT_FOUND,
    JsonRpcError,
    rate_limited,
    refusing_initialize,
)
from app.mcp.server import SERVER_INFO, McpServer

logger = logging.getLogger("broker.mcp")


class _HttpRefusal(Exception):
    def __init__(self, status: int, body: dict[str, Any], headers: dict[str, str] | None = None):
        super().__init__(status)
        self.status = status
        self.body = body
        self.headers = headers or {}


def _json(
    body: dict[str, Any], status: int = 200, headers: dict[str, str] | None = None
) -> JsonMessage:
    return JsonMessage(jsonbytes.dumps(body), status, headers)


def _error(exc: JsonRpcError, request_id: Any = None) -> JsonMessage:
    body: dict[str, Any] = {"jsonrpc": "2.0"}
    rid = exc.request_id if exc.request_id is not None else request_id
    if rid is not None:
        body["id"] = rid
    body["error"] = exc.to_error()
    return _json(body, exc.http_status, exc.headers)


async def mcp_endpoint(server: McpServer, scope: Scope, receive: Receive) -> Response:
    headers = header_map(scope["headers"])
    message: Message | None = None
    try:
        _check_origin(headers, server)
        caller = await _authenticate(headers, server, scope)
        content_type = headers.get("content-type", "").split(";")[0].strip().lower()
        if content_type != "application/json":
            raise _HttpRefusal(
                415, _plain_error(INVALID_REQUEST, "Content-Type must be application/json")
            )
        body = await _read_body(receive, headers, server.settings.server.max_body_bytes)
        message = parse_body(body)
        check_message(message, headers)
        method = METHODS.get(message.method)
        if method is None:
            if message.id is None:
                return Response(status_code=202)  # notifications are accepted and ignored
            raise JsonRpcError(
                METHOD_NOT_FOUND, f"Method not found: {message.method:.64}", http_status=404
            )
        if message.id is None:
            return Response(status_code=202)
        wait = server.limits.users.take(caller.principal)
        if wait:
            server.metrics.refused("user")
            raise rate_limited("Too many requests for this user", wait)
        if META_PROGRESS_TOKEN in message.meta and accepts_event_stream(headers):
            answer = functools.partial(_answer, scope, server, caller, message, headers, method)
            return ProgressAnswer(message.meta[META_PROGRESS_TOKEN], answer)
        result = await method(server, caller, message, headers, None)
    except _HttpRefusal as refusal:
        return _json(refusal.body, refusal.status, refusal.headers)
    except ClientDisconnect:
        return Response(status_code=400)
    except Exception as exc:
        return _failure(exc, scope, server, message)
    return _result(server, message, result)


async def _answer(
    scope: Scope,
    server: McpServer,
    caller: McpCaller,
    message: Message,
    headers: HeaderMap,
    method: Method,
    progress: ProgressReporter,
) -> JsonMessage:
    """The answer of a request that may report progress (app/mcp/progress.py)."""
    try:
        result = await method(server, caller, message, headers, progress)
    except Exception as exc:
        return _failure(exc, scope, server, message)
    return _result(server, message, result)


def _result(server: McpServer, message: Message, result: dict[str, Any]) -> JsonMessage:
    result["_meta"] = {META_SERVER_INFO: SERVER_INFO}
    server.metrics.mcp_result(message.method, str(result.get("resultType", "complete")))
    return _json({"jsonrpc": "2.0", "id": message.id, "result": result})


def _failure(
    exc: Exception, scope: Scope, server: McpServer, message: Message | None
) -> JsonMessage:
    """The JSON-RPC error answering `exc`: its own, the service's unavailability, or a bug's."""
    request_id = message.id if message is not None else None
    if isinstance(exc, JsonRpcError):
        if (message.method if message is not None else exc.method) == LEGACY_HANDSHAKE:
            exc = refusing_initialize(exc)
        server.metrics.mcp_error(exc.code)
        return _error(exc, request_id)
    if isinstance(exc, OperationalError | DBAPIError | PoolTimeout | OSError | TimeoutError):
        if isinstance(exc, ProviderUnavailable):  # the provider's outage, not the broker's
            logger.warning("provider.unavailable error=%s", type(exc).__name__)
        else:
            logger.error("mcp.unavailable error=%s", type(exc).__name__)
        unavailable = JsonRpcError(
            INTERNAL_ERROR,
            "The service is temporarily unavailable; retry shortly",
            http_status=503,
            headers={"Retry-After": "5"},
        )
        server.metrics.mcp_error(INTERNAL_ERROR)
        return _error(unavailable, request_id)
    # a bug: still answer in JSON-RPC, never with a page or a stack trace
    rid = scope.get("state", {}).get("request_id", "")
    logger.error("mcp.internal_error rid=%s\n%s", rid, redacted_traceback(exc))
    failure = JsonRpcError(
        INTERNAL_ERROR, "Internal error", http_status=500, data={"reference": rid}
    )
    server.metrics.mcp_error(INTERNAL_ERROR)
    return _error(failure, request_id)


def _plain_error(code: int, text: str) -> dict[str, Any]:
    return {"jsonrpc": "2.0", "error": {"code": code, "message": text}}


def _check_origin(headers: HeaderMap, server: McpServer) -> None:
    origin = headers.get("origin")
    if origin is not None and origin not in server.allowed_origins:
        raise _HttpRefusal(403, _plain_error(INVALID_REQUEST, "Origin not allowed"))


async def _authenticate(headers: HeaderMap, server: McpServer, scope: Scope) -> McpCaller:
    token = bearer_token(headers.get("authorization"))
    if token is None:
        raise _HttpRefusal(
            401,
            {"error": "unauthorized", "error_description": "A bearer token is required"},
            {"WWW-Authenticate": _challenge(server)},
        )
    caller = server.verifier.cached(token)
    if caller is None:
        caller = await _verify_new_token(token, server, client_key(scope.get("client")))
    required = server.settings.identity.required_scopes
    if required and not caller.scopes.issuperset(required):
        raise _HttpRefusal(
            403,
            {"error": "insufficient_scope", "error_description": "The token lacks a scope"},
            {
                "WWW-Authenticate": _challenge(
                    server,
                    error="insufficient_scope",
                    description="The access token lacks a required scope",
                )
            },
        )
    return caller


async def _verify_new_token(token: str, server: McpServer, address: str) -> McpCaller:
    """Check a token not verified before, unless its sender's address has spent its budget of
    failed authentications (then no signature is checked: 429)."""
    wait = server.security.failed_auth_wait(address)
    if wait:
        raise rate_limited("Too many failed authentications from this address", wait)
    try:
        return await server.verifier.verify(token)
    except InvalidToken as exc:
        logger.info("auth.invalid_token reason=%s", exc.reason)
        if not exc.expired:  # a client due to refresh has not failed to authenticate
            server.security.note_failed_authentication(address)
        raise _HttpRefusal(
            401,
            {"error": "invalid_token", "error_description": "The access token is invalid"},
            {"WWW-Authenticate": _challenge(server, error="invalid_token")},
        ) from None
    except IdpUnavailable:
        raise _HttpRefusal(
            503,
            {"error": "temporarily_unavailable", "error_description": "Cannot reach the IdP"},
            {"Retry-After": "5"},
        ) from None


def _challenge(server: McpServer, **details: str) -> str:
    """The `WWW-Authenticate` value of a refusal: our resource metadata, the required scopes."""
    settings = server.settings
    return challenge(
        f"{settings.public_origin}/.well-known/oauth-protected-resource/mcp",
        scope=" ".join(settings.identity.advertised_scopes),
        **details,
    )


async def _read_body(receive: Receive, headers: HeaderMap, limit: int) -> bytes:
    declared = headers.get("content-length")
    if declared is not None and (not declared.isdigit() or int(declared) > limit):
        raise _HttpRefusal(413, _plain_error(INVALID_REQUEST, "The request body is too large"))
    # The ASGI messages themselves: Starlette's `request.stream()` generator costs more than
    # the read on this path.
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientDisconnect()
        chunk: bytes = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise _HttpRefusal(413, _plain_error(INVALID_REQUEST, "The request body is too large"))
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)


class McpEndpoint:
    """/mcp as an ASGI endpoint (app/asgi_route.py), built with the process's `McpServer`."""

    def __init__(self, server: McpServer) -> None:
        self.server = server

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["method"] == "POST":
            response = await mcp_endpoint(self.server, scope, receive)
        else:
            response = Response(status_code=405, headers={"Allow": "POST"})
        await response(scope, receive, send)
