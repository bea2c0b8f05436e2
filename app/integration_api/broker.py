"""The connect machinery on behalf of a sibling service: require, resume, fetch.

The same flows, pages, waits and sealed `requestState` as the broker's own MCP endpoint. The state
is bound to the service (as the "client"), the user, the provider and the sibling's request digest,
so it cannot be replayed by another service, for another user or another request.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from datetime import datetime
from typing import Annotated, Any, Literal

import orjson
from pydantic import BaseModel, ConfigDict, Field

from app import credentials
from app.auth.bearer import MAX_TOKEN_LENGTH
from app.auth.principal import McpCaller, Principal
from app.connect.context import RoundContext
from app.connect.refresh import KnownRows
from app.connect.request_state import RequestStateCodec, StateRejected
from app.connect.require import (
    URL_ELICITATION,
    Elicitation,
    RequireOutcome,
    RoundAsk,
    elicitation,
    first_usable,
    require_round,
    service_audiences,
    start_round,
)
from app.connect.rounds import ACTIONS, mark_delivered, resume_round
from app.credentials import Credential
from app.display import display_text
from app.errors import BrokerError
from app.integration_api.services import Service
from app.models import FlowStatus
from app.providers.settings import SCOPE_PATTERN, OAuthProviderSettings
from app.storable import StorableText

METHOD = "api/connections.require"


@dataclass(frozen=True, slots=True)
class ConnectApi:
    """What the integration API's connect endpoints use: the connect round, and the codec of the
    requestState its answers carry."""

    rounds: RoundContext
    codec: RequestStateCodec


class InvalidRequestState(BrokerError):
    status_code = 400
    code = "invalid_request_state"
    title = "Invalid or expired requestState"
    message = "The requestState is tampered, expired, or belongs to another user or request."


class InvalidInputResponse(BrokerError):
    status_code = 400
    code = "invalid_input_response"
    title = "Invalid input response"
    message = "input_response.action must be accept, decline or cancel."


class UserRef(BaseModel):
    model_config = ConfigDict(extra="forbid")

    issuer: StorableText = Field(
        min_length=1, max_length=255, description="the `iss` of the user's MCP access token"
    )
    subject: StorableText = Field(
        min_length=1, max_length=255, description="the user's identity claim (`sub`)"
    )


class RequireRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    user: UserRef | None = Field(
        default=None, description="the user, named by a service that does not send `subject_token`"
    )
    subject_token: str | None = Field(
        default=None,
        min_length=1,
        max_length=MAX_TOKEN_LENGTH,
        description='the user\'s own access token, for a service with user_proof = "token"',
    )
    scopes: list[Annotated[str, Field(pattern=SCOPE_PATTERN)]] = Field(
        default_factory=list, max_length=50, description="one scope per entry"
    )
    client_capabilities: dict[str, Any] = Field(
        default_factory=dict, description="the MCP client's clientCapabilities of this request"
    )
    client_name: StorableText | None = Field(default=None, max_length=255)
    request_digest: StorableText = Field(
        default="", max_length=128, description="a digest of the sibling's tool call"
    )
    account: Literal["new"] | None = Field(
        default=None,
        description='"new": start a connect flow even though the user holds an account of the '
        "provider (connecting another account adds a connection; the same account replaces it)",
    )


class ResumeRequest(RequireRequest):
    request_state: str = Field(max_length=8192)
    input_response: dict[str, Any] | None = Field(
        default=None, description="the client's inputResponses entry for the elicitation key"
    )


class CredentialView(BaseModel):
    provider: str
    kind: Literal["api_key", "oauth2"]
    secret: str = Field(description="the API key or the OAuth access token")
    account: str | None = None
    scopes: list[str] = Field(default_factory=list)
    expires_at: datetime | None = None


@dataclass(frozen=True, slots=True)
class UsableCredential:
    """A credential a service may read, and its kind: what the credential answers carry."""

    kind: Literal["api_key", "oauth2"]
    credential: Credential

    def view(self) -> CredentialView:
        found = self.credential
        # built from stored, already validated values: no validation pass
        return CredentialView.model_construct(
            provider=found.provider,
            kind=self.kind,
            secret=found.secret,
            account=found.account_label,
            scopes=sorted(found.scopes),
            expires_at=found.expires_at,
        )

    def document(self) -> bytes:
        """`view().model_dump_json(exclude_none=True)`, encoded, without building the model
        (the credential fetch's hot path; tests/integration_api/test_credential_fetch.py compares
        the two)."""
        found = self.credential
        document: dict[str, Any] = {
            "provider": found.provider,
            "kind": self.kind,
            "secret": found.secret,
        }
        if found.account_label is not None:
            document["account"] = found.account_label
        document["scopes"] = sorted(found.scopes)
        if found.expires_at is not None:
            document["expires_at"] = found.expires_at
        return orjson.dumps(document, option=orjson.OPT_UTC_Z)


class ConnectOutcome(BaseModel):
    status: Literal[
        "connected",
        "input_required",
        "missing_capability",
        "declined",
        "cancelled",
        "expired",
        "failed",
    ]
    credential: CredentialView | None = None
    input_requests: dict[str, Any] | None = Field(default=None, alias="inputRequests")
    request_state: str | None = Field(default=None, alias="requestState")
    required_capabilities: dict[str, Any] | None = Field(default=None, alias="requiredCapabilities")
    message: str | None = None

    model_config = ConfigDict(populate_by_name=True, serialize_by_alias=True)


class ConnectionItem(BaseModel):
    provider: str
    account: str | None = Field(
        default=None,
        description="the account's name (its label, made unique among the user's accounts of "
        "the provider); the value of `account` that names it",
    )
    account_id: str | None = Field(
        default=None, description="the account's identity at the provider, when known"
    )
    default: bool = Field(
        default=True,
        description="the account used when none is named (the latest connected or chosen)",
    )
    status: str = Field(description="`active` or `needs_reauth`")
    owner: str = Field(
        description='the audience that made it: this service, one it shares from, or "mcp"'
    )
    connected_at: datetime


class ConnectionList(BaseModel):
    connections: list[ConnectionItem]


class Disconnection(BaseModel):
    provider: str
    status: Literal["disconnected"] = "disconnected"
    revoked_upstream: bool = Field(description="the provider confirmed the revocation")
    upstream_failed: bool = Field(
        description="the provider did not confirm the revocation yet; the broker retries it"
    )


def _usable(api: ConnectApi, credential: Credential) -> UsableCredential:
    oauth = isinstance(api.rounds.settings.providers[credential.provider], OAuthProviderSettings)
    return UsableCredential("oauth2" if oauth else "api_key", credential)


async def usable_for(
    api: ConnectApi,
    service: Service,
    provider: str,
    principal: Principal,
    *,
    known: KnownRows | None = None,
) -> UsableCredential | None:
    """The first usable credential among the audiences the service reads, its own first.
    `known`: connection rows of this user already read, used instead of reading them again."""
    found = await first_usable(
        api.rounds,
        principal,
        provider,
        service_audiences(api.rounds.settings, service.name),
        known=known,
    )
    return _usable(api, found) if found is not None else None


async def named_for(
    api: ConnectApi, service: Service, provider: str, principal: Principal, account: str
) -> UsableCredential | None:
    """The credential of the user's account named `account` (as `GET /connections` names it)
    among the audiences the service reads, its own first."""
    for audience in service_audiences(api.rounds.settings, service.name):
        async with api.rounds.sessionmaker() as session:
            held = await credentials.accounts(
                session, principal=principal, provider=provider, audience=audience
            )
        row = held.get(account)
        if row is not None:
            found = await api.rounds.credentials.use(row, accounts=len(held))
            return _usable(api, found) if found is not None else None
    return None


def _caller(service: Service, principal: Principal) -> McpCaller:
    return McpCaller(principal=principal, client_id=f"service:{service.name}", scopes=frozenset())


def _binding(provider: str, body: RequireRequest) -> str:
    return hashlib.sha256(f"{provider}|{body.request_digest}".encode()).hexdigest()


def _elicit(
    api: ConnectApi, service: Service, asked: Elicitation, body: RequireRequest
) -> ConnectOutcome:
    flow = asked.flow
    state = api.codec.issue(
        _caller(service, flow.principal),
        method=METHOD,
        name=flow.provider,
        arguments_digest=_binding(flow.provider, body),
        flow_id=flow.id,
        input_key=asked.key,
    )
    return ConnectOutcome(
        status="input_required", input_requests={asked.key: asked.request}, request_state=state
    )


def _ask(
    api: ConnectApi, service: Service, provider: str, principal: Principal, body: RequireRequest
) -> RoundAsk:
    """The service's request: its audiences, the flow named after it (and the client)."""
    name = api.rounds.settings.service_display_name(service.name)
    client = f"{name} (via {display_text(body.client_name)})" if body.client_name else name
    return RoundAsk(
        caller=_caller(service, principal),
        provider=provider,
        scopes=tuple(body.scopes),
        audiences=service_audiences(api.rounds.settings, service.name),
        capabilities=body.client_capabilities,
        client_name=client,
        tool_name=METHOD,
        args_digest=_binding(provider, body),
    )


