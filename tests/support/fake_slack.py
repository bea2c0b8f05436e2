"""A small fake Slack: the OAuth v2 endpoints the Slack preset uses, with Slack's quirks.

Slack asks for a user's own token with `user_scope` (not `scope`) and answers it under
`authed_user`, beside the workspace (`team`); its Web API answers every error with a 200 and
`{"ok": false, "error": …}`. `auth.test` tells whether a token still works; `auth.revoke` ends it.
`revoke_fault = "not_ok"` makes the next revocation answer `{"ok": false, "error": "fatal_error"}`;
`"huge"`, a 200 of 96 KiB (past the broker's cap on provider answers) that revokes nothing.
Tokens carry the `CANARYTOKEN` mark for the I1 sweep.

`rotation = True` is an app with token rotation: the user's token (`xoxe.xoxp-…`) expires in 12
hours and comes with a refresh token (`xoxe-1-…`). A refresh (`grant_type=refresh_token` at
oauth.v2.access) spends the refresh token and answers the new pair at the top level, with
`token_type` "user", as Slack documents; this fake also puts an `authed_user` holding only the
user's id beside it, which a client must not take for the holder of the tokens.
`bot_only = True` answers the next code exchange as an install that granted no user scope: the
workspace's bot token (`xoxb-…`, `token_type` "bot") at the top level, the user's id alone under
`authed_user`.

Served by the standard library's threading HTTP server on 127.0.0.1:0, in daemon threads.
"""

from __future__ import annotations

import json
import secrets
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Literal
from urllib.parse import parse_qsl, urlencode, urlsplit

from .local_http import LocalServer, QuietHandler

TEAM = {"id": "T0CANARY", "name": "Acme Workspace"}
ROTATED_TOKEN_SECONDS = 43200  # 12 hours


