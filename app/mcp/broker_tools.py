"""The broker's own tools: connect, list, disconnect accounts; list providers."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from app import credentials
from app.audit import Actor
from app.connect.disconnect import disconnect
from app.connect.require import form_declared
from app.connect.revocations import Revoker
from app.credentials import MAX_ACCOUNT_NAME
from app.mcp.accounts import NEW_ACCOUNT, check_account_argument
from app.mcp.protocol import invalid_params, missing_capability
from app.mcp.registry import (
    InputRequired,
    Tool,
    ToolCall,
    ToolRegistry,
    ToolResult,
)
from app.models import BROKER_AUDIENCE
from app.providers.settings import ProviderSettings, is_scope_token

PROVIDER_ARGUMENT = {"type": "string", "description": "Provider name, as listed by list_providers"}
ACCOUNT_ARGUMENT = {
    "type": "string",
    "minLength": 1,
    "maxLength": MAX_ACCOUNT_NAME,
    "description": "One of the user's accounts at the provider, named as list_connections lists "
    "it (several may be connected)",
}
CONFIRM_KEY = "confirm_disconnect"


def _schema(properties: dict[str, Any], required: list[str]) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": properties,
        "required": required,
        "additionalProperties": False,
    }


class BrokerTools:
    def __init__(
        self,
        providers: Mapping[str, ProviderSettings],
        sessionmaker: async_sessionmaker[AsyncSession],
        revoker: Revoker,
    ) -> None:
        self.providers = providers
        self._sessionmaker = sessionmaker
        self._revoker = revoker

    def register(self, registry: ToolRegistry) -> None:
        registry.add(
            Tool(
                name="connect_account",
                description=(
                    "Make sure the user's account at a provider is connected. If it is not, the "
                    "user is asked to open a link in their browser to connect it."
                ),
                handler=self.connect_account,
                input_schema=_schema(
                    {
                        "provider": PROVIDER_ARGUMENT,
                        "scopes": {
                            "type": "array",
                            "items": {"type": "string"},
                            "description": "OAuth scopes the connection must include",
                        },
                        "account": {
                            **ACCOUNT_ARGUMENT,
                            "description": "Use this connected account from now on (named as "
                            f'list_connections lists it), or "{NEW_ACCOUNT}" to connect another '
                            "account (connecting one already held refreshes it)",
                        },
                    },
                    ["provider"],
                ),
                annotations={"readOnlyHint": False, "openWorldHint": True},
            )
        )
        registry.add(
            Tool(
                name="list_connections",
                description="List the user's connected accounts.",
                handler=self.list_connections,
                annotations={"readOnlyHint": True},
            )
        )
        registry.add(
            Tool(
                name="disconnect_account",
                description="Disconnect the user's account at a provider, after asking to confirm. "
                "With several accounts connected there, `account` names the one.",
                handler=self.disconnect_account,
                input_schema=_schema(
                    {"provider": PROVIDER_ARGUMENT, "account": ACCOUNT_ARGUMENT}, ["provider"]
                ),
                annotations={"destructiveHint": True, "idempotentHint": True},
            )
        )
        registry.add(
            Tool(
                name="list_providers",
                description="List providers the user can connect, and which are connected.",
                handler=self.list_providers,
                annotations={"readOnlyHint": True},
            )
        )

    async def connect_account(self, call: ToolCall) -> ToolResult:
        # The arguments' shape is checked against the inputSchema before a tool runs.
        provider: str = call.arguments["provider"]
        scopes: list[str] = call.arguments.get("scopes") or []
        if provider not in self.providers:
            return self._unknown_provider(provider)
        settings = self.providers[provider]
        separator = getattr(settings, "scope_separator", " ")
        if not all(is_scope_token(scope, separator) for scope in scopes):
            return ToolResult(
                text="scopes: each entry must be one scope, without spaces, commas or control "
                "characters",
                is_error=True,
            )
        named = call.arguments.get("account")
        if named is not None:
            check_account_argument(named)
        credential = await call.connections.require(provider, tuple(scopes), account=named)
        account = credential.account_label
        return ToolResult(
            text=f"{settings.display_name} is connected" + (f" as {account}." if account else "."),
            structured={"provider": provider, "status": "connected", "account": account},
        )

    async def list_connections(self, call: ToolCall) -> ToolResult:
        items = [
            {
                "provider": row.provider,
                "account": row.account,
                "account_id": row.account_id or None,
                "default": row.default,
                "status": row.status,
                "connected_at": row.connected_at.isoformat(),
            }
            for row in await self._connections_of(call)  # each default account first
        ]
        return ToolResult(structured={"connections": items})

    async def list_providers(self, call: ToolCall) -> ToolResult:
        connected = {
            row.provider for row in await self._connections_of(call) if row.status == "active"
        }
        items = [
            {
                "name": name,
                "kind": provider.kind,
                "display_name": provider.display_name,
                "connected": name in connected,
            }
            for name, provider in self.providers.items()
        ]
        return ToolResult(structured={"providers": items})

    async def disconnect_account(self, call: ToolCall) -> ToolResult | InputRequired:
        provider: str = call.arguments["provider"]
        if provider not in self.providers:
            return self._unknown_provider(provider)
        name = self.providers[provider].display_name
        named = call.arguments.get("account")
        if named is not None:
            check_account_argument(named)
        async with self._sessionmaker() as session:
            held = await credentials.accounts(
                session,
                principal=call.caller.principal,
                provider=provider,
                audience=BROKER_AUDIENCE,
            )
        if not held:
            return ToolResult(
                text=f"{name} is not connected.",
                structured={"provider": provider, "status": "not_connected"},
            )
        if named is None and len(held) > 1:
            return _which_account(name, provider, tuple(held))
        if named is not None and named not in held:
            raise invalid_params(f"account: no such {name} account is connected")
        account = named or next(iter(held))
        expected = provider if named is None else [provider, named]
        answer = call.input_responses.get(CONFIRM_KEY) if call.state == expected else None
        if answer is None:
            label = held[account].account_label if named is None else named
            return _confirm(call, name, label, expected)
        if answer.get("action") == "accept" and _confirmed(answer):
            async with self._sessionmaker() as session:
                outcome = await disconnect(
                    session,
                    self._revoker,
                    principal=call.caller.principal,
                    provider=provider,
                    audience=BROKER_AUDIENCE,
                    actor=Actor.user(call.caller.principal),
                    account=account,
                )
            note = (
                f" {name} could not confirm revoking its grant yet; the broker keeps asking it"
                f" for a few hours. To end the grant at once, revoke it in your {name} settings."
                if outcome.upstream_failed
                else ""
            )
            return ToolResult(
                text=f"{name} was disconnected.{note}",
                structured={
                    "provider": provider,
                    "status": "disconnected",
                    "revoked_upstream": outcome.revoked_upstream,
                },
            )
        return ToolResult(
            text=f"{name} stays connected.",
            structured={"provider": provider, "status": "connected"},
        )

    async def _connections_of(self, call: ToolCall) -> list[credentials.ConnectionInfo]:
        async with self._sessionmaker() as session:
            return await credentials.list_for(
                session, principal=call.caller.principal, audience=BROKER_AUDIENCE
            )

    def _unknown_provider(self, name: object) -> ToolResult:
        known = ", ".join(sorted(self.providers)) or "none"
        return ToolResult(
            text=f"Unknown provider {name!s:.64}. Known providers: {known}.", is_error=True
        )


def _confirmed(answer: dict[str, Any]) -> bool:
    """Only a boolean `confirm: true` is a yes (the string "false" is truthy).

    Raises:
        JsonRpcError: -32602 when the form content is not an object (ElicitResult.content).
    """
    content = answer.get("content")
    if content is None:
        return False
    if not isinstance(content, dict):
        raise invalid_params(f"inputResponses.{CONFIRM_KEY}.content must be an object")
    return content.get("confirm") is True


def _which_account(name: str, provider: str, accounts: tuple[str, ...]) -> ToolResult:
    """Several accounts and none named: nothing is disconnected (never a guess)."""
    return ToolResult(
        text=f"Several {name} accounts are connected ({', '.join(accounts)}). Call "
        "disconnect_account again with `account` naming the one to disconnect.",
        structured={"provider": provider, "status": "choose_account", "accounts": list(accounts)},
        is_error=True,
    )


def _confirm(call: ToolCall, name: str, account: str | None, state: Any) -> InputRequired:
    """A non-secret yes/no question: form mode (an empty `elicitation` object means form)."""
    if not form_declared(call.capabilities):
        raise missing_capability({"elicitation": {"form": {}}})
    who = f" ({account})" if account else ""
    return InputRequired(
        requests={
            CONFIRM_KEY: {
                "method": "elicitation/create",
                "params": {
                    "mode": "form",
                    "message": f"Disconnect {name}{who}? Tools will lose access to it.",
                    "requestedSchema": {
                        "type": "object",
                        "properties": {
                            "confirm": {
                                "type": "boolean",
                                "title": f"Disconnect {name}",
                                "default": False,
                            }
                        },
                        "required": ["confirm"],
                    },
                },
            }
        },
        state=state,
    )


def register_broker_tools(
    registry: ToolRegistry,
    providers: Mapping[str, ProviderSettings],
    sessionmaker: async_sessionmaker[AsyncSession],
    revoker: Revoker,
) -> None:
    """Add the four broker tools to `registry`."""
    BrokerTools(providers, sessionmaker, revoker).register(registry)