def _answer(
    api: ConnectApi, service: Service, outcome: RequireOutcome, body: RequireRequest
) -> ConnectOutcome:
    if outcome.connected is not None:
        return ConnectOutcome(status="connected", credential=_usable(api, outcome.connected).view())
    if outcome.elicit is not None:
        return _elicit(api, service, outcome.elicit, body)
    if outcome.needs_url_capability:
        return _missing_url_capability()
    return ConnectOutcome(status="failed", message=outcome.too_many_open_flows)


def _missing_url_capability() -> ConnectOutcome:
    return ConnectOutcome(status="missing_capability", required_capabilities=URL_ELICITATION)


async def require_connection(
    api: ConnectApi, service: Service, provider: str, principal: Principal, body: RequireRequest
) -> ConnectOutcome:
    ask = _ask(api, service, provider, principal, body)
    if body.account == "new":
        return _answer(api, service, await start_round(api.rounds, ask), body)
    return _answer(api, service, await require_round(api.rounds, ask), body)


async def resume_connection(
    api: ConnectApi, service: Service, provider: str, principal: Principal, body: ResumeRequest
) -> ConnectOutcome:
    """The outcome of the client's retry.

    Raises:
        InvalidRequestState: tampered, expired, foreign or not for this request.
        InvalidInputResponse: an action other than accept/decline/cancel.
    """
    try:
        payload = api.codec.verify(
            body.request_state,
            _caller(service, principal),
            method=METHOD,
            name=provider,
            arguments_digest=_binding(provider, body),
        )
    except StateRejected:
        raise InvalidRequestState() from None
    if payload.flow_id is None:
        raise InvalidRequestState()
    action = (body.input_response or {}).get("action")
    if action is not None and action not in ACTIONS:
        raise InvalidInputResponse()
    outcome = await resume_round(
        api.rounds,
        flow_id=payload.flow_id,
        principal=principal,
        action=action,
        capabilities=body.client_capabilities,
    )
    if outcome.done is not None:
        read = outcome.done
        known = {(read.flow.provider, read.flow.audience): read.connection}
        ask = _ask(api, service, provider, principal, body)
        again = await require_round(api.rounds, ask, known=known)  # as `/mcp` runs the tool again
        if again.connected is not None:
            await mark_delivered(api.rounds, read)
        return _answer(api, service, again, body)
    if outcome.needs_url_capability:
        return _missing_url_capability()
    if outcome.open is not None:
        return _elicit(api, service, elicitation(api.rounds, outcome.open), body)
    return ConnectOutcome(status=outcome.ended or FlowStatus.expired)
