"""A sibling MCP server beside the broker, end to end with real parts (DESIGN.md §3.2).

`examples/sibling_server.py` runs as its own process: an official-SDK `MCPServer` that validates
its own access tokens (audience: its /mcp URL) from the node IdP and asks the broker for GitHub
through `connect_broker_client`. The official `mcp` client calls its tool with a real token; the
elicitation callback drives Chromium through the broker's login and consent pages to a fake
GitHub that approves at once; the client's own retry returns the repositories. A second sibling,
registered separately without `share_from`, cannot read that connection. A third, whose service
the broker configures with `user_proof = "token"` (BROKER_USER_PROOF=token), proves the user with
the user's own access token instead of naming them, and disconnects with it too.

One IdP + broker stack for the module, the three siblings started in parallel; on both databases.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx2
import pytest
from mcp import Client
from mcp.client.streamable_http import streamable_http_client
from mcp_types import CallToolResult
from playwright.async_api import BrowserContext
from sqlalchemy.ext.asyncio import AsyncEngine

from app.db import create_engine

from ..conftest import count_rows, flow_row, github_provider
from ..support.broker import BrokerProcess, cli
from ..support.fake_github import FakeGitHub
from ..support.http import local_client, local_get
from ..support.idp import (
    IdpProcess,
    free_port,
    obtain_access_token,
)
from ..support.schema import validate
from ..support.stack import running_stack
from .chromium import open_page, press_continue, sign_in
from .conftest import ACTION_TIMEOUT_MS, CLIENT_INFO, MCP_ROUND_TIMEOUT, WireLog
from .elicitations import Action, UrlElicitations

pytestmark = pytest.mark.both_databases  # the services, flows and connections of three siblings

REPO_ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = REPO_ROOT / "examples" / "sibling_server.py"
SIBLING_START_TIMEOUT = 20.0
SIBLING_STOP_TIMEOUT = 10.0
TEST_DEADLINE = 55.0  # every test stays under a minute
MCP_CLIENT_REDIRECT = "http://127.0.0.1:9/callback"
REPO_BOT, OTHER_BOT, PROOF_BOT = "repo-bot", "other-bot", "proof-bot"
OCTOCAT_REPOS = [
    {"name": "hello-world", "full_name": "octocat/hello-world", "private": False},
    {"name": "spoon-knife", "full_name": "octocat/spoon-knife", "private": False},
    {"name": "secret-plans", "full_name": "octocat/secret-plans", "private": True},
]


def sibling_url(port: int) -> str:
    """A sibling's /mcp URL: its audience at the IdP (and a proofed service's token_audience)."""
    return f"http://127.0.0.1:{port}/mcp"


@dataclass
class SiblingProcess:
    """`python examples/sibling_server.py --port N` with its configuration in the environment."""

    name: str
    secret: str
    port: int
    process: subprocess.Popen[bytes]
    log_path: Path

    @property
    def mcp_url(self) -> str:
        return sibling_url(self.port)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(SIBLING_STOP_TIMEOUT)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(SIBLING_STOP_TIMEOUT)


def start_sibling(
    name: str,
    secret: str,
    port: int,
    *,
    broker: BrokerProcess,
    idp: IdpProcess,
    github_url: str,
    user_proof: bool = False,
) -> SiblingProcess:
    log_path = broker.log_path.with_name(f"sibling-{name}-{port}.log")
    env = {
        **os.environ,
        "PYTHONPATH": str(REPO_ROOT),  # the helper package, also without an install
        "BROKER_URL": broker.url,
        "BROKER_SERVICE_SECRET": secret,
        "BROKER_USER_PROOF": "token" if user_proof else "off",
        "SIBLING_ISSUER": idp.issuer,
        "SIBLING_AUDIENCE": sibling_url(port),
        "SIBLING_NAME": name,
        "GITHUB_API_URL": github_url,
    }
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            [sys.executable, str(EXAMPLE), "--port", str(port)],
            cwd=REPO_ROOT,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    return SiblingProcess(name, secret, port, process, log_path)


def wait_until_serving(sibling: SiblingProcess) -> None:
    metadata = f"http://127.0.0.1:{sibling.port}/.well-known/oauth-protected-resource/mcp"
    deadline = time.monotonic() + SIBLING_START_TIMEOUT
    while time.monotonic() < deadline:
        if sibling.process.poll() is not None:
            raise RuntimeError(f"the sibling exited: {sibling.log()}")
        with contextlib.suppress(httpx2.HTTPError):
            if local_get(metadata, timeout=1).status_code == 200:
                return
        time.sleep(0.1)
    raise RuntimeError(f"the sibling did not start: {sibling.log()}")


def create_service(broker: BrokerProcess, name: str) -> str:
    created = cli(
        "service", "create", name, "--providers", "github", config_path=broker.config_path
    )
    assert created.returncode == 0, created.stderr
    return created.stdout.strip()


@dataclass
class Deployment:
    idp: IdpProcess
    broker: BrokerProcess
    github: FakeGitHub
    repo_bot: SiblingProcess
    other_bot: SiblingProcess
    proof_bot: SiblingProcess


@pytest.fixture(scope="module")
def deployment(workdir: Path) -> Iterator[Deployment]:
    """An IdP that issues tokens for the broker and the three siblings, the broker with GitHub
    pointed at its own fake GitHub, and the siblings registered as separate services: proof-bot's
    with `user_proof = "token"` and its /mcp URL as `token_audience`."""
    broker_port = free_port()
    ports = {REPO_BOT: free_port(), OTHER_BOT: free_port(), PROOF_BOT: free_port()}
    broker_url = f"http://127.0.0.1:{broker_port}"
    proofed = {"user_proof": "token", "token_audience": sibling_url(ports[PROOF_BOT])}
    with (
        FakeGitHub(redirect_uri=f"{broker_url}/oauth/github/callback") as github,
        running_stack(
            workdir,
            "siblings",
            port=broker_port,
            idp={
                "resources": [sibling_url(port) for port in ports.values()],
                "mcp_client_redirect": MCP_CLIENT_REDIRECT,
            },
            providers={"github": github_provider(github)},
            services={PROOF_BOT: proofed},
        ) as stack,
        contextlib.ExitStack() as stops,
    ):
        idp, broker = stack.idp, stack.broker
        common: dict[str, Any] = {"broker": broker, "idp": idp, "github_url": github.url}
        siblings: dict[str, SiblingProcess] = {}
        for name, port in ports.items():
            secret = create_service(broker, name)
            proof = name == PROOF_BOT
            siblings[name] = start_sibling(name, secret, port, user_proof=proof, **common)
            stops.callback(siblings[name].stop)
        for sibling in siblings.values():  # all start in parallel; wait for each
            wait_until_serving(sibling)
        yield Deployment(
            idp, broker, github, siblings[REPO_BOT], siblings[OTHER_BOT], siblings[PROOF_BOT]
        )


@pytest.fixture(scope="module")
async def deployment_db(deployment: Deployment) -> AsyncIterator[AsyncEngine]:
    """The dedicated broker's database, for asserting what was stored."""
    engine = create_engine(deployment.broker.database_url, pool_size=2)
    yield engine
    await engine.dispose()


