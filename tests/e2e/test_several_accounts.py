"""Two GitHub accounts end to end: the official `mcp` client connects both through Chromium (the
node IdP for the broker login, the fake GitHub signing in as two different users), then a tool
needing GitHub gets a form-mode elicitation listing both, and acts as the account chosen."""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
from mcp.client.session import ClientRequestContext
from mcp_types import CallToolResult, ElicitRequestParams, ElicitRequestURLParams, ElicitResult
from playwright.async_api import BrowserContext

from ..support.fake_github import FakeGitHub
from ..support.idp import IdpProcess
from ..support.schema import validate
from .chromium import open_page, sign_in
from .conftest import ACTION_TIMEOUT_MS, OpenClient, WireLog

pytestmark = pytest.mark.both_databases  # the accounts' rows and the remembered choice

TEST_DEADLINE = 55.0


@dataclass
class Elicitations:
    """URL-mode requests open Chromium (`on_url`); form-mode ones answer `pick`, remembered."""

    on_url: Callable[[str], Awaitable[None]]
    pick: str | None = None
    forms: list[dict[str, Any]] = field(default_factory=list)

    async def __call__(
        self, context: ClientRequestContext, params: ElicitRequestParams
    ) -> ElicitResult:
        if isinstance(params, ElicitRequestURLParams):
            await self.on_url(params.url)
            return ElicitResult(action="accept")
        self.forms.append(params.model_dump(by_alias=True, mode="json", exclude_none=True))
        assert self.pick is not None, "no account to pick"
        return ElicitResult(action="accept", content={"account": self.pick})


@pytest.fixture(autouse=True)
def github(fake_github: FakeGitHub) -> Iterator[FakeGitHub]:
    fake_github.reset()
    yield fake_github
    fake_github.reset()


def structured(result: CallToolResult) -> dict[str, Any]:
    wire: dict[str, Any] = result.model_dump(by_alias=True, mode="json", exclude_none=True)
    validate(wire, "CallToolResult")
    assert not wire.get("isError"), wire
    content: dict[str, Any] = wire["structuredContent"]
    return content


async def test_two_github_accounts_then_a_tool_asks_which_one_in_form_mode(
    official_client: OpenClient,
    access_token: Callable[[str], Awaitable[str]],
    context: BrowserContext,
    idp: IdpProcess,
    github: FakeGitHub,
    wire: WireLog,
) -> None:
    """MCP 2026-07-28 §5: the account choice is a form (names only); the URL-mode connects are
    finished in the browser. The fake GitHub echoes the user each token belongs to."""
    user = f"alice-e2e-accounts-{secrets.token_hex(3)}"
    work, home = f"work-{secrets.token_hex(3)}", f"home-{secrets.token_hex(3)}"
    token = await access_token(user)

    async def connect_in_browser(url: str) -> None:
        async with open_page(context) as page:
            await page.goto(url, timeout=ACTION_TIMEOUT_MS)
            if page.url.startswith(f"{idp.issuer}/"):  # the first time: the broker's login
                await sign_in(page, idp.issuer, user)
            async with page.expect_navigation(timeout=ACTION_TIMEOUT_MS):
                await page.click("[data-action=continue]", timeout=ACTION_TIMEOUT_MS)
            assert "is connected" in await page.locator("h1").inner_text()

    elicitations = Elicitations(connect_in_browser)
    async with asyncio.timeout(TEST_DEADLINE), official_client(token, elicitations) as client:
        github.next_user = work
        first = structured(await client.call_tool("connect_account", {"provider": "github"}))
        github.next_user = home
        second = structured(
            await client.call_tool("connect_account", {"provider": "github", "account": "new"})
        )
        elicitations.pick = f"@{work}"
        as_work = structured(await client.call_tool("github_whoami", {}))
        elicitations.pick = None  # remembered: asking again would fail the callback
        again = structured(await client.call_tool("github_whoami", {}))
        switched = structured(
            await client.call_tool("connect_account", {"provider": "github", "account": f"@{home}"})
        )
        as_home = structured(await client.call_tool("github_whoami", {}))
        listed = structured(await client.call_tool("list_connections", {}))

    wire.validate()
    assert (first["account"], second["account"]) == (f"@{work}", f"@{home}")
    ((form),) = elicitations.forms
    assert form["mode"] == "form"
    account = form["requestedSchema"]["properties"]["account"]
    assert account["enum"] == [f"@{home}", f"@{work}"]  # the latest connected first
    assert (as_work["login"], again["login"]) == (work, work)
    assert switched["account"] == f"@{home}"
    assert as_home["login"] == home
    assert sorted(item["account"] for item in listed["connections"]) == sorted(
        [f"@{work}", f"@{home}"]
    )