@dataclass
class FakeSlack:
    redirect_uri: str
    client_id: str = "slack-client-id"
    client_secret: str = "slack-client-secret"
    url: str = ""
    revoke_fault: Literal["not_ok", "huge"] | None = None
    rotation: bool = False
    bot_only: bool = False
    authorize_requests: list[dict[str, str]] = field(default_factory=list)
    issued_user_tokens: list[str] = field(default_factory=list)
    revocations: list[str] = field(default_factory=list)
    issued_refresh_tokens: list[str] = field(default_factory=list)
    refresh_requests: list[dict[str, str]] = field(default_factory=list)
    _refresh_scopes: dict[str, str] = field(default_factory=dict)  # live refresh token -> scopes
    _codes: dict[str, str] = field(default_factory=dict)  # code -> granted user scopes
    _live: set[str] = field(default_factory=set)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def authorize_url(self) -> str:
        return f"{self.url}/oauth/v2/authorize"

    @property
    def token_url(self) -> str:
        return f"{self.url}/api/oauth.v2.access"

    @property
    def revocation_url(self) -> str:
        return f"{self.url}/api/auth.revoke"

    def works(self, token: str) -> bool:
        """What `auth.test` would say of the token."""
        with self._lock:
            return token in self._live

    def kill(self, token: str) -> None:
        """The token stops working, as when the user removes the app in Slack."""
        with self._lock:
            self._live.discard(token)

    def reset(self) -> None:
        """Back to a plain app with no fault set (the fake serves the whole session)."""
        with self._lock:
            self.rotation = self.bot_only = False
            self.revoke_fault = None

    def remove_app(self) -> None:
        """Every token and refresh token stops working: the user removed the app in Slack."""
        with self._lock:
            self._live.clear()
            self._refresh_scopes.clear()

    def authorize(self, query: dict[str, str]) -> tuple[int, dict[str, str]]:
        self.authorize_requests.append(query)
        if query.get("client_id") != self.client_id or query.get("redirect_uri") != (
            self.redirect_uri
        ):
            return 400, {}
        code = f"CANARYCODE{secrets.token_hex(8)}"
        with self._lock:
            self._codes[code] = query.get("user_scope", "")
        return 302, {
            "Location": f"{self.redirect_uri}?{urlencode({'code': code, **_state(query)})}"
        }

    def access(self, form: dict[str, str]) -> dict[str, Any]:
        if (form.get("client_id"), form.get("client_secret")) != (
            self.client_id,
            self.client_secret,
        ):
            return {"ok": False, "error": "invalid_client_id"}
        if form.get("grant_type") == "refresh_token":
            return self._refresh(form)
        with self._lock:
            scopes = self._codes.pop(form.get("code", ""), None)
            if scopes is None:
                return {"ok": False, "error": "invalid_code"}
            if self.bot_only:
                self.bot_only = False
                return self._bot_install()
            tokens = self._issue(scopes)
        return {
            "ok": True,
            "app_id": "A0CANARY",
            "authed_user": {"id": "U0CANARY", **tokens},
            "team": TEAM,
            "enterprise": None,
            "is_enterprise_install": False,
        }

    def _refresh(self, form: dict[str, str]) -> dict[str, Any]:
        with self._lock:
            self.refresh_requests.append(form)
            scopes = self._refresh_scopes.pop(form.get("refresh_token", ""), None)
            if scopes is None:
                return {"ok": False, "error": "invalid_refresh_token"}
            tokens = self._issue(scopes)
        return {
            "ok": True,
            "app_id": "A0CANARY",
            **tokens,
            "authed_user": {"id": "U0CANARY"},
            "team": TEAM,
            "enterprise": None,
            "is_enterprise_install": False,
        }

    def _bot_install(self) -> dict[str, Any]:
        bot_token = f"xoxb-CANARYTOKEN{secrets.token_hex(8)}"
        self._live.add(bot_token)
        return {
            "ok": True,
            "app_id": "A0CANARY",
            "access_token": bot_token,
            "token_type": "bot",
            "scope": "chat:write",
            "bot_user_id": "U0BOT",
            "authed_user": {"id": "U0CANARY"},
            "team": TEAM,
            "enterprise": None,
            "is_enterprise_install": False,
        }

    def _issue(self, scopes: str) -> dict[str, Any]:
        """A new user token (with a refresh token under rotation); the caller holds the lock."""
        prefix = "xoxe.xoxp-" if self.rotation else "xoxp-"
        token = f"{prefix}CANARYTOKEN{secrets.token_hex(8)}"
        self._live.add(token)
        self.issued_user_tokens.append(token)
        tokens: dict[str, Any] = {"scope": scopes, "access_token": token, "token_type": "user"}
        if self.rotation:
            refresh_token = f"xoxe-1-CANARYTOKEN{secrets.token_hex(8)}"
            self._refresh_scopes[refresh_token] = scopes
            self.issued_refresh_tokens.append(refresh_token)
            tokens.update(refresh_token=refresh_token, expires_in=ROTATED_TOKEN_SECONDS)
        return tokens

    def revoke(self, form: dict[str, str]) -> dict[str, Any]:
        token = form.get("token", "")
        with self._lock:
            self.revocations.append(token)
            fault, self.revoke_fault = self.revoke_fault, None
            if fault == "not_ok":
                return {"ok": False, "error": "fatal_error"}
            if fault == "huge":
                return {"ok": True, "revoked": True, "padding": "x" * 96 * 1024}
            if token not in self._live:
                return {"ok": False, "error": "invalid_auth"}
            self._live.discard(token)
        return {"ok": True, "revoked": True}


def _state(query: dict[str, str]) -> dict[str, str]:
    return {"state": query["state"]} if "state" in query else {}


@contextmanager
def running_fake_slack(redirect_uri: str) -> Iterator[FakeSlack]:
    fake = FakeSlack(redirect_uri=redirect_uri)

    class Handler(QuietHandler):
        def do_GET(self) -> None:
            parts = urlsplit(self.path)
            if parts.path != "/oauth/v2/authorize":
                self._json(404, {"ok": False, "error": "unknown_method"})
                return
            status, headers = fake.authorize(dict(parse_qsl(parts.query)))
            self.answer(status, headers=headers)

        def do_POST(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            form = dict(parse_qsl(self.rfile.read(length).decode()))
            path = urlsplit(self.path).path
            if path == "/api/oauth.v2.access":
                self._json(200, fake.access(form))
            elif path == "/api/auth.revoke":
                self._json(200, fake.revoke(form))
            else:
                self._json(404, {"ok": False, "error": "unknown_method"})

        def _json(self, status: int, body: dict[str, Any]) -> None:
            raw = json.dumps(body).encode()
            self.answer(status, raw, content_type="application/json; charset=utf-8")

    with LocalServer(Handler, name="fake-slack") as server:
        fake.url = server.url
        yield fake