@asynccontextmanager
async def official_client(
    url: str, token: str, on_elicit: UrlElicitations, wire: WireLog
) -> AsyncIterator[Client]:
    """The SDK's Client over HTTP to a sibling, every exchange recorded on `wire`."""
    http = local_client(
        headers={"Authorization": f"Bearer {token}"},
        timeout=httpx2.Timeout(MCP_ROUND_TIMEOUT),
        event_hooks={"request": [wire.on_request], "response": [wire.on_response]},
    )
    async with (
        http,
        Client(
            streamable_http_client(url, http_client=http),
            elicitation_callback=on_elicit,
            client_info=CLIENT_INFO,
            read_timeout_seconds=MCP_ROUND_TIMEOUT,
        ) as client,
    ):
        yield client


async def access_token(deployment: Deployment, user: str, sibling: SiblingProcess) -> str:
    """A real access token the IdP issues to the public mcp-client for the sibling's audience."""
    return await obtain_access_token(
        deployment.idp.issuer,
        user=user,
        client_id="mcp-client",
        client_secret=None,
        redirect_uri=MCP_CLIENT_REDIRECT,
        resource=sibling.mcp_url,
    )


async def connect_github_in_chromium(
    context: BrowserContext, issuer: str, user: str, url: str, seen: dict[str, Any]
) -> Action:
    """Open the flow URL, sign in, press Continue; the fake GitHub approves and sends us back."""
    async with open_page(context) as page:
        await page.goto(url, timeout=ACTION_TIMEOUT_MS)
        seen["login_page"] = page.url
        consent = await sign_in(page, issuer, user)
        seen["consent"] = (consent.url, consent.status, await page.locator("main").inner_text())
        landed = await press_continue(page)
        seen["landed"] = (landed.url, landed.status, await page.locator("main").inner_text())
    return "accept"


