"""A small fake GitHub: the OAuth app endpoints and the REST calls the GitHub preset makes.

It is the third-party boundary for SECURITY.md groups E and F, and mimics GitHub's quirks: token
endpoint errors come in a 200 body, the token response format follows ``Accept`` (JSON or
form-encoded), granted scopes are comma-separated, and expiring tokens come with a refresh token
that rotates on use, and revoking the app's grant for a user (``/applications/{id}/grant``) ends
every token of that user, where revoking a token (``/applications/{id}/token``) ends that one.
Fault switches (``token_fault``, ``user_fault``, ``revoke_fault``) fire once,
or on every call while ``sticky_faults`` is set. Everything it issues carries a canary prefix
(``CANARYCODE``, ``gho_CANARYTOKEN``, ``ghr_CANARY``) for the I1 sweep.

The server is uvicorn in a background thread, on a socket bound to 127.0.0.1:0 before it starts
(no free-port race). Counters are plain ints and lists: tests read them from their own thread.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import hashlib
import json
import re
import secrets
import socket
import threading
import time
import zlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Literal
from urllib.parse import urlencode

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import (
    HTMLResponse,
    JSONResponse,
    PlainTextResponse,
    RedirectResponse,
    Response,
    StreamingResponse,
)
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

__all__ = ["METADATA_URL", "FakeGitHub", "ServerFault", "TokenFault"]

TokenFault = Literal[
    "500", "timeout", "trickle", "html", "truncated", "missing_token", "mac", "huge", "redirect",
    "refresh_invalid",
]  # fmt: skip
ServerFault = Literal["500"]
RevokeFault = Literal["500", "timeout"]

METADATA_URL = "http://169.254.169.254/latest"
TIMEOUT_SECONDS = 60.0
HUGE_BYTES = 5 * 1024 * 1024
START_TIMEOUT = 10.0
STOP_TIMEOUT = 5.0
_DOCS = "https://docs.github.com/apps/oauth-apps/maintaining-oauth-apps/troubleshooting-oauth-app-access-token-request-errors"
_KNOWN_USERS = {"octocat": (1, "The Octocat")}
_BAD_CLIENT = "The client_id and/or client_secret passed are incorrect."
_BAD_REDIRECT = "The redirect_uri MUST match the registered callback URL for this application."


@dataclass
class _Grant:
    """A pending authorization code."""

    user: str
    scope: str
    redirect_uri: str
    challenge: str


@dataclass
class _Token:
    user: str
    scope: str
    access_token: str
    refresh_token: str | None


def _error(code: str, description: str) -> dict[str, Any]:
    return {"error": code, "error_description": description, "error_uri": f"{_DOCS}#{code}"}


def _redirect(uri: str, **params: str) -> RedirectResponse:
    separator = "&" if "?" in uri else "?"
    return RedirectResponse(f"{uri}{separator}{urlencode(params)}", status_code=302)


def _s256(verifier: str) -> str:
    return base64.urlsafe_b64encode(hashlib.sha256(verifier.encode()).digest()).decode().rstrip("=")


def _profile(login: str) -> dict[str, Any]:
    user_id, name = _KNOWN_USERS.get(login, (1000 + zlib.crc32(login.encode()) % 10**6, login))
    return {"login": login, "id": user_id, "name": name}


class FakeGitHub:
    """A fake github.com + api.github.com on one loopback origin; see the module docstring."""

    next_user: str
    deny_next: bool
    expiring_tokens: bool
    echo_authorization: bool
    sticky_faults: bool
    token_fault: TokenFault | None
    user_fault: ServerFault | None
    revoke_fault: RevokeFault | None
    authorize_hits: int
    token_calls: int
    refresh_calls: int
    user_calls: int
    revocations: int  # grant and token revocations
    grant_revocations: int  # those of the whole grant: every token of the user ends

    def __init__(
        self,
        *,
        redirect_uri: str,
        client_id: str = "gh-client-id",
        client_secret: str = "gh-client-secret",  # noqa: S107 - a test fixture value
    ) -> None:
        self.redirect_uri = redirect_uri
        self.client_id = client_id
        self.client_secret = client_secret
        self.seen_authorization: list[str] = []
        self.authorize_requests: list[dict[str, str]] = []
        self.issued_access_tokens: list[str] = []
        self.issued_refresh_tokens: list[str] = []
        self._codes: dict[str, _Grant] = {}
        self._access: dict[str, _Token] = {}
        self._refresh: dict[str, _Token] = {}
        self._generation = 0
        self._stopping = False
        self._port: int | None = None
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None
        self._app = Starlette(
            routes=[
                Route("/login/oauth/authorize", self._authorize, methods=["GET"]),
                Route("/login/oauth/access_token", self._token, methods=["POST"]),
                Route("/user", self._user, methods=["GET"]),
                Route("/user/repos", self._repos, methods=["GET"]),
                Route("/applications/{client_id}/grant", self._revoke, methods=["DELETE"]),
                Route("/applications/{client_id}/token", self._revoke, methods=["DELETE"]),
            ]
        )
        self.reset()

    # ---- lifecycle -------------------------------------------------------------------------

    @property
    def url(self) -> str:
        """Base URL, e.g. ``http://127.0.0.1:54321`` (both the web and the API origin)."""
        if self._port is None:
            raise RuntimeError("FakeGitHub is not started")
        return f"http://127.0.0.1:{self._port}"

    @property
    def authorize_url(self) -> str:
        return f"{self.url}/login/oauth/authorize"

    @property
    def token_url(self) -> str:
        return f"{self.url}/login/oauth/access_token"

    def start(self) -> FakeGitHub:
        """Serve in a daemon thread; returns once the socket accepts connections."""
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.bind(("127.0.0.1", 0))
        self._port = sock.getsockname()[1]
        self._stopping = False
        config = uvicorn.Config(
            self._asgi, log_config=None, log_level="warning", access_log=False,
            lifespan="off", interface="asgi3", http="h11", ws="none", timeout_graceful_shutdown=1,
        )  # fmt: skip
        server = self._server = uvicorn.Server(config)
        self._thread = threading.Thread(
            target=server.run, kwargs={"sockets": [sock]}, name="fake-github", daemon=True
        )
        self._thread.start()
        deadline = time.monotonic() + START_TIMEOUT
        while not server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("FakeGitHub did not start")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        """Stop the server; slow faults (timeout, trickle) are cut short so this is quick."""
        server, thread = self._server, self._thread
        if server is None or thread is None:
            return
        self._stopping = True
        server.should_exit = True
        thread.join(STOP_TIMEOUT)
        if thread.is_alive():
            server.force_exit = True
            thread.join(STOP_TIMEOUT)
        self._server = self._thread = None

    def __enter__(self) -> FakeGitHub:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def reset(self) -> None:
        """Forget counters, faults, switches, codes and tokens; release pending slow responses."""
        self._generation += 1
        self.next_user = "octocat"
        self.deny_next = self.expiring_tokens = self.echo_authorization = False
        self.sticky_faults = False
        self.token_fault = self.user_fault = self.revoke_fault = None
        self.authorize_hits = self.token_calls = self.refresh_calls = 0
        self.user_calls = self.revocations = self.grant_revocations = 0
        for log in (self.seen_authorization, self.authorize_requests):
            log.clear()
        self.issued_access_tokens.clear()
        self.issued_refresh_tokens.clear()
        self._codes.clear()
        self._access.clear()
        self._refresh.clear()

    def is_live(self, access_token: str) -> bool:
        """Whether an issued access token still works (neither revoked nor rotated away)."""
        return access_token in self._access

    def expire_access_tokens(self) -> None:
        """Invalidate every access token but keep refresh tokens (as after 8 hours)."""
        self._access.clear()

    # ---- plumbing --------------------------------------------------------------------------

    async def _asgi(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            for name, value in scope["headers"]:
                if name == b"authorization":
                    self.seen_authorization.append(value.decode("latin-1"))
        await self._app(scope, receive, send)

    async def _pause(self, seconds: float) -> bool:
        """Sleep, but return False early when stop() or reset() is called."""
        generation, deadline = self._generation, time.monotonic() + seconds
        while time.monotonic() < deadline:
            if self._stopping or generation != self._generation:
                return False
            await asyncio.sleep(0.05)
        return True

    def _take(
        self, name: Literal["token_fault", "user_fault", "revoke_fault"], *, applies: bool = True
    ) -> Any:
        """The armed fault, disarmed unless sticky; None when it does not apply to this call."""
        fault = getattr(self, name) if applies else None
        if fault is not None and not self.sticky_faults:
            setattr(self, name, None)
        return fault

    def _client_ok(self, request: Request, form: dict[str, str] | None = None) -> bool:
        """Client authentication by HTTP Basic, else (when a form is given) by form fields."""
        scheme, _, encoded = request.headers.get("authorization", "").partition(" ")
        client_id, secret = (form or {}).get("client_id"), (form or {}).get("client_secret")
        if scheme.lower() == "basic":
            try:
                client_id, _, secret = base64.b64decode(encoded).decode().partition(":")
            except (binascii.Error, UnicodeDecodeError):
                return False
        return client_id == self.client_id and secrets.compare_digest(
            (secret or "").encode(), self.client_secret.encode()
        )

    def _token_owner(self, request: Request) -> str | None:
        scheme, _, value = request.headers.get("authorization", "").partition(" ")
        token = self._access.get(value.strip()) if scheme.lower() in ("bearer", "token") else None
        return token.user if token else None

    # ---- github.com/login/oauth ------------------------------------------------------------

    async def _authorize(self, request: Request) -> Response:
        self.authorize_hits += 1
        query = dict(request.query_params)
        self.authorize_requests.append(query)
        if query.get("client_id") != self.client_id:
            return PlainTextResponse("Not Found", status_code=404)
        redirect_uri = query.get("redirect_uri", self.redirect_uri)
        if redirect_uri != self.redirect_uri:
            return PlainTextResponse("redirect_uri is not the registered callback", status_code=400)
        state = {"state": query["state"]} if "state" in query else {}
        challenge = query.get("code_challenge", "")
        if query.get("code_challenge_method") != "S256" or not challenge:
            return _redirect(
                redirect_uri, **_error("invalid_request", "PKCE S256 required"), **state
            )
        if self.deny_next:
            self.deny_next = False
            denied = _error("access_denied", "The user has denied your application access.")
            return _redirect(redirect_uri, **denied, **state)
        code = f"CANARYCODE{secrets.token_hex(10)}"
        scope = ",".join(s for s in re.split(r"[ ,]+", query.get("scope", "")) if s)
        self._codes[code] = _Grant(self.next_user, scope, redirect_uri, challenge)
        return _redirect(redirect_uri, code=code, **state)

    async def _token(self, request: Request) -> Response:
        """Process the grant first (a code is spent), then let a fault mangle the answer."""
        self.token_calls += 1
        form = {k: v for k, v in (await request.form()).items() if isinstance(v, str)}
        is_refresh = form.get("grant_type") == "refresh_token"
        # refresh_invalid stays armed until a refresh grant comes
        applies = is_refresh or self.token_fault != "refresh_invalid"
        fault: TokenFault | None = self._take("token_fault", applies=applies)
        if not self._client_ok(request, form):
            body = _error("incorrect_client_credentials", _BAD_CLIENT)
        elif is_refresh:
            body = self._refresh_grant(form, is_invalid=fault == "refresh_invalid")
        elif form.get("grant_type", "authorization_code") == "authorization_code":
            body = self._code_grant(form)
        else:
            body = _error("unsupported_grant_type", "The grant type is not supported.")
        if fault == "timeout":
            await self._pause(TIMEOUT_SECONDS)
        as_json = "application/json" in request.headers.get("accept", "")
        return self._token_response(body, fault, as_json=as_json)

    def _code_grant(self, form: dict[str, str]) -> dict[str, Any]:
        grant = self._codes.pop(form.get("code", ""), None)  # single use, even when refused
        verifier = form.get("code_verifier", "")
        if grant is None or not secrets.compare_digest(_s256(verifier), grant.challenge):
            return _error("bad_verification_code", "The code passed is incorrect or expired.")
        if form.get("redirect_uri", grant.redirect_uri) != grant.redirect_uri:
            return _error("redirect_uri_mismatch", _BAD_REDIRECT)
        return self._issue(grant.user, grant.scope)

    def _refresh_grant(self, form: dict[str, str], *, is_invalid: bool) -> dict[str, Any]:
        self.refresh_calls += 1
        old = None if is_invalid else self._refresh.pop(form.get("refresh_token", ""), None)
        if old is None:
            return _error("bad_refresh_token", "The refresh token passed is incorrect or expired.")
        self._access.pop(old.access_token, None)  # rotation: the old pair is dead
        return self._issue(old.user, old.scope)

    def _issue(self, user: str, scope: str) -> dict[str, Any]:
        token = _Token(user, scope, f"gho_CANARYTOKEN{secrets.token_hex(16)}", None)
        body: dict[str, Any] = {"access_token": token.access_token, "token_type": "bearer"}
        body["scope"] = scope
        if self.expiring_tokens:
            token.refresh_token = f"ghr_CANARY{secrets.token_hex(32)}"
            self._refresh[token.refresh_token] = token
            self.issued_refresh_tokens.append(token.refresh_token)
            body |= {"expires_in": 28800, "refresh_token": token.refresh_token}
            body["refresh_token_expires_in"] = 15897600
        self._access[token.access_token] = token
        self.issued_access_tokens.append(token.access_token)
        return body

    def _token_response(
        self, body: dict[str, Any], fault: TokenFault | None, *, as_json: bool
    ) -> Response:
        if fault == "mac" and "access_token" in body:
            body["token_type"] = "mac"
        if fault == "missing_token":
            body.pop("access_token", None)
        media = "application/json" if as_json else "application/x-www-form-urlencoded"
        content = json.dumps(body) if as_json else urlencode(body)
        match fault:
            case "500":
                return PlainTextResponse("Internal Server Error", status_code=500)
            case "html":
                return HTMLResponse("<html><body><h1>Unicorn! &middot; GitHub</h1></body></html>")
            case "truncated":
                whole = json.dumps(body)
                return Response(whole[: len(whole) // 2], media_type="application/json")
            case "huge":
                return JSONResponse({"padding": "x" * HUGE_BYTES, **body})
            case "redirect":
                return RedirectResponse(METADATA_URL, status_code=302)
            case "trickle":
                return StreamingResponse(self._trickle(content.encode()), media_type=media)
        return Response(content, media_type=media)

    async def _trickle(self, content: bytes) -> AsyncIterator[bytes]:
        for index in range(len(content)):
            yield content[index : index + 1]
            if not await self._pause(1.0):
                return

    # ---- api.github.com --------------------------------------------------------------------

    def _bad_credentials(self) -> JSONResponse:
        docs = "https://docs.github.com/rest"
        return JSONResponse({"message": "Bad credentials", "documentation_url": docs}, 401)

    def _echo(self, request: Request) -> dict[str, str]:
        """I3: put the received Authorization header in the body, when asked to."""
        if not self.echo_authorization:
            return {}
        return {"received_authorization": request.headers.get("authorization", "")}

    async def _user(self, request: Request) -> Response:
        self.user_calls += 1
        if self._take("user_fault") == "500":
            return JSONResponse({"message": "Server Error"}, status_code=500)
        user = self._token_owner(request)
        if user is None:
            return self._bad_credentials()
        return JSONResponse(_profile(user) | self._echo(request))

    async def _repos(self, request: Request) -> Response:
        user = self._token_owner(request)
        if user is None:
            return self._bad_credentials()
        owner = _profile(user)
        repos = [
            {"id": owner["id"] * 10 + n, "name": name, "full_name": f"{user}/{name}",
             "private": n == 3, "owner": {"login": user, "id": owner["id"]}} | self._echo(request)
            for n, name in enumerate(("hello-world", "spoon-knife", "secret-plans"), start=1)
        ]  # fmt: skip
        return JSONResponse(repos)

    async def _revoke(self, request: Request) -> Response:
        try:
            access_token = (await request.json())["access_token"]
        except (ValueError, KeyError, TypeError):
            return JSONResponse({"message": "Validation Failed"}, status_code=422)
        if access_token not in self.issued_access_tokens:
            # A token issued before the last reset: the broker's own housekeeping revoking what
            # an earlier test left queued. Not this test's revocation, so neither counted nor
            # subject to its faults; GitHub no longer knows the token.
            return JSONResponse({"message": "Not Found"}, status_code=404)
        self.revocations += 1
        fault: RevokeFault | None = self._take("revoke_fault")
        if fault == "500":
            return JSONResponse({"message": "Server Error"}, status_code=500)
        if fault == "timeout" and not await self._pause(TIMEOUT_SECONDS):
            return JSONResponse({"message": "Service Unavailable"}, status_code=503)
        if request.path_params["client_id"] != self.client_id or not self._client_ok(request):
            return self._bad_credentials()
        token = self._access.pop(access_token, None)
        if token is None:
            return JSONResponse({"message": "Not Found"}, status_code=404)
        ended = [token]
        if request.url.path.endswith("/grant"):  # as GitHub: every token of the app for the user
            self.grant_revocations += 1
            ended += [t for t in self._access.values() if t.user == token.user]
            ended += [t for t in self._refresh.values() if t.user == token.user]
        for each in ended:
            self._access.pop(each.access_token, None)
            if each.refresh_token:
                self._refresh.pop(each.refresh_token, None)
        return Response(status_code=204)
