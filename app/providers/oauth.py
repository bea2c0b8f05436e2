"""Talking to third-party OAuth 2.0 / OpenID providers: authorize URL, code exchange, refresh,
account label and identity, revocation.

Every call keeps the rules of app/providers/upstream.py (a total deadline, no redirect, at most
64 KiB read, bodies never logged), sends `Accept: application/json` (GitHub answers form-encoded
otherwise) and treats any body carrying `error` as a failure whatever the status (GitHub reports
errors in a 200, F5). A code exchange is never retried: the code may be spent.
"""

from __future__ import annotations

import base64
import hashlib
import logging
import re
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any
from urllib.parse import urlencode

import httpx2

from app.crypto import b64encode
from app.display import display_text
from app.providers.settings import OAuthProviderSettings, is_scope_token
from app.providers.upstream import UpstreamError as UpstreamError  # callers catch it as oauth.*
from app.providers.upstream import get_api_json as get_api_json
from app.providers.upstream import get_json, parse_body, send_capped

logger = logging.getLogger("broker.providers")

# The code or refresh token itself refused: RFC 6749's name, GitHub's and Slack's.
INVALID_GRANT_ERRORS = {
    "invalid_grant",
    "bad_refresh_token",
    "bad_verification_code",
    "invalid_code",
    "code_already_used",
    "invalid_refresh_token",
}


# What names an OpenID provider's account without `account_label_claim`, best first
ID_TOKEN_LABEL_CLAIMS = ("preferred_username", "email", "sub")
# An account's identity at a provider, as stored: numbers, GUIDs, `sub`s, Atlassian's ids
ACCOUNT_ID = re.compile(r"[A-Za-z0-9._:@|+=/-]{1,255}")

# A revocation answered with these finds the token already dead: what revoking it was for.
TOKEN_GONE_ERRORS = {"invalid_auth", "token_revoked", "token_expired", "account_inactive"}

# A provider's error code as the broker keeps it: RFC 6749 §5.2's codes and the providers' own
# are short ASCII words. Anything else is kept as UNRECOGNISED_ERROR.
ERROR_CODE = re.compile(r"[A-Za-z0-9_.-]{1,40}")
UNRECOGNISED_ERROR = "unrecognised"
# The longest `expires_in` read as a lifetime (seconds, about three years)
MAX_EXPIRES_IN = 10**8


class InvalidGrant(UpstreamError):
    """The provider refused the code or refresh token itself (re-authorisation needed)."""


def error_code(value: object) -> str:
    """A provider's `error` as the broker may log, store and show it (in a failure reason, an
    audit detail, a webhook body): one word of `ERROR_CODE`, else `unrecognised`.

    The value is provider text: a line break in it would forge a log line, a NUL makes
    PostgreSQL refuse the row that records the failure, and prose has no place in codes.
    """
    if isinstance(value, str) and ERROR_CODE.fullmatch(value):
        return value
    return UNRECOGNISED_ERROR


@dataclass(frozen=True)
class TokenSet:
    access_token: str
    refresh_token: str | None
    expires_at: datetime | None
    scopes: frozenset[str]
    extra: dict[str, Any]  # non-secret fields of the response (e.g. a workspace name)
    id_token: str | None = None

    def secret(self) -> dict[str, str]:
        values = {"access_token": self.access_token}
        if self.refresh_token:
            values["refresh_token"] = self.refresh_token
        return values


def nonce_for(state: str) -> str:
    """The OIDC nonce is derived from the (secret, single-use) state; nothing more to store."""
    return hashlib.sha256(f"nonce:{state}".encode()).hexdigest()