def chromium_connects(
    context: BrowserContext, deployment: Deployment, user: str, seen: dict[str, Any]
) -> UrlElicitations:
    """URL elicitations finished by `user` in Chromium (connect_github_in_chromium)."""

    async def connect(url: str) -> Action:
        return await connect_github_in_chromium(context, deployment.idp.issuer, user, url, seen)

    return UrlElicitations(connect)


def wire_text(wire: WireLog) -> str:
    return json.dumps([(exchange.request, exchange.response) for exchange in wire.exchanges])


def structured(result: CallToolResult) -> Any:
    wire: dict[str, Any] = result.model_dump(by_alias=True, mode="json", exclude_none=True)
    validate(wire, "CallToolResult")
    return wire.get("structuredContent")


async def test_sibling_tool_connects_github_in_the_browser_then_lists_the_repos(
    deployment: Deployment, deployment_db: AsyncEngine, context: BrowserContext
) -> None:
    """DESIGN §3.2 end to end: the sibling's tool elicits through the broker, Chromium connects
    GitHub, the retry returns the repositories; the next call needs no elicitation."""
    user = "alice-sibling-e2e"
    bot, broker, github = deployment.repo_bot, deployment.broker, deployment.github
    token = await access_token(deployment, user, bot)
    seen: dict[str, Any] = {}
    wire = WireLog()

    elicitations = chromium_connects(context, deployment, user, seen)
    async with (
        asyncio.timeout(TEST_DEADLINE),
        official_client(bot.mcp_url, token, elicitations, wire) as client,
    ):
        first = await client.call_tool("list_github_repos", {})
        calls_after_first = len(wire.calls())
        second = await client.call_tool("list_github_repos", {})

    (url,) = elicitations.urls
    assert elicitations.modes == ["url"]
    assert re.fullmatch(re.escape(f"{broker.url}/connect/") + r"[A-Za-z0-9_-]{43}", url)
    assert seen["login_page"].startswith(f"{deployment.idp.issuer}/interaction/")
    consent_url, consent_status, consent_text = seen["consent"]
    assert (consent_url, consent_status) == (url, 200)
    assert (
        "repo-bot (via a client that calls itself “e2e-official-client”) asks to use your GitHub "
        "account" in consent_text
    )
    assert "repo" in consent_text.split()
    assert seen["landed"][:2] == (url, 200)
    assert "Connected as @octocat" in seen["landed"][2]
    assert first.is_error is False
    assert structured(first) == {"result": OCTOCAT_REPOS}
    assert structured(second) == {"result": OCTOCAT_REPOS}
    wire.validate()
    assert wire.result_types() == ["input_required", "complete", "complete"]
    assert calls_after_first == 2 and len(wire.calls()) == 3  # the second call: one round
    assert github.issued_access_tokens, "the fake GitHub issued no token"
    assert not any(issued in wire_text(wire) for issued in github.issued_access_tokens)
    flow_id = url.rsplit("/", 1)[1]
    assert (await flow_row(deployment_db, flow_id) or {})["status"] == "consumed"
    owned = await count_rows(
        deployment_db, "connections", subject=user, provider="github", audience="repo-bot"
    )
    assert owned == 1


