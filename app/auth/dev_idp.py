"""DEVELOPMENT identity provider for `connect-broker dev` only: any user name logs in.

Mounted under /dev-idp by the `dev` command and by nothing else; no configuration key can enable
it, so `serve` never exposes it. It is a minimal OpenID provider (discovery, JWKS, authorization
code with PKCE S256 and nonce, token endpoint) so the broker exercises the very same login and
token-verification code it uses against a real IdP. Codes live in memory (one process).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import os
import secrets
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

from fastapi import APIRouter, Request
from joserfc import jwt
from joserfc.jwk import RSAKey
from starlette.datastructures import FormData
from starlette.exceptions import HTTPException
from starlette.responses import JSONResponse, RedirectResponse, Response

from app.crypto import b64encode, constant_time_equal
from app.errors import BrokerError
from app.templating import html_security_headers, render

TOKEN_LIFETIME = 12 * 3600
CODE_LIFETIME = 120


class DevIdpError(BrokerError):
    title = "Development sign-in failed"
    next_step = "Open the connect link again."


@dataclass(frozen=True)
class _Grant:
    user: str
    nonce: str
    challenge: str
    redirect_uri: str
    expires: float


class DevIdentityProvider:
    def __init__(
        self, *, issuer: str, audience: str, key_path: Path, client_id: str, client_secret: str
    ) -> None:
        self.issuer = issuer
        self.audience = audience
        self.client_id = client_id  # the broker's own login client
        self.client_secret = client_secret
        self.key = _load_or_create_key(key_path)
        self._codes: dict[str, _Grant] = {}

    def mint(
        self,
        user: str,
        *,
        audience: str | None = None,
        nonce: str | None = None,
        client_id: str = "dev-mcp-client",
        lifetime: int = TOKEN_LIFETIME,
    ) -> str:
        now = int(time.time())
        claims: dict[str, Any] = {
            "iss": self.issuer,
            "sub": user,
            "aud": audience or self.audience,
            "iat": now,
            "exp": now + lifetime,
            "client_id": client_id,
            "scope": "openid profile",
            "jti": secrets.token_hex(8),
        }
        header = {"alg": "RS256", "kid": self.key.kid, "typ": "at+jwt"}
        if nonce is not None:
            claims.update(nonce=nonce, name=user, preferred_username=user, auth_time=now)
            header["typ"] = "JWT"
        return jwt.encode(header, claims, self.key)

    def router(self) -> APIRouter:
        router = APIRouter(prefix="/dev-idp", include_in_schema=False)
        router.add_api_route("/.well-known/openid-configuration", self._discovery)
        router.add_api_route("/jwks", self._jwks)
        router.add_api_route("/authorize", self._authorize_form, methods=["GET"])
        router.add_api_route("/authorize", self._authorize, methods=["POST"])
        router.add_api_route("/token", self._token, methods=["POST"])
        return router

    async def _discovery(self) -> Response:
        return JSONResponse(
            {
                "issuer": self.issuer,
                "authorization_endpoint": f"{self.issuer}/authorize",
                "token_endpoint": f"{self.issuer}/token",
                "jwks_uri": f"{self.issuer}/jwks",
                "response_types_supported": ["code"],
                "subject_types_supported": ["public"],
                "id_token_signing_alg_values_supported": ["RS256"],
                "code_challenge_methods_supported": ["S256"],
            }
        )

    async def _jwks(self) -> Response:
        return JSONResponse({"keys": [self.key.as_dict(private=False)]})

    async def _authorize_form(self, request: Request) -> Response:
        params = dict(request.query_params)
        self._check_client(params)
        return render(request, "dev/login.html", params=params)

    async def _authorize(self, request: Request) -> Response:
        form = await request.form(max_files=0, max_fields=16)
        params = {key: str(value) for key, value in form.items()}
        self._check_client(params)
        user = params.get("username", "").strip()
        if not user or len(user) > 64 or not user.isprintable():
            raise DevIdpError("Enter a user name (1-64 printable characters).")
        code = secrets.token_urlsafe(32)
        self._codes[code] = _Grant(
            user,
            params.get("nonce", ""),
            params["code_challenge"],
            params["redirect_uri"],
            time.time() + CODE_LIFETIME,
        )
        query = urlencode({"code": code, "state": params.get("state", "")})
        # the code and state in Location: neither cached nor sent on as a Referer, as the
        # broker's own redirects carrying them
        return RedirectResponse(
            f"{params['redirect_uri']}?{query}", status_code=303, headers=html_security_headers()
        )

    async def _token(self, request: Request) -> Response:
        try:
            form = await request.form(max_files=0, max_fields=16)
        except HTTPException:  # a body Starlette cannot parse: an OAuth error, not a page
            return JSONResponse({"error": "invalid_request"}, status_code=400)
        grant = self._codes.pop(str(form.get("code", "")), None)
        if not self._client_authenticated(request, form):
            # RFC 6749 §5.2: 401, with the scheme a client may authenticate with
            return JSONResponse(
                {"error": "invalid_client"},
                status_code=401,
                headers={"WWW-Authenticate": 'Basic realm="dev-idp"'},
            )
        verifier = str(form.get("code_verifier", ""))
        challenge = b64encode(hashlib.sha256(verifier.encode()).digest())
        if (
            grant is None
            or grant.expires < time.time()
            or not constant_time_equal(challenge, grant.challenge)
            or form.get("redirect_uri") != grant.redirect_uri
        ):
            return JSONResponse({"error": "invalid_grant"}, status_code=400)
        return JSONResponse(
            {
                "access_token": self.mint(grant.user, audience=self.audience),
                "id_token": self.mint(grant.user, audience=self.client_id, nonce=grant.nonce),
                "token_type": "Bearer",
                "expires_in": TOKEN_LIFETIME,
            }
        )

    def _client_authenticated(self, request: Request, form: FormData) -> bool:
        """The broker's login client, by HTTP Basic or in the form; credentials that are not
        base64 of UTF-8 text authenticate nobody."""
        header = request.headers.get("authorization", "")
        if header.startswith("Basic "):
            try:
                decoded = base64.b64decode(header[6:], validate=True).decode()
            except (binascii.Error, UnicodeDecodeError):
                return False
            client_id, _, secret = decoded.partition(":")
        else:
            client_id, secret = str(form.get("client_id", "")), str(form.get("client_secret", ""))
        return client_id == self.client_id and constant_time_equal(secret, self.client_secret)

    def _check_client(self, params: dict[str, str]) -> None:
        if params.get("client_id") != self.client_id or not params.get(
            "redirect_uri", ""
        ).startswith(self.issuer.rsplit("/dev-idp", 1)[0] + "/"):
            raise DevIdpError("Unknown client or redirect URI.")
        if params.get("code_challenge_method") != "S256" or not params.get("code_challenge"):
            raise DevIdpError("PKCE with S256 is required.")


def _load_or_create_key(path: Path) -> RSAKey:
    if path.exists():
        return RSAKey.import_key(json.loads(path.read_text()))
    key = RSAKey.generate_key(
        2048, parameters={"kid": f"dev-{secrets.token_hex(4)}", "alg": "RS256", "use": "sig"}
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(descriptor, "w") as handle:
        json.dump(key.as_dict(private=True), handle)
    return key
