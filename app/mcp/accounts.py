"""Which of the user's accounts at a provider a tool of the broker's endpoint uses.

A user may connect several accounts of one provider (work and personal GitHub). A tool asking
for the provider's credential gets, in this order:

1. the account the call names (`account`: an account's name as `list_connections` lists it,
   or "new" to connect another one), which also becomes the client's choice once its
   credential is usable;
2. the account whose connect flow this very call just finished;
3. the account the user chose for this MCP client (the access token's client id, not the
   `clientInfo` name a client says of itself), kept until that account is disconnected;
4. with several accounts and no choice, a form-mode elicitation asking which one (an enum of the
   accounts' names: nothing secret), when the client declared form-mode elicitation;
5. otherwise the default account: the one most recently connected or chosen.

The one-account path costs nothing more: the hot read of the default account also counts the
user's accounts (app/tables/connections.py); only a user with several is read again.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from app import credentials
from app.auth.principal import McpCaller
from app.connect.context import RoundContext
from app.connect.refresh import KnownRows
from app.connect.require import covers, form_declared, held
from app.credentials import MAX_ACCOUNT_NAME, Credential, account_name_valid
from app.mcp.protocol import invalid_params
from app.mcp.registry import ConnectionRequired, ToolResult
from app.models import BROKER_AUDIENCE, Connection

NEW_ACCOUNT = "new"  # `account` value: connect another account (or the same one again)
STATE_KEY = "broker.choose_account"  # in the sealed requestState of a choice round
ACTIONS = ("accept", "decline", "cancel")
ENDED = {"decline": "declined", "cancel": "cancelled"}


class AccountChoiceRequired(Exception):
    """The user holds several accounts of `provider` and has not chosen one for this client."""

    def __init__(self, provider: str, names: tuple[str, ...]) -> None:
        super().__init__(provider)
        self.provider = provider
        self.names = names  # the default account first


def check_account_argument(value: object, *, name: str = "account") -> str:
    """An `account` argument: 1-255 characters of storable text without control characters.

    Raises:
        JsonRpcError: -32602 naming the fault.
    """
    if not isinstance(value, str) or not 1 <= len(value) <= MAX_ACCOUNT_NAME:
        raise invalid_params(f"{name} must be a string of 1 to {MAX_ACCOUNT_NAME} characters")
    if not account_name_valid(value):
        raise invalid_params(f"{name} must not contain control characters")
    return value


def input_key(provider: str) -> str:
    return f"choose_{provider}_account"


def choice_request(provider_name: str, client: str, names: tuple[str, ...]) -> dict[str, Any]:
    """The form-mode elicitation asking which account to use (names only, nothing secret)."""
    return {
        "method": "elicitation/create",
        "params": {
            "mode": "form",
            "message": f"Several {provider_name} accounts are connected. Which one should "
            f"{client} use? The choice is kept for this client until that account is "
            "disconnected.",
            "requestedSchema": {
                "type": "object",
                "properties": {
                    "account": {
                        "type": "string",
                        "title": f"{provider_name} account",
                        "enum": list(names),
                        "default": names[0],
                    }
                },
                "required": ["account"],
            },
        },
    }


class BrokerConnections:
    """`call.connections` for the broker's own endpoint: credentials of audience "mcp", as
    app/connect/require.py decides, the account picked as the module docstring says.

    `known`: connection rows already read for this caller (e.g. the one read with the finished
    flow of a retry), used instead of reading them again; `connected`: the provider whose flow
    this call just finished, if any.
    """

    def __init__(
        self,
        context: RoundContext,
        caller: McpCaller,
        capabilities: Mapping[str, Any],
        *,
        known: KnownRows | None = None,
        connected: str | None = None,
    ) -> None:
        self._context = context
        self._caller = caller
        self._capabilities = capabilities
        self._known = known
        self._connected = connected

    async def require(
        self, provider: str, scopes: tuple[str, ...] = (), *, account: str | None = None
    ) -> Credential:
        if account is not None and account != NEW_ACCOUNT:
            return await self._named(provider, scopes, account)
        holding = await held(
            self._context,
            self._caller.principal,
            provider,
            scopes,
            (BROKER_AUDIENCE,),
            known=self._known,
        )
        usable = holding.usable
        if account == NEW_ACCOUNT and provider != self._connected:
            granted = usable.scopes if usable is not None else holding.granted
            raise ConnectionRequired(provider, scopes, granted=granted)
        if usable is None:
            raise ConnectionRequired(provider, scopes, granted=holding.granted)
        if usable.accounts > 1 and provider != self._connected:
            return await self._chosen(provider, scopes, usable)
        return usable

    async def _named(self, provider: str, scopes: tuple[str, ...], name: str) -> Credential:
        """The named account's credential, remembered as this client's choice once it is usable:
        a call refused for want of a grant (or of a capability to ask for one) changes nothing."""
        async with self._context.sessionmaker() as session:
            held_accounts = await self._accounts(session, provider)
        row = held_accounts.get(name)
        if row is None:
            raise invalid_params(
                f"account: no such {provider} account is connected (list_connections "
                f'names them; "{NEW_ACCOUNT}" connects another)'
            )
        found = await self._use(row, scopes, accounts=len(held_accounts))
        async with self._context.sessionmaker() as session:
            await credentials.choose_account(
                session, principal=self._caller.principal, client_id=self._caller.client_id, row=row
            )
            await session.commit()
        return found

    async def _chosen(
        self, provider: str, scopes: tuple[str, ...], default: Credential
    ) -> Credential:
        async with self._context.sessionmaker() as session:
            chosen = await credentials.chosen_account(
                session,
                principal=self._caller.principal,
                client_id=self._caller.client_id,
                provider=provider,
            )
            held_accounts = await self._accounts(session, provider)
        for row in held_accounts.values():
            if row.account_id == chosen:
                return await self._use(row, scopes, accounts=len(held_accounts))
        if len(held_accounts) > 1:
            self._ask(provider, tuple(held_accounts))
        return default

    def _ask(self, provider: str, names: tuple[str, ...]) -> None:
        """Ask which account (a form-mode elicitation), when this request declares form mode.
        Without it the caller goes on with the default account: MCP 2026-07-28 forbids asking
        what the request's capabilities do not declare, and a missing choice is no error."""
        if form_declared(self._capabilities):
            raise AccountChoiceRequired(provider, names)

    async def _use(self, row: Connection, scopes: tuple[str, ...], *, accounts: int) -> Credential:
        found = await self._context.credentials.use(row, accounts=accounts)
        if found is None or not covers(
            self._context.settings.providers.get(row.provider), found, scopes
        ):
            granted = found.scopes if found is not None else frozenset()
            raise ConnectionRequired(row.provider, scopes, granted=granted)
        return found

    async def _accounts(self, session: Any, provider: str) -> dict[str, Connection]:
        return await credentials.accounts(
            session, principal=self._caller.principal, provider=provider, audience=BROKER_AUDIENCE
        )

    async def answer(self, provider: str, offered: list[str], response: Any) -> ToolResult | None:
        """Record the client's answer to the choice of a `provider` account (`response`: its
        `inputResponses` entry); None when recorded (or when there is nothing to record: no
        answer, from a request that cannot be asked again), else the final result (declined,
        cancelled).

        Raises:
            JsonRpcError: -32602 for a malformed answer or an account that was not offered.
            AccountChoiceRequired: no answer, or the account chosen is gone, and this request
                declares form mode: ask again.
        """
        key = input_key(provider)
        if response is None:
            self._ask(provider, tuple(offered))
            return None
        action = response.get("action")
        if action not in ACTIONS:
            raise invalid_params(f"inputResponses.{key}.action must be accept, decline or cancel")
        if action != "accept":
            return ToolResult(
                text=f"No {provider} account was chosen. Call the tool again to choose one.",
                structured={"provider": provider, "status": ENDED[action]},
                is_error=True,
            )
        content = response.get("content")
        name = content.get("account") if isinstance(content, dict) else None
        if not isinstance(name, str) or name not in offered:
            raise invalid_params(f"inputResponses.{key}.content.account must be an account offered")
        async with self._context.sessionmaker() as session:
            held_accounts = await self._accounts(session, provider)
            row = held_accounts.get(name)
            if row is None:  # gone meanwhile, or renamed: ask again, if there is a choice
                if len(held_accounts) > 1:
                    self._ask(provider, tuple(held_accounts))
                return None
            await credentials.choose_account(
                session, principal=self._caller.principal, client_id=self._caller.client_id, row=row
            )
            await session.commit()
        return None
