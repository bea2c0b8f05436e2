"""Connect Broker from a tool handler of an official-SDK (`mcp`) server.

    broker = ConnectBroker(BROKER_URL, BROKER_SERVICE_SECRET)
    broker.install(server)  # once: turns "connect first" into the call's result

    @server.tool()
    async def list_github_repos(ctx: Context) -> list[Repo]:
        token = await broker.require(ctx, "github", scopes=("repo",))

`require` answers the credential, or raises what makes the call answer for the broker: the
broker's `InputRequiredResult` (a URL-mode elicitation), JSON-RPC -32021 when the client declared
no `elicitation.url`, or an `isError` result when the user declined, cancelled or let the link
expire. The client's retry of the same call reaches the same `require`, which resumes the flow.

Who the user is comes from the access token the server's own TokenVerifier accepted for this
request (its `iss` and identity claim), never from tool arguments. By default that token never
leaves the process: the broker sees the service secret, the user's (issuer, subject) and a digest
of the call. With `user_proof=True` (for a service the broker configures with
`user_proof = "token"`) the token itself goes to the broker instead of the user's name, and the
broker takes the user from it: the secret alone then reads no one's credential.

The round trip and what the requestState holds: `connect_broker_client.rounds`.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any, cast
from urllib.parse import quote

import httpx2
from mcp.server.auth.middleware.auth_context import get_access_token
from mcp.server.context import ServerRequestContext
from mcp.server.mcpserver import Context, MCPServer
from mcp.server.mcpserver.exceptions import ToolError
from mcp.shared.exceptions import MCPError
from mcp_types import INVALID_PARAMS, MISSING_REQUIRED_CLIENT_CAPABILITY
from mcp_types.version import is_version_at_least

from connect_broker_client.errors import (
    ENDED_MESSAGES,
    BrokerRefused,
    BrokerUnavailable,
    ConnectionNotMade,
    Ended,
)
from connect_broker_client.rounds import ConnectionRequired, PendingRound, ResultMiddleware

logger = logging.getLogger("connect_broker_client")

MRTR_VERSION = "2026-07-28"  # the first revision with InputRequiredResult
TOKEN_EXCHANGE = {  # RFC 8693 §2.1; requested_token_type names the provider
    "grant_type": "urn:ietf:params:oauth:grant-type:token-exchange",
    "subject_token_type": "urn:ietf:params:oauth:token-type:access_token",
}
CREDENTIAL_TYPE = "urn:connect-broker:credential:"
SUBJECT_TOKEN_HEADER = "Subject-Token"  # noqa: S105 (the header listing and disconnecting read)


@dataclass(frozen=True)
class Credential:
    """A usable credential: an OAuth access token (refreshed by the broker) or an API key."""

    provider: str
    kind: str
    secret: str = field(repr=False)
    account: str | None = None
    scopes: tuple[str, ...] = ()
    expires_at: datetime | None = None  # when an OAuth access token stops working, if known


class ConnectBroker:
    """A registered sibling's client of the broker's integration API (`/api/v1`)."""

    def __init__(
        self,
        url: str,
        service_secret: str,
        *,
        identity_claim: str = "sub",
        user_proof: bool = False,
        timeout: float = 40.0,
        http: httpx2.AsyncClient | None = None,
    ) -> None:
        """`timeout` must exceed the broker's `retry_wait_seconds` (default 20): a resume waits.

        `identity_claim` must be the broker's `identity.identity_claim` (`oid` for Entra).
        `user_proof` must match the service's `user_proof = "token"` at the broker: the caller's
        access token is sent instead of naming the caller.
        """
        self._api = url.rstrip("/") + "/api/v1"
        self._headers = {"Authorization": f"Bearer {service_secret}"}
        self._http = http or httpx2.AsyncClient(timeout=timeout, follow_redirects=False)
        self._owns_http = http is None
        self.identity_claim = identity_claim
        self.user_proof = user_proof
        self.middleware = ResultMiddleware()

    def install(self, server: MCPServer[Any]) -> None:
        """Add the middleware that answers `ConnectionRequired` with the broker's elicitation."""
        if self.middleware not in server.middleware:
            server.middleware.append(self.middleware)
        self.middleware.server_info = {"name": server.name, "version": server.version}

    async def aclose(self) -> None:
        if self._owns_http:
            await self._http.aclose()

    async def require(
        self,
        ctx: Context[Any, Any],
        provider: str,
        *,
        scopes: Sequence[str] = (),
        new_account: bool = False,
    ) -> str:
        """The caller's API key or access token for `provider`; see `require_credential`."""
        return (
            await self.require_credential(ctx, provider, scopes=scopes, new_account=new_account)
        ).secret

    async def require_credential(
        self,
        ctx: Context[Any, Any],
        provider: str,
        *,
        scopes: Sequence[str] = (),
        new_account: bool = False,
    ) -> Credential:
        """The caller's credential, or raise what makes this call ask the user to connect.

        `new_account=True` asks the user to connect even when they hold an account of the
        provider: another upstream account is added, the same one replaced; the retry returns
        the account just connected.

        Raises:
            ConnectionRequired: the call answers the broker's URL-mode elicitation.
            MCPError: -32021 when the client declared no `elicitation.url`; -32602 when the
                broker refuses the echoed state.
            ConnectionNotMade: declined, cancelled, expired or failed (an `isError` result).
            BrokerUnavailable: the broker is unreachable or failing.
            BrokerRefused: the broker refused this service (secret, provider or issuer).
        """
        if self.middleware not in ctx.mcp_server.middleware:
            raise RuntimeError("ConnectBroker.install(server) was not called for this server")
        modern = is_version_at_least(ctx.protocol_version or "", MRTR_VERSION)
        body = self._request(ctx, scopes, modern=modern)
        pending = PendingRound.load(ctx.request_state, provider)
        if pending is None:
            if new_account:
                body["account"] = "new"
            outcome = await self._call(
                "POST", f"/connections/{quote(provider, safe='')}/require", body
            )
        else:
            body["request_state"] = pending.state
            body["input_response"] = _input_response(ctx, pending.keys)
            outcome = await self._call(
                "POST", f"/connections/{quote(provider, safe='')}/resume", body
            )
        return _settle(provider, outcome, modern=modern)

    async def credential(
        self, ctx: Context[Any, Any], provider: str, *, account: str | None = None
    ) -> Credential | None:
        """The caller's credential if connected (never elicits), else None. With several
        accounts of the provider, `account` names one (as `connections` names them); without
        it, the user's default account."""
        named = {"account": account} if account is not None else {}
        try:
            if self.user_proof:
                return _exchanged(provider, await self._exchange(provider, named))
            found = await self._call(
                "GET",
                f"/credentials/{quote(provider, safe='')}",
                params={**_user(self.identity_claim), **named},
            )
        except BrokerRefused as refused:
            if refused.code == "not_connected":
                return None
            raise
        return _credential(found)

    async def _exchange(self, provider: str, named: dict[str, str]) -> dict[str, Any]:
        """The caller's access token exchanged for the credential (POST /api/v1/token)."""
        form = {
            **TOKEN_EXCHANGE,
            "subject_token": _subject_token(),
            "requested_token_type": CREDENTIAL_TYPE + provider,
            **named,
        }
        return await self._call("POST", "/token", form=form)

    async def connections(self, ctx: Context[Any, Any]) -> list[dict[str, Any]]:
        """The caller's connections this service may read (provider, account, status, owner)."""
        found = await self._call("GET", "/connections", **self._caller())
        return list(found.get("connections", []))

    async def disconnect(
        self, ctx: Context[Any, Any], provider: str, *, account: str | None = None
    ) -> bool:
        """Revoke upstream and delete this service's connection; False if there was none. With
        several accounts of the provider, `account` must name one (else BrokerRefused with code
        `account_required`, and nothing is deleted)."""
        caller = self._caller()
        if account is not None:
            caller.setdefault("params", {})["account"] = account
        try:
            await self._call("DELETE", f"/connections/{quote(provider, safe='')}", **caller)
        except BrokerRefused as refused:
            if refused.code == "not_connected":
                return False
            raise
        return True

    def _caller(self) -> dict[str, dict[str, str]]:
        """How a route that takes the user in the query learns the caller: the caller's access
        token in a header (user_proof), else (issuer, identity claim) in the query."""
        if self.user_proof:
            return {"headers": {SUBJECT_TOKEN_HEADER: _subject_token()}}
        return {"params": _user(self.identity_claim)}

    def _request(
        self, ctx: Context[Any, Any], scopes: Sequence[str], *, modern: bool
    ) -> dict[str, Any]:
        # Before 2026-07-28 there is no InputRequiredResult: declare nothing, so the broker
        # answers "missing capability" instead of starting a flow the client could not finish.
        capabilities = ctx.client_capabilities if modern else None
        client = ctx.session.client_params
        user: dict[str, Any] = (
            {"subject_token": _subject_token()}
            if self.user_proof
            else {"user": _user(self.identity_claim, as_query=False)}
        )
        return {
            **user,
            "scopes": list(scopes),
            "client_capabilities": (
                capabilities.model_dump(by_alias=True, mode="json", exclude_none=True)
                if capabilities is not None
                else {}
            ),
            "client_name": _client_name(client.client_info.name) if client is not None else None,
            "request_digest": _call_digest(ctx.request_context),
        }

    async def _call(
        self,
        method: str,
        path: str,
        body: dict[str, Any] | None = None,
        *,
        params: Mapping[str, str] | None = None,
        form: Mapping[str, str] | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> dict[str, Any]:
        try:
            response = await self._http.request(
                method,
                self._api + path,
                json=body,
                data=form,
                params=params,
                headers={**self._headers, **(headers or {})},
            )
        except httpx2.HTTPError as exc:
            logger.warning("connect_broker.unreachable reason=%s", type(exc).__name__)
            raise BrokerUnavailable() from None
        if response.status_code >= 500 or response.status_code == 429:
            # 429: this server's address spent its budget of failed authentications at the
            # broker (another process there presenting a wrong secret?): retryable, like a 5xx
            logger.warning(
                "connect_broker.failed status=%s retry_after=%s",
                response.status_code,
                response.headers.get("retry-after", "-"),
            )
            raise BrokerUnavailable()
        if response.status_code >= 400:
            code = _problem_code(response)
            if code in ("invalid_request_state", "invalid_input_response"):
                # The same frozen answer the SDK gives for its own envelope (MRTR: never re-prompt).
                raise MCPError(INVALID_PARAMS, "Invalid or expired requestState")
            raise BrokerRefused(response.status_code, code)
        try:
            found = response.json()
        except ValueError:
            raise BrokerUnavailable() from None
        if not isinstance(found, dict):  # every answer of the API is an object
            raise BrokerUnavailable()
        return cast(dict[str, Any], found)


def _client_name(name: str) -> str | None:
    """The MCP client's own name for itself, as the broker stores text: at most 100 characters,
    without the NULs and unpaired surrogates it refuses (a client that sends one would otherwise
    make every `require` of its users fail)."""
    kept = "".join(ch for ch in name[:100] if ch != "\x00" and not "\ud800" <= ch <= "\udfff")
    return kept or None


def _user(identity_claim: str, *, as_query: bool = True) -> dict[str, str]:
    """The authenticated caller as the broker names users: (issuer, identity claim)."""
    token = get_access_token()
    claims = (token.claims or {}) if token is not None else {}
    issuer = claims.get("iss")
    subject = token.subject if token is not None and identity_claim == "sub" else None
    subject = subject or claims.get(identity_claim)
    if not isinstance(issuer, str) or not isinstance(subject, str) or not subject:
        raise RuntimeError(
            "ConnectBroker needs an authenticated request whose AccessToken carries claims['iss'] "
            f"and the {identity_claim!r} claim (use connect_broker_client.IdpTokenVerifier)"
        )
    return {"issuer": issuer, "subject": subject}


def _subject_token() -> str:
    """The access token this request was authenticated with, for a user_proof service."""
    token = get_access_token()
    if token is None or not token.token:
        raise RuntimeError("ConnectBroker(user_proof=True) needs an authenticated request")
    return token.token


def _call_digest(request: ServerRequestContext[Any, Any]) -> str:
    """Digest of this call (method, tool or URI, arguments): equal on every round of it."""
    params = request.params or {}
    target = params.get("name", params.get("uri", ""))
    canonical = json.dumps(
        [request.method, target, params.get("arguments") or {}],
        sort_keys=True,
        separators=(",", ":"),
    )
    return hashlib.sha256(canonical.encode()).hexdigest()


def _input_response(ctx: Context[Any, Any], keys: tuple[str, ...]) -> dict[str, Any] | None:
    """The client's answer to our elicitation, as it sent it (the broker validates it)."""
    raw = (ctx.request_context.params or {}).get("inputResponses")
    if not isinstance(raw, Mapping):
        return None
    for key in keys:
        entry = raw.get(key)
        if isinstance(entry, Mapping):
            return dict(entry)
    return None


def _problem_code(response: httpx2.Response) -> str:
    try:
        kind = response.json().get("type", "")
    except (ValueError, AttributeError):
        return "unknown"
    return str(kind).rsplit(":", 1)[-1] or "unknown"


def _credential(found: Mapping[str, Any]) -> Credential:
    return Credential(
        provider=str(found["provider"]),
        kind=str(found["kind"]),
        secret=str(found["secret"]),
        account=found.get("account"),
        scopes=tuple(found.get("scopes") or ()),
        expires_at=datetime.fromisoformat(found["expires_at"]) if found.get("expires_at") else None,
    )


def _exchanged(provider: str, found: Mapping[str, Any]) -> Credential:
    """The credential of an RFC 8693 answer: `token_type` Bearer for an OAuth access token,
    N_A for an API key."""
    expires_in = found.get("expires_in")
    return Credential(
        provider=provider,
        kind="oauth2" if str(found.get("token_type", "")).lower() == "bearer" else "api_key",
        secret=str(found["access_token"]),
        account=found.get("account"),
        scopes=tuple(str(found.get("scope") or "").split()),
        expires_at=(
            datetime.now(UTC) + timedelta(seconds=int(expires_in))
            if isinstance(expires_in, int)
            else None
        ),
    )


def _settle(provider: str, outcome: Mapping[str, Any], *, modern: bool) -> Credential:
    status = outcome.get("status")
    if status == "connected":
        return _credential(outcome["credential"])
    if status == "input_required":
        requests = dict(outcome["inputRequests"])
        pending = PendingRound(provider, tuple(requests), str(outcome["requestState"]))
        raise ConnectionRequired(requests, pending.dump())
    if status == "missing_capability":
        if not modern:
            raise ToolError(
                f"Connecting {provider} needs an MCP client that speaks protocol {MRTR_VERSION}."
            )
        raise MCPError(
            MISSING_REQUIRED_CLIENT_CAPABILITY,
            f"Connecting {provider} needs a client that declares the elicitation.url capability",
            {"requiredCapabilities": outcome.get("requiredCapabilities", {})},
        )
    if status in ENDED_MESSAGES:
        raise ConnectionNotMade(provider, cast(Ended, status), outcome.get("message"))
    raise BrokerUnavailable()
