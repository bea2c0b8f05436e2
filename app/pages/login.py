"""The broker's own OIDC login at the MCP identity provider (code + PKCE S256 + nonce).

GET /login stores (state, nonce, PKCE verifier, return path) sealed in a short-lived `__Host-`
pre-login cookie: the callback only proceeds when its `state` matches that cookie, so a login
response cannot be planted in another browser (login CSRF, SECURITY.md T4/D9). The ID token is
verified with joserfc (issuer, audience = our login client, expiry, nonce); the identity is
(issuer, configured identity claim), exactly as for MCP access tokens.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
from datetime import UTC, datetime, timedelta
from typing import Any

import httpx2
from authlib.integrations.httpx_client import AsyncOAuth2Client, OAuthError
from fastapi import APIRouter, Request
from joserfc import jws, jwt
from joserfc.errors import JoseError
from joserfc.jwt import JWTClaimsRegistry
from starlette.responses import RedirectResponse, Response

from app.auth.browser import LOGIN_COOKIE, SESSION_COOKIE, same_origin_post, set_cookie
from app.auth.jwks import JwksCache, JwksUnavailable
from app.auth.principal import Principal
from app.clock import utcnow
from app.config import Settings
from app.crypto import InvalidSeal, Keys, constant_time_equal, random_token, seal, unseal
from app.deps import (
    BrowserSessionsDep,
    BrowserUserDep,
    IdentityIssuerDep,
    KeysDep,
    SessionDep,
    SettingsDep,
)
from app.display import display_text
from app.errors import BadLogin, CsrfFailed, ServiceUnavailable
from app.storable import unstorable_subject_reason
from app.templating import html_security_headers, render

logger = logging.getLogger("broker.security")
router = APIRouter(include_in_schema=False)

LOGIN_TTL_SECONDS = 600
TOKEN_DEADLINE_SECONDS = 10
SAFE_NEXT = re.compile(r"/(connect/[A-Za-z0-9_-]{43}|connections)")
MAX_PARAM_LENGTH = 2048


class UnusableIdentity(BadLogin):
    """The IdP vouched for an identity the broker cannot keep (too long, or text the database
    refuses): nothing the visitor can retry, so the next step is their administrator."""

    message = (
        "Your identity provider named your account in a way the broker cannot store (too long, "
        "or holding characters it cannot keep), so you are not signed in."
    )
    next_step = "Signing in again gives the same result: tell your administrator this reference."


def safe_next(value: str | None) -> str:
    """Only server-known local paths are accepted as a return target (open redirects, T11).

    `fullmatch`, not `match` with `$`: `$` also matches before a trailing newline.
    """
    return value if value and SAFE_NEXT.fullmatch(value) else "/connections"


@router.get("/login", name="login:start")
async def login(
    request: Request, settings: SettingsDep, issuer: IdentityIssuerDep, keys: KeysDep
) -> Response:
    metadata = await _metadata(issuer)
    state, nonce, verifier = random_token(), random_token(), random_token() + random_token()
    async with _client(settings) as client:
        # max_age makes the IdP re-authenticate a stale IdP session and report auth_time, so a
        # "sign in again" after login_max_age_seconds cannot be satisfied by silent SSO (D12).
        url, _ = client.create_authorization_url(
            str(metadata["authorization_endpoint"]),
            state=state,
            nonce=nonce,
            code_verifier=verifier,
            max_age=settings.server.login_max_age_seconds,
        )
    record = {
        "s": state,
        "n": nonce,
        "v": verifier,
        "next": safe_next(request.query_params.get("next")),
    }
    response = _see_other(url)
    set_cookie(
        response,
        LOGIN_COOKIE,
        seal(json.dumps(record).encode(), purpose="login:v1", keys=keys.sealing),
        max_age=LOGIN_TTL_SECONDS,
    )
    return response


@router.get("/login/callback", name="login:callback")
async def login_callback(
    request: Request,
    session: SessionDep,
    settings: SettingsDep,
    issuer: IdentityIssuerDep,
    keys: KeysDep,
    sessions: BrowserSessionsDep,
) -> Response:
    params = request.query_params
    record = _login_record(request, keys)
    state = params.get("state", "")
    if (
        record is None
        or len(state) > MAX_PARAM_LENGTH
        or not constant_time_equal(state, str(record.get("s", "")))
    ):
        logger.warning("login.state_invalid")
        raise BadLogin()
    if "error" in params:
        raise BadLogin(
            "Sign-in was cancelled or refused by the identity provider.",
            next_step="Open the link from your MCP client again to retry.",
        )
    code = params.get("code", "")
    if not code or len(code) > MAX_PARAM_LENGTH:
        raise BadLogin()
    claims = await _exchange(settings, issuer, code=code, verifier=str(record["v"]))
    _check_id_token(settings, claims, nonce=str(record["n"]))
    identity_claim = settings.identity.identity_claim
    response = _see_other(str(record["next"]))
    response.delete_cookie(LOGIN_COOKIE, path="/", secure=True, httponly=True, samesite="lax")
    await sessions.start(
        session,
        response,
        principal=Principal(settings.identity.issuer, str(claims[identity_claim])),
        display_name=_display_name(claims),
        auth_time=login_auth_time(claims, settings.server.login_max_age_seconds),
        previous_id=request.cookies.get(SESSION_COOKIE),
    )
    return response


@router.post("/logout", name="login:logout")
async def logout(
    request: Request,
    session: SessionDep,
    settings: SettingsDep,
    sessions: BrowserSessionsDep,
    user: BrowserUserDep,
) -> Response:
    if not same_origin_post(request, settings.public_origin):
        raise CsrfFailed()
    if user is not None:
        form = await request.form(max_files=0, max_fields=4)
        if not sessions.csrf_valid(user, str(form.get("csrf") or "")):
            raise CsrfFailed()
    response = render(request, "login/signed_out.html")
    await sessions.end(session, request, response)
    return response


def _see_other(target: str) -> Response:
    """303 with the page headers: neither the IdP URL this sends the browser to (state, nonce)
    nor the callback URL it answers (code, state) is cached or sent on as a Referer."""
    return RedirectResponse(target, status_code=303, headers=html_security_headers())


def _login_record(request: Request, keys: Keys) -> dict[str, Any] | None:
    cookie = request.cookies.get(LOGIN_COOKIE)
    if not cookie or len(cookie) > 4096:
        return None
    try:
        record = json.loads(unseal(cookie, purpose="login:v1", keys=keys.sealing))
    except (InvalidSeal, ValueError):
        return None
    return record if isinstance(record, dict) else None


def _client(settings: Settings) -> AsyncOAuth2Client:
    identity = settings.identity
    return AsyncOAuth2Client(
        client_id=identity.login_client_id,
        client_secret=identity.login_client_secret.get_secret_value() or None,
        scope="openid profile",
        redirect_uri=f"{settings.public_url}/login/callback",
        code_challenge_method="S256",
        token_endpoint_auth_method=(
            "client_secret_basic" if identity.login_client_secret.get_secret_value() else "none"
        ),
        timeout=TOKEN_DEADLINE_SECONDS,
        follow_redirects=False,
        trust_env=False,
    )


async def _metadata(issuer: JwksCache) -> dict[str, object]:
    try:
        metadata: dict[str, object] = await issuer.metadata()
    except JwksUnavailable:
        raise ServiceUnavailable() from None
    return metadata


async def _exchange(
    settings: Settings, issuer: JwksCache, *, code: str, verifier: str
) -> dict[str, Any]:
    metadata = await _metadata(issuer)
    try:
        async with asyncio.timeout(TOKEN_DEADLINE_SECONDS), _client(settings) as client:
            token = await client.fetch_token(
                str(metadata["token_endpoint"]), code=code, code_verifier=verifier
            )
        id_token = token.get("id_token")
        if not isinstance(id_token, str):
            raise BadLogin()
        kid = jws.extract_compact(id_token.encode()).protected.get("kid")
        keys = await issuer.keys_for(kid if isinstance(kid, str) else None)
        decoded = jwt.decode(id_token, keys, algorithms=list(settings.identity.algorithms))
    except (OAuthError, httpx2.HTTPError, TimeoutError) as exc:
        _log_refused_client(exc)
        logger.warning("login.token_exchange_failed error=%s", type(exc).__name__)
        raise BadLogin() from None
    except (JoseError, ValueError, JwksUnavailable) as exc:
        logger.warning("login.id_token_invalid error=%s", type(exc).__name__)
        raise BadLogin() from None
    return dict(decoded.claims)


REFUSED_CLIENT_ERRORS = ("invalid_client", "unauthorized_client")


def _log_refused_client(exc: Exception) -> None:
    """Say so when the IdP refused the broker's own client credentials: the visitor only sees
    "could not sign you in", and the fix is in the configuration (or at the IdP)."""
    if isinstance(exc, OAuthError) and exc.error in REFUSED_CLIENT_ERRORS:
        code = str(exc.error)
    elif isinstance(exc, httpx2.HTTPStatusError) and exc.response.status_code == 401:
        code = "HTTP 401"
    else:
        return
    logger.warning(
        "login.client_refused idp_error=%s: the IdP refused the broker's login client; check "
        "identity.login_client_id and identity.login_client_secret against the client "
        "registered at the IdP (its secret, and its token endpoint auth method)",
        code,
    )


def _check_id_token(settings: Settings, claims: dict[str, Any], *, nonce: str) -> None:
    identity = settings.identity
    registry = JWTClaimsRegistry(
        leeway=60,
        iss={"essential": True, "value": identity.issuer},
        aud={"essential": True, "value": identity.login_client_id},
        exp={"essential": True},
        nonce={"essential": True, "value": nonce},
    )
    try:
        registry.validate(claims)
    except JoseError as exc:
        logger.warning("login.id_token_invalid error=%s", type(exc).__name__)
        raise BadLogin() from None
    subject = claims.get(identity.identity_claim)
    if not isinstance(subject, str) or not subject:
        logger.warning("login.identity_claim_missing claim=%s", identity.identity_claim)
        raise BadLogin()
    reason = unstorable_subject_reason(subject)
    if reason:  # as for an access token (app/auth/bearer.py): never stored, never a principal
        logger.warning(
            "login.identity_claim_unstorable claim=%s: it holds %s",
            identity.identity_claim,
            reason,
        )
        raise UnusableIdentity()


def _display_name(claims: dict[str, Any]) -> str | None:
    for key in ("preferred_username", "name", "sub"):
        value = claims.get(key)
        if isinstance(value, str) and value:
            return display_text(value)
    return None


def login_auth_time(claims: dict[str, Any], max_age_seconds: int) -> datetime:
    """When the user authenticated at the IdP (`auth_time`; now when the IdP does not say).

    Raises:
        BadLogin: the IdP answered the request for a fresh authentication (`max_age`) with one
            older than that: the session would not count, and sending the browser to sign in
            again would only loop between the broker and the IdP.
    """
    value = claims.get("auth_time")
    now = utcnow()
    if not isinstance(value, int | float) or isinstance(value, bool):
        return now
    try:
        authenticated = min(datetime.fromtimestamp(value, tz=UTC), now)
    except (OverflowError, OSError, ValueError):  # no time at all: a malformed ID token
        logger.warning("login.auth_time_invalid")
        raise BadLogin() from None
    age = now - authenticated
    if age >= timedelta(seconds=max_age_seconds):
        logger.warning("login.stale_auth_time age_seconds=%d", int(age.total_seconds()))
        raise BadLogin(
            "Your identity provider signed you in with an earlier sign-in, older than this "
            "service accepts, instead of asking you to sign in again.",
            next_step="Sign out at your identity provider, then open the link from your MCP "
            "client again.",
        )
    return authenticated