def authorize_url(
    provider: OAuthProviderSettings,
    *,
    endpoint: str,
    redirect_uri: str,
    state: str,
    verifier: str,
    scopes: tuple[str, ...],
) -> str:
    params: dict[str, str] = {
        "response_type": "code",
        "client_id": provider.client_id,
        "redirect_uri": redirect_uri,
        "state": state,
        **provider.authorize_params,
    }
    if scopes:
        params[provider.scope_parameter] = provider.scope_separator.join(scopes)
    if provider.pkce:
        params["code_challenge"] = b64encode(hashlib.sha256(verifier.encode()).digest())
        params["code_challenge_method"] = "S256"
    if provider.kind == "oidc":
        params["nonce"] = nonce_for(state)
    separator = "&" if "?" in endpoint else "?"
    return f"{endpoint}{separator}{urlencode(params)}"


async def exchange_code(
    provider: OAuthProviderSettings,
    http: httpx2.AsyncClient,
    *,
    token_url: str,
    code: str,
    redirect_uri: str,
    verifier: str,
    requested: tuple[str, ...],
) -> TokenSet:
    """Trade an authorization code for tokens (once; never retried).

    Raises:
        UpstreamError: any provider failure; InvalidGrant when the code was refused.
    """
    data = {"grant_type": "authorization_code", "code": code, "redirect_uri": redirect_uri}
    if provider.pkce:
        data["code_verifier"] = verifier
    body = await _token_request(provider, http, token_url, data)
    return _token_set(body, requested, provider)


async def refresh(
    provider: OAuthProviderSettings,
    http: httpx2.AsyncClient,
    *,
    token_url: str,
    refresh_token: str,
    current_scopes: frozenset[str],
) -> TokenSet:
    """Use a refresh token. A provider that rotates it returns a new one: persist it first.

    Raises:
        InvalidGrant: the refresh token is dead (the user must connect again).
        UpstreamError: any other failure.
    """
    data = {"grant_type": "refresh_token", "refresh_token": refresh_token}
    body = await _token_request(provider, http, token_url, data)
    return _token_set(body, tuple(sorted(current_scopes)), provider)


@dataclass(frozen=True)
class AccountIdentity:
    """Who the account is at the provider: its name for the user and its identity there."""

    label: str | None  # "@octocat"; None when it cannot be read (F9)
    account_id: str  # GitHub's numeric user id, an ID token's `sub`; "" when not known


def _account_id(provider: OAuthProviderSettings, value: Any) -> str:
    """The provider's account id, checked at the edge: a string or integer of 1-255 characters
    from `ACCOUNT_ID`; anything else is logged and counts as not known ("")."""
    if isinstance(value, bool) or not isinstance(value, str | int):
        return ""
    text = str(value)
    if ACCOUNT_ID.fullmatch(text) is None:
        logger.warning("oauth.account_id_invalid provider=%s", provider.display_name)
        return ""
    return text


def _member(document: Any, path: str) -> Any:
    for part in path.split("."):
        document = document.get(part) if isinstance(document, dict) else None
    return document


async def account_identity(
    provider: OAuthProviderSettings,
    http: httpx2.AsyncClient,
    tokens: TokenSet,
    id_claims: dict[str, Any] | None = None,
) -> AccountIdentity:
    """How the account is named to the user ("@octocat"; None if it cannot be read, F9: the
    connection is kept, the page shows no name) and its identity at the provider (which decides
    whether a grant replaces a connection or adds one). Without `account_label_claim`, an OpenID
    provider's account is named by its verified ID token (`id_claims`); its identity is the ID
    token's `sub` unless `account_id_claim` names a member of the same document as the label."""
    claims = id_claims or {}
    id_from_token = _account_id(provider, claims.get("sub")) if claims else ""
    claim = provider.account_label_claim
    if claim is None:
        document: Any = claims
    else:
        document = tokens.extra
        if provider.userinfo_url:
            try:
                document = await get_json(
                    provider, http, provider.userinfo_url, tokens.access_token
                )
            except UpstreamError as exc:
                logger.warning(
                    "oauth.account_label_failed provider=%s reason=%s",
                    provider.display_name,
                    exc.reason,
                )
                return AccountIdentity(None, id_from_token)
    label = (
        _id_token_label(provider, claims) if claim is None else _label(provider, document, claim)
    )
    id_claim = provider.account_id_claim
    account_id = _account_id(provider, _member(document, id_claim)) if id_claim else ""
    return AccountIdentity(label, account_id or id_from_token)


