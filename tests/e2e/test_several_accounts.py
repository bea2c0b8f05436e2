"""Two GitHub accounts end to end: the official `mcp` client connects both through Chromium (the
node IdP for the broker login, the fake GitHub signing in as two different users), then a tool
needing GitHub gets a form-mode elicitation listing both, and acts as the account chosen. The
same accounts' lifecycle: posted, signed, to a webhook receiver, listed by `audit list`, and
erased by `users erase`."""

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

from ..support.broker import BrokerProcess, cli, serve_replica
from ..support.fake_github import FakeGitHub
from ..support.idp import IdpProcess
from ..support.schema import validate
from ..support.webhook_receiver import Receiver, running_receiver
from ..test_webhooks import SECRET, documented_verify
from .chromium import open_page, press_continue, sign_in
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


@pytest.fixture(scope="module")
def receiver() -> Iterator[Receiver]:
    with running_receiver() as running:
        yield running


@pytest.fixture(scope="module")
def webhook_replica(
    broker: BrokerProcess, receiver: Receiver, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[BrokerProcess]:
    """A second process on the session broker's database posting every event to `receiver`."""
    secret_file = tmp_path_factory.mktemp("e2e-webhooks") / "secret"
    secret_file.write_text(SECRET)
    hook = {"url": receiver.url, "secret_file": str(secret_file), "events": ["*"]}
    replica = serve_replica(broker, name="e2e-webhooks", webhooks={"e2e-accounts": hook})
    try:
        yield replica
    finally:
        replica.stop()


def browser_connect(
    context: BrowserContext, idp: IdpProcess, user: str
) -> Callable[[str], Awaitable[None]]:
    """Open a connect link in Chromium, sign in at the IdP the first time, press Continue."""

    async def connect_in_browser(url: str) -> None:
        async with open_page(context) as page:
            await page.goto(url, timeout=ACTION_TIMEOUT_MS)
            if page.url.startswith(f"{idp.issuer}/"):  # the first time: the broker's login
                await sign_in(page, idp.issuer, user)
            await press_continue(page)
            assert "is connected" in await page.locator("h1").inner_text()

    return connect_in_browser


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

    elicitations = Elicitations(browser_connect(context, idp, user))
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


async def test_the_accounts_lifecycle_is_posted_signed_listed_and_erased(
    official_client: OpenClient,
    access_token: Callable[[str], Awaitable[str]],
    context: BrowserContext,
    idp: IdpProcess,
    github: FakeGitHub,
    broker: BrokerProcess,
    webhook_replica: BrokerProcess,
    receiver: Receiver,
) -> None:
    """Issue parts 3 and 4 with the real parts: each account's connect round reaches the
    webhook in order and signed as docs/webhooks.md verifies; `audit list` shows the same
    events; `users erase` removes both accounts, the client then lists none, and the erasure
    is posted too. No token or secret in any delivery, listing or log."""
    user = f"carol-e2e-lifecycle-{secrets.token_hex(3)}"
    work, home = f"work-{secrets.token_hex(3)}", f"home-{secrets.token_hex(3)}"
    token = await access_token(user)

    def mine(event: dict[str, Any]) -> bool:
        return bool(event["subject"] == user)

    round_events = ["flow.created", "flow.completed", "credential.stored"]
    through_erasure = 2 * len(round_events) + 1  # both accounts' rounds, then user.erased

    elicitations = Elicitations(browser_connect(context, idp, user))
    async with asyncio.timeout(TEST_DEADLINE):
        async with official_client(token, elicitations) as client:
            github.next_user = work
            await client.call_tool("connect_account", {"provider": "github"})
            github.next_user = home
            await client.call_tool("connect_account", {"provider": "github", "account": "new"})
        connected = await receiver.wait_for(2 * len(round_events), mine)
        audit = cli("audit", "list", "--issuer", idp.issuer, "--subject", user,
                    config_path=broker.config_path)  # fmt: skip
        erased = cli("users", "erase", "--issuer", idp.issuer, "--subject", user,
                     config_path=broker.config_path)  # fmt: skip
        async with official_client(token, elicitations) as client:
            listed = structured(await client.call_tool("list_connections", {}))
        posted = await receiver.wait_for(through_erasure, mine)

    verify = documented_verify()
    assert [d.event["event"] for d in connected] == round_events * 2
    assert [d.event["account_label"] for d in connected if d.event["event"] != "flow.created"] == [
        f"@{work}", f"@{work}", f"@{home}", f"@{home}"
    ]  # fmt: skip
    assert all(verify(SECRET, d.headers, d.body) for d in posted)
    ids = [d.event["id"] for d in posted]
    assert ids == sorted(ids)
    assert audit.returncode == 0, audit.stderr
    assert [line.split("\t")[1] for line in audit.stdout.splitlines()] == round_events * 2
    assert erased.returncode == 0, erased.stderr
    assert "connections=2 revocations_queued=2" in erased.stdout
    assert listed["connections"] == []
    names = [d.event["event"] for d in posted]
    assert names[:through_erasure] == [*round_events * 2, "user.erased"]
    # the revocation worker may already have confirmed the revocations the erasure queued
    assert set(names[through_erasure:]) <= {"revocation.confirmed"}, names
    issued = [t for t in github.issued_access_tokens if t]
    everything = audit.stdout + erased.stdout + webhook_replica.log() + broker.log()
    everything += "".join(d.body.decode() for d in posted)
    assert issued and not any(secret in everything for secret in [*issued, SECRET, token])
