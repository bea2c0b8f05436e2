"""Round 1 of a connect round, decided once for every surface.

A caller asks for the user's credential for a provider (with scopes). `/mcp` and the integration
API each translate the `RequireOutcome` to their own wire format; what the outcome is, which
scopes a new flow asks for, which audiences are read and what the elicitation says live only here.

- An OAuth connection is used when it holds every scope asked for; otherwise a new flow asks for
  the provider's default scopes, then the scopes asked for (in the caller's order), then those the
  user already granted (sorted), each once: a step-up never loses a grant.
- API keys have no scopes: scopes asked of an API-key provider are ignored (any key is used, a new
  flow asks for none).
- Audiences are read in order (a service's own, then those `[services.<name>] share_from` names);
  a new flow's connection belongs to the first.
- No flow is started for a client that did not declare URL-mode elicitation in this request.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from app.auth.principal import McpCaller, Principal
from app.config import Settings
from app.connect import service as flows
from app.connect.context import RoundContext
from app.connect.refresh import KnownRows
from app.connect.service import FlowView, TooManyOpenFlows
from app.credentials import Credential
from app.providers.settings import OAuthProviderSettings, ProviderSettings

TOO_MANY_OPEN_FLOWS = "Too many unfinished connect links. Finish or wait for one to expire."
URL_ELICITATION: dict[str, Any] = {"elicitation": {"url": {}}}  # what a new flow needs declared


@dataclass(frozen=True, slots=True)
class RoundAsk:
    """One request for a credential, and what a flow started for it is bound to."""

    caller: McpCaller  # the user and the client the flow belongs to
    provider: str
    scopes: tuple[str, ...]
    audiences: tuple[str, ...]  # read in this order; a new flow's connection goes to the first
    capabilities: Mapping[str, Any]  # the MCP client's capabilities of this request
    client_name: str | None  # shown on the consent page
    tool_name: str
    args_digest: str


@dataclass(frozen=True, slots=True)
class Elicitation:
    """The URL-mode elicitation for a flow: its input key and the `elicitation/create` request."""

    flow: FlowView
    key: str
    request: dict[str, Any]


@dataclass(frozen=True, slots=True)
class RequireOutcome:
    """Exactly one of: `connected` (a usable credential covering the scopes), `elicit` (a new
    flow was started), `needs_url_capability` (the client did not declare URL-mode elicitation,
    no flow was started) or `too_many_open_flows` (the text to show; no flow was started)."""

    connected: Credential | None = None
    elicit: Elicitation | None = None
    needs_url_capability: bool = False
    too_many_open_flows: str | None = None


@dataclass(frozen=True, slots=True)
class Held:
    """What the user holds for a round: `usable`, the credential covering the scopes, or None and
    the scopes of a credential that falls short (`granted`, kept by a step-up)."""

    usable: Credential | None
    granted: frozenset[str] = field(default_factory=frozenset)


def service_audiences(settings: Settings, service: str) -> tuple[str, ...]:
    """The audiences a service reads: its own, then those its `share_from` names."""
    shared = settings.services.get(service)
    return (service, *(shared.share_from if shared else ()))


async def first_usable(
    context: RoundContext,
    principal: Principal,
    provider: str,
    audiences: tuple[str, ...],
    *,
    known: KnownRows | None = None,
) -> Credential | None:
    """The first usable credential among `audiences`, in their order (whatever its scopes).
    `known`: connection rows of this user already read, used instead of reading them again."""
    for audience in audiences:
        found = await context.credentials.usable(
            principal=principal, provider=provider, audience=audience, known=known
        )
        if found is not None:
            return found
    return None


def covers(
    settings: ProviderSettings | None, credential: Credential, scopes: tuple[str, ...]
) -> bool:
    """The credential serves a request for `scopes` (API keys have none; an unconfigured
    provider's credential serves nothing)."""
    if settings is None:
        return False
    return not isinstance(settings, OAuthProviderSettings) or set(scopes) <= credential.scopes


async def held(
    context: RoundContext,
    principal: Principal,
    provider: str,
    scopes: tuple[str, ...],
    audiences: tuple[str, ...],
    *,
    known: KnownRows | None = None,
) -> Held:
    """What the user holds for `provider` among `audiences`, checked against `scopes`."""
    found = await first_usable(context, principal, provider, audiences, known=known)
    if found is None:
        return Held(None)
    if covers(context.settings.providers.get(provider), found, scopes):
        return Held(found)
    return Held(None, found.scopes)


def flow_scopes(
    settings: ProviderSettings, requested: tuple[str, ...], granted: frozenset[str]
) -> tuple[str, ...]:
    """The scopes a new flow asks for (see the module docstring for the order)."""
    if not isinstance(settings, OAuthProviderSettings):
        return ()
    return tuple(dict.fromkeys((*settings.scopes, *requested, *sorted(granted))))


def form_declared(capabilities: Mapping[str, Any]) -> bool:
    """The client declared form-mode elicitation (an empty `elicitation` object means form)."""
    elicitation = capabilities.get("elicitation")
    return isinstance(elicitation, dict) and ("form" in elicitation or not elicitation)


def url_declared(capabilities: Mapping[str, Any]) -> bool:
    """The client declared URL-mode elicitation (`{"elicitation": {}}` means form mode only)."""
    elicitation = capabilities.get("elicitation")
    return isinstance(elicitation, dict) and isinstance(elicitation.get("url"), dict)


def elicitation(context: RoundContext, flow: FlowView) -> Elicitation:
    """The URL-mode elicitation pointing at the flow's connect page."""
    provider = context.settings.providers[flow.provider]
    request = {
        "method": "elicitation/create",
        "params": {
            "mode": "url",
            "message": f"Connect your {provider.display_name} account to continue.",
            "url": f"{context.settings.public_url}/connect/{flow.id}",
        },
    }
    return Elicitation(flow, f"connect_{flow.provider}", request)


async def start_round(
    context: RoundContext, ask: RoundAsk, *, granted: frozenset[str] = frozenset()
) -> RequireOutcome:
    """Start a flow for `ask` (the user has no usable credential; `granted`: the scopes of the
    one that falls short). The provider must be configured."""
    if not url_declared(ask.capabilities):
        return RequireOutcome(needs_url_capability=True)
    settings = context.settings.providers[ask.provider]
    try:
        flow = await flows.create(
            context.store,
            caller=ask.caller,
            client_name=ask.client_name,
            provider=ask.provider,
            scopes=flow_scopes(settings, ask.scopes, granted),
            tool_name=ask.tool_name,
            args_digest=ask.args_digest,
            ttl_seconds=context.settings.server.flow_ttl_seconds,
            audience=ask.audiences[0],
        )
    except TooManyOpenFlows:
        return RequireOutcome(too_many_open_flows=TOO_MANY_OPEN_FLOWS)
    return RequireOutcome(elicit=elicitation(context, flow))


async def require_round(
    context: RoundContext, ask: RoundAsk, *, known: KnownRows | None = None
) -> RequireOutcome:
    """Round 1: the usable credential, or a new flow (or why none was started).

    `/mcp` runs the same two steps apart: `held` inside the tool (which may go on without the
    credential), `start_round` once the tool's `ConnectionRequired` reaches the endpoint.
    """
    holding = await held(
        context, ask.caller.principal, ask.provider, ask.scopes, ask.audiences, known=known
    )
    if holding.usable is not None:
        return RequireOutcome(connected=holding.usable)
    return await start_round(context, ask, granted=holding.granted)