def _id_token_label(provider: OAuthProviderSettings, claims: dict[str, Any]) -> str | None:
    for name in ID_TOKEN_LABEL_CLAIMS:
        value = claims.get(name)
        if isinstance(value, str) and value:
            return display_text(f"{provider.account_label_prefix}{value}")
    return None


def _label(provider: OAuthProviderSettings, document: Any, claim: str) -> str | None:
    value = _member(document, claim)
    if not isinstance(value, str | int) or isinstance(value, bool):
        return None
    return display_text(f"{provider.account_label_prefix}{value}")


async def revoke(
    provider: OAuthProviderSettings,
    http: httpx2.AsyncClient,
    secret: dict[str, str],
    *,
    whole_grant: bool = True,
) -> None:
    """Revoke the grant upstream where the provider supports it; with `whole_grant` False,
    only this token where the provider tells the two apart (GitHub: the grant's revocation ends
    every token of the OAuth app for that account; RFC 7009 revokes the token sent).

    Raises:
        UpstreamError: the provider did not confirm the revocation.
    """
    if provider.revocation == "none" or not provider.revokes:
        return
    if provider.revocation == "github":
        base = provider.api_base_url or "https://api.github.com"
        what = "grant" if whole_grant else "token"
        request = http.build_request(
            "DELETE",
            f"{base}/applications/{provider.client_id}/{what}",
            json={"access_token": secret["access_token"]},
            headers={"Accept": "application/vnd.github+json", **_basic_credentials(provider)},
        )
    else:
        assert provider.revocation_url is not None
        token = secret.get("refresh_token") or secret["access_token"]
        request = http.build_request(
            "POST",
            provider.revocation_url,
            data={"token": token, **_client_form(provider)},
            headers=_basic_header(provider),
        )
    try:
        status, content_type, raw = await send_capped(provider, http, request)
    except UpstreamError as exc:
        unreachable = exc.timed_out or exc.reason.startswith("network:")
        reason = "revocation_unreachable" if unreachable else f"revocation_{exc.reason}"
        raise UpstreamError(reason, timed_out=exc.timed_out) from None
    if status not in (200, 204, 404):
        raise UpstreamError(f"revocation_status_{status}")
    refusal = _refusal_in_body(content_type, raw)
    if refusal is not None and refusal not in TOKEN_GONE_ERRORS:  # Slack: errors come in a 200
        raise UpstreamError(f"revocation_error:{refusal}")


def _refusal_in_body(content_type: str, raw: bytes) -> str | None:
    """The error code a JSON body reports (`{"ok": false, "error": …}`, `{"error": …}`), if
    any, through `error_code`."""
    if "json" not in content_type or not raw:
        return None
    try:
        body = parse_body(content_type, raw)
    except UpstreamError:  # not an error report: the status already said yes
        return None
    error = body.get("error")
    if error:
        return error_code(error)
    return "not_ok" if body.get("ok", True) is False else None


def _client_form(provider: OAuthProviderSettings) -> dict[str, str]:
    if provider.client_auth_method == "client_secret_basic":
        return {}
    values = {"client_id": provider.client_id}
    if provider.client_secret.get_secret_value():
        values["client_secret"] = provider.client_secret.get_secret_value()
    return values


def _basic_header(provider: OAuthProviderSettings) -> dict[str, str]:
    if provider.client_auth_method != "client_secret_basic":
        return {}
    return _basic_credentials(provider)


def _basic_credentials(provider: OAuthProviderSettings) -> dict[str, str]:
    pair = f"{provider.client_id}:{provider.client_secret.get_secret_value()}"
    return {"Authorization": "Basic " + base64.b64encode(pair.encode()).decode("ascii")}