async def test_another_sibling_cannot_read_the_connection_and_asks_for_its_own(
    deployment: Deployment, deployment_db: AsyncEngine, context: BrowserContext
) -> None:
    """DESIGN §2: each sibling sees only the connections made through it (no share_from)."""
    user = "bob-sibling-e2e"
    bot, other = deployment.repo_bot, deployment.other_bot
    seen: dict[str, Any] = {}  # what Chromium saw; the first test asserts on it

    async def decline(url: str) -> Action:
        return "decline"

    asked_by_other = UrlElicitations(decline)
    async with asyncio.timeout(TEST_DEADLINE):
        async with official_client(
            bot.mcp_url,
            await access_token(deployment, user, bot),
            chromium_connects(context, deployment, user, seen),
            WireLog(),
        ) as client:
            connected = await client.call_tool("list_github_repos", {})
        other_wire = WireLog()
        async with official_client(
            other.mcp_url, await access_token(deployment, user, other), asked_by_other, other_wire
        ) as client:
            refused = await client.call_tool("list_github_repos", {})
        query = {"issuer": deployment.idp.issuer, "subject": user}
        async with local_client(base_url=deployment.broker.url) as api:
            own = await api.get(
                "/api/v1/credentials/github",
                params=query,
                headers={"Authorization": f"Bearer {bot.secret}"},
            )
            foreign = await api.get(
                "/api/v1/credentials/github",
                params=query,
                headers={"Authorization": f"Bearer {other.secret}"},
            )

    assert structured(connected) == {"result": OCTOCAT_REPOS}
    assert len(asked_by_other.urls) == 1  # other-bot elicits a flow of its own
    assert asked_by_other.urls[0].startswith(f"{deployment.broker.url}/connect/")
    assert refused.is_error is True
    assert "declined to connect github" in json.dumps(refused.model_dump(mode="json"))
    other_wire.validate()
    assert own.status_code == 200 and own.json()["account"] == "@octocat"
    assert foreign.status_code == 404
    assert foreign.json()["type"] == "urn:connect-broker:error:not_connected"
    assert await count_rows(deployment_db, "connections", subject=user, audience="other-bot") == 0


async def test_a_sibling_with_user_proof_connects_lists_and_disconnects_with_the_users_token(
    deployment: Deployment, deployment_db: AsyncEngine, context: BrowserContext
) -> None:
    """`user_proof = "token"`: the sibling sends the user's own access token, which the IdP
    issued for the sibling, to require and resume (the broker refuses a proofed service that
    names the user): the call elicits, Chromium connects GitHub, the retry lists the repositories.
    `disconnect_github` lists and disconnects with the token in the Subject-Token header: the
    connection is gone, and a second call finds none. The token is in neither log."""
    user = "dora-sibling-e2e"
    bot, broker, github = deployment.proof_bot, deployment.broker, deployment.github
    token = await access_token(deployment, user, bot)
    seen: dict[str, Any] = {}
    wire = WireLog()

    elicitations = chromium_connects(context, deployment, user, seen)
    async with (
        asyncio.timeout(TEST_DEADLINE),
        official_client(bot.mcp_url, token, elicitations, wire) as client,
    ):
        listed = await client.call_tool("list_github_repos", {})
        owned = await count_rows(
            deployment_db, "connections", subject=user, provider="github", audience=PROOF_BOT
        )
        revocations = github.revocations
        first = await client.call_tool("disconnect_github", {})
        second = await client.call_tool("disconnect_github", {})

    (url,) = elicitations.urls
    assert re.fullmatch(re.escape(f"{broker.url}/connect/") + r"[A-Za-z0-9_-]{43}", url)
    consent_url, consent_status, consent_text = seen["consent"]
    assert (consent_url, consent_status) == (url, 200)
    assert "proof-bot (via a client that calls itself “e2e-official-client”)" in consent_text
    assert "Connected as @octocat" in seen["landed"][2]
    assert listed.is_error is False
    assert structured(listed) == {"result": OCTOCAT_REPOS}
    flow = await flow_row(deployment_db, url.rsplit("/", 1)[1]) or {}
    assert (flow["status"], flow["subject"]) == ("consumed", user)  # the user the token names
    assert owned == 1
    assert (first.is_error, second.is_error) == (False, False)
    assert structured(first) == {"result": "Disconnected GitHub (@octocat)."}
    assert structured(second) == {"result": "GitHub was not connected through this server."}
    assert github.revocations == revocations + 1
    wire.validate()
    assert wire.result_types() == ["input_required", "complete", "complete", "complete"]
    assert await count_rows(deployment_db, "connections", subject=user, audience=PROOF_BOT) == 0
    logs = broker.log() + bot.log()
    assert token not in logs
    assert token.rsplit(".", 1)[1] not in logs  # not even the signature
