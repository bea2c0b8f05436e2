"""Real parts end to end: the official `mcp` client, Debian's Chromium (Playwright), the node IdP.

The browser is the machine's `/usr/bin/chromium`, never a downloaded one. Every MCP message the
official client exchanges with the broker is recorded on the wire (`WireLog`) so the tests can
check it against the 2026-07-28 schema.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import httpx2
import pytest
from mcp import Client
from mcp.client.session import ElicitationFnT
from mcp.client.streamable_http import streamable_http_client
from mcp_types import Implementation
from playwright.async_api import Browser, BrowserContext, Playwright, async_playwright

from ..support.broker import BrokerProcess
from ..support.http import local_client
from ..support.idp import IdpProcess, obtain_access_token
from ..support.schema import validate, validate_response

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]
ACTION_TIMEOUT_MS = 15_000
MCP_ROUND_TIMEOUT = 20.0  # one tools/call round: the broker holds a retry for 3 s at most
CLIENT_INFO = Implementation(name="e2e-official-client", version="1")

REQUEST_DEFINITIONS = {
    "server/discover": "DiscoverRequest",
    "tools/list": "ListToolsRequest",
    "tools/call": "CallToolRequest",
}
RESULT_DEFINITIONS: dict[str, str | None] = {
    "server/discover": "DiscoverResult",
    "tools/list": "ListToolsResult",
    "tools/call": None,  # CallToolResult or InputRequiredResult, by resultType
}


@dataclass
class WireExchange:
    sent_at: float
    request: dict[str, Any]
    status: int
    response: dict[str, Any] | None

    @property
    def method(self) -> str:
        return str(self.request.get("method"))


@dataclass
class WireLog:
    """Every HTTP exchange between the official client and the broker's /mcp endpoint."""

    exchanges: list[WireExchange] = field(default_factory=list)
    retry_sent: asyncio.Event = field(default_factory=asyncio.Event)
    _sent_at: dict[int, float] = field(default_factory=dict)

    async def on_request(self, request: httpx2.Request) -> None:
        self._sent_at[id(request)] = time.monotonic()
        params = json.loads(request.content).get("params", {}) if request.content else {}
        if "inputResponses" in params:
            self.retry_sent.set()

    async def on_response(self, response: httpx2.Response) -> None:
        await response.aread()  # httpx2 keeps the body, the SDK reads it again
        request = response.request
        is_json = response.headers.get("content-type", "").startswith("application/json")
        self.exchanges.append(
            WireExchange(
                sent_at=self._sent_at.pop(id(request), time.monotonic()),
                request=json.loads(request.content) if request.content else {},
                status=response.status_code,
                response=response.json() if is_json else None,
            )
        )

    def calls(self, method: str = "tools/call") -> list[WireExchange]:
        return [exchange for exchange in self.exchanges if exchange.method == method]

    def result_types(self) -> list[str]:
        """The `resultType` of each tools/call answer, in order."""
        return [
            str((call.response or {}).get("result", {}).get("resultType")) for call in self.calls()
        ]

    def validate(self) -> None:
        """Check every recorded request and JSON-RPC response against the official schema."""
        assert self.exchanges, "the client sent nothing"
        for exchange in self.exchanges:
            validate(exchange.request, "JSONRPCRequest")
            validate(exchange.request, REQUEST_DEFINITIONS[exchange.method])
            assert exchange.response is not None, f"{exchange.method}: HTTP {exchange.status}"
            validate_response(exchange.response, RESULT_DEFINITIONS[exchange.method])


OpenClient = Callable[[str, ElicitationFnT], AbstractAsyncContextManager[Client]]


@pytest.fixture(scope="session")
async def playwright_driver() -> AsyncIterator[Playwright]:
    async with async_playwright() as driver:
        yield driver


@pytest.fixture(scope="session")
async def chromium(playwright_driver: Playwright) -> AsyncIterator[Browser]:
    browser = await playwright_driver.chromium.launch(
        executable_path=CHROMIUM, args=CHROMIUM_ARGS, timeout=ACTION_TIMEOUT_MS
    )
    yield browser
    await browser.close()


@pytest.fixture
async def context(chromium: Browser) -> AsyncIterator[BrowserContext]:
    """A fresh browser profile per test: no cookies at the broker or the IdP."""
    browser_context = await chromium.new_context()
    browser_context.set_default_timeout(ACTION_TIMEOUT_MS)
    browser_context.set_default_navigation_timeout(ACTION_TIMEOUT_MS)
    yield browser_context
    await browser_context.close()


@pytest.fixture
def wire() -> WireLog:
    return WireLog()


@pytest.fixture
def access_token(idp: IdpProcess, broker: BrokerProcess) -> Callable[[str], Awaitable[str]]:
    """A real access token for the broker's /mcp, issued by the IdP to the public mcp-client."""

    async def obtain(user: str) -> str:
        return await obtain_access_token(
            idp.issuer,
            user=user,
            client_id="mcp-client",
            client_secret=None,
            redirect_uri="http://127.0.0.1:9/callback",
            resource=broker.mcp_url,
        )

    return obtain


@pytest.fixture
def official_client(broker: BrokerProcess, wire: WireLog) -> OpenClient:
    """`async with official_client(token, on_elicit) as client`: the SDK's Client over HTTP."""

    @asynccontextmanager
    async def open_client(token: str, on_elicit: ElicitationFnT) -> AsyncIterator[Client]:
        http = local_client(
            headers={"Authorization": f"Bearer {token}"},
            timeout=httpx2.Timeout(MCP_ROUND_TIMEOUT),
            event_hooks={"request": [wire.on_request], "response": [wire.on_response]},
        )
        async with (
            http,
            Client(
                streamable_http_client(broker.mcp_url, http_client=http),
                elicitation_callback=on_elicit,
                client_info=CLIENT_INFO,
                read_timeout_seconds=MCP_ROUND_TIMEOUT,
            ) as client,
        ):
            yield client

    return open_client