async def _token_request(
    provider: OAuthProviderSettings,
    http: httpx2.AsyncClient,
    token_url: str,
    data: dict[str, str],
) -> dict[str, Any]:
    request = http.build_request(
        "POST",
        token_url,
        data={**data, **_client_form(provider)},
        headers={"Accept": "application/json"},
    )
    request.headers.update(_basic_header(provider))
    status, content_type, raw = await send_capped(provider, http, request)
    try:
        body = parse_body(content_type, raw)
    except UpstreamError:
        if not 200 <= status < 300:  # an error page: the status is the useful reason (F1)
            raise UpstreamError(f"token_status_{status}") from None
        raise
    error = body.get("error")
    if error:
        code = error_code(error)
        kind = InvalidGrant if code in INVALID_GRANT_ERRORS else UpstreamError
        raise kind(f"provider_error:{code}")
    if not 200 <= status < 300:
        raise UpstreamError(f"token_status_{status}")
    return body


def _expires_at(provider: OAuthProviderSettings, expires_in: Any) -> datetime | None:
    """When the access token stops working: `expires_in` seconds from now, for a whole number
    from 1 to MAX_EXPIRES_IN, as a JSON integer or a string of ASCII digits (some providers
    quote it). Anything else (zero, negative, fractional, other digits, a number so large the
    date would overflow) counts as no expiry, as when a provider sends none, and is logged: the
    token itself was granted, and a lifetime the broker cannot use is no reason to refuse it."""
    if expires_in is None:
        return None
    seconds = expires_in
    if isinstance(seconds, str) and seconds.isascii() and seconds.isdigit() and len(seconds) < 10:
        seconds = int(seconds)
    if isinstance(seconds, bool) or not isinstance(seconds, int):
        seconds = 0
    if not 0 < seconds <= MAX_EXPIRES_IN:
        logger.warning("oauth.expires_in_unusable provider=%s", provider.display_name)
        return None
    return datetime.now(UTC) + timedelta(seconds=seconds)


def _sendable(token: str) -> bool:
    """A token that can go in an `Authorization: Bearer` header as it is: visible ASCII only
    (RFC 6750 §2.1's b64token is narrower still). Anything else would fail the first call that
    uses it, after the broker stored it."""
    return token.isascii() and token.isprintable() and " " not in token


def _token_set(
    body: dict[str, Any], requested: tuple[str, ...], provider: OAuthProviderSettings
) -> TokenSet:
    # The member holds the tokens when it has them (Slack's code exchange); a refresh answers
    # them at the top level, possibly beside a member that only names the user.
    member = body.get(provider.token_member) if provider.token_member else None
    fields: dict[str, Any] = (
        member if isinstance(member, dict) and "access_token" in member else body
    )
    access_token = fields.get("access_token")
    if not isinstance(access_token, str) or not access_token:
        raise UpstreamError("missing_access_token")
    if not _sendable(access_token):
        raise UpstreamError("malformed_access_token")
    token_type = fields.get("token_type", "bearer")
    if not isinstance(token_type, str) or token_type.lower() not in provider.token_types:
        raise UpstreamError("unsupported_token_type")
    refresh_token = fields.get("refresh_token")
    expires_at = _expires_at(provider, fields.get("expires_in"))
    granted = fields.get("scope")
    if isinstance(granted, str):
        scopes = frozenset(s for s in granted.replace(",", " ").split() if is_scope_token(s))
    else:
        scopes = frozenset(requested)
    extra = {
        k: v
        for k, v in body.items()
        if k not in ("access_token", "refresh_token", "id_token", provider.token_member)
        and not isinstance(v, list)
    }
    return TokenSet(
        access_token=access_token,
        refresh_token=refresh_token if isinstance(refresh_token, str) and refresh_token else None,
        expires_at=expires_at,
        scopes=scopes,
        extra=extra,
        id_token=body["id_token"] if isinstance(body.get("id_token"), str) else None,
    )
