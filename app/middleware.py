"""Pure ASGI middleware: Host allow-list, request ids, an access log without query strings, and
a cap on request bodies.

uvicorn's own access log prints the query string (and so OAuth `code`/`state`); it is disabled and
replaced by `AccessLog`, which logs method, path, status and duration only (SECURITY.md §0.10).
"""

from __future__ import annotations

import itertools
import logging
import secrets
import time
from collections.abc import Awaitable

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from app import request_id as request_ids
from app.errors import BodyTooLarge
from app.logsetup import sole_line_handler
from app.metrics import UNMATCHED_ROUTE, BrokerMetrics

access_logger = logging.getLogger("broker.access")
host_logger = logging.getLogger("broker.security")
# Request ids correlate log lines and error pages; they carry no authority, so a random tag per
# process and a counter do (no random draw per request).
_PROCESS_TAG = secrets.token_hex(4)
_sequence = itertools.count(1)


def first_header(scope: Scope, name: bytes) -> str | None:
    """The first header `name` (lower-case) of an ASGI scope, as Starlette's `headers.get` reads
    it, without building a headers object (the hot paths look up one header each)."""
    for key, value in scope["headers"]:
        if key == name:
            text: str = value.decode("latin-1")
            return text
    return None


class HostGuard:
    """Refuse requests whose Host is not one of ours (DNS rebinding, Host poisoning).

    `any_host_paths` answer whatever the Host: health probes (a container's HEALTHCHECK, a
    Kubernetes probe) address the process by its own IP and port, not by the public name, and
    the probes reveal nothing a rebinding page could use.
    """

    def __init__(
        self,
        app: ASGIApp,
        allowed_hosts: frozenset[str],
        any_host_paths: frozenset[str] = frozenset(),
    ) -> None:
        self.app = app
        self.allowed_hosts = allowed_hosts
        self.any_host_paths = any_host_paths

    def __call__(self, scope: Scope, receive: Receive, send: Send) -> Awaitable[None]:
        """The app's own awaitable for an accepted request: like `BodyLimit`, this layer adds
        no coroutine of its own to every request."""
        if scope["type"] == "http":
            host = (first_header(scope, b"host") or "").strip().lower()
            if host not in self.allowed_hosts and scope["path"] not in self.any_host_paths:
                _log_refused_host(host, self.allowed_hosts)
                return _plain(send, 421, b"Misdirected request: unknown Host\n")
        return self.app(scope, receive, send)


LOGGED_HOST_CHARS = 100  # a hostile Host is cut to this many characters in the log


def _log_refused_host(host: str, allowed: frozenset[str]) -> None:
    """The Host refused and the ones accepted, for the operator (never in the response): a
    `server.public_url` that is not the name clients use shows up here. `ascii` escapes control
    and non-ASCII characters, so a hostile Host cannot forge or disguise log lines."""
    shown = ascii(host[:LOGGED_HOST_CHARS]) + ("..." if len(host) > LOGGED_HOST_CHARS else "")
    host_logger.warning(
        "host.refused host=%s accepted=%s: the Host is not that of server.public_url or "
        "server.allowed_origins; if clients reach the broker by this name, set "
        "server.public_url to it",
        shown,
        ",".join(sorted(allowed)),
    )


class BodyLimit:
    """Refuse a request body past `limit` bytes, on every route but `own_limit_paths`, whose
    endpoints cap their own bodies (/mcp: `server.max_body_bytes`, refused in JSON-RPC,
    app/mcp/endpoint.py).

    The body is counted as it arrives, so a chunked body (no Content-Length) stops at the cap
    like a declared one; a declared length past the cap fails at the first read, before any of
    the body is taken. Nothing is read here: the cap is checked when the route reads, after it
    has authenticated the caller, and `BodyTooLarge` raised from `receive` reaches the app's
    handlers, which answer in the route's own shape (a page on browser paths, problem JSON
    under /api/v1). A route that never reads its body never pays for it.
    """

    def __init__(
        self, app: ASGIApp, limit: int, own_limit_paths: frozenset[str] = frozenset()
    ) -> None:
        self.app = app
        self.limit = limit
        self.own_limit_paths = own_limit_paths

    def __call__(self, scope: Scope, receive: Receive, send: Send) -> Awaitable[None]:
        if scope["type"] != "http" or scope["path"] in self.own_limit_paths:
            return self.app(scope, receive, send)
        limit = self.limit
        declared = first_header(scope, b"content-length")
        too_long = declared is not None and (not declared.isdigit() or int(declared) > limit)
        received = 0

        async def receive_within_limit() -> Message:
            nonlocal received
            if too_long:
                raise BodyTooLarge()
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    raise BodyTooLarge()
            return message

        return self.app(scope, receive_within_limit, send)


async def _plain(send: Send, status: int, body: bytes) -> None:
    """A short text answer sent before any route: never sniffed as markup, cached or framed,
    whoever asked (it may be a browser page's request to a wrong Host)."""
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"text/plain; charset=utf-8"),
                (b"content-length", str(len(body)).encode()),
                (b"x-content-type-options", b"nosniff"),
                (b"cache-control", b"no-store"),
                (b"x-frame-options", b"DENY"),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})


class AccessLog:
    """One line per request: method, path (never the query), status, milliseconds, request id;
    and the request counted in `metrics`, under the template of the route that answered it
    (Starlette's router leaves it in the scope)."""

    def __init__(self, app: ASGIApp, metrics: BrokerMetrics | None = None) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request_id = f"{_PROCESS_TAG}{next(_sequence):08x}"
        scope.setdefault("state", {})["request_id"] = request_id
        current = request_ids.current.set(request_id)  # for audit rows written meanwhile
        started = time.perf_counter()
        status = 500

        def send_with_status(message: Message) -> Awaitable[None]:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            return send(message)

        try:
            await self.app(scope, receive, send_with_status)
        finally:
            request_ids.current.reset(current)
            seconds = time.perf_counter() - started
            if self.metrics is not None:
                self.metrics.request(_route(scope), scope["method"], status, seconds)
            _log_access(scope, status, seconds, request_id)


def _log_access(scope: Scope, status: int, seconds: float, request_id: str) -> None:
    """The access line: written straight by the sole line handler when there is one (the hot
    case), else through the logger, with its parts as fields for a JSON formatter."""
    handler = sole_line_handler(access_logger, logging.INFO)
    if handler is not None:
        line = (
            f"{scope['method']} {_safe_path(scope['path'])} {status}"
            f" {seconds * 1000:.1f}ms rid={request_id}"
        )
        handler.write_plain(logging.INFO, access_logger.name, line)
    elif access_logger.isEnabledFor(logging.INFO):
        path = _safe_path(scope["path"])
        milliseconds = seconds * 1000
        fields = {
            "method": scope["method"],
            "path": path,
            "status": status,
            "duration_ms": round(milliseconds, 1),
            "request_id": request_id,
        }
        access_logger.info(
            "%s %s %d %.1fms rid=%s",
            scope["method"],
            path,
            status,
            milliseconds,
            request_id,
            extra={"access": fields},
        )


def _route(scope: Scope) -> str:
    template = getattr(scope.get("route"), "path", None)
    return template if isinstance(template, str) else UNMATCHED_ROUTE


def _safe_path(path: str) -> str:
    """Flow ids in paths are not secret, but keep log lines short and free of control chars."""
    if path.isprintable():
        return path[:200]
    cleaned = "".join(ch if ch.isprintable() else "?" for ch in path)
    return cleaned[:200]
