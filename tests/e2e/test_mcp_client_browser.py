"""End to end with real parts: the official `mcp` client's elicitation callback drives Chromium.

The client calls `connect_account`; the broker answers a URL-mode elicitation; the callback opens
the URL in Chromium, which signs in at the node IdP and types an API key on the broker's page; the
client's own MRTR retries then return the final result (SECURITY.md H6, H7, E13).
"""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any
from unittest.mock import ANY

from mcp_types import CallToolResult
from playwright.async_api import BrowserContext, Cookie, Dialog, Page, Response
from sqlalchemy.ext.asyncio import AsyncEngine

from ..conftest import count_rows, flow_row
from ..support.broker import BrokerProcess
from ..support.clients import McpHttp
from ..support.idp import IdpProcess
from ..support.schema import validate, validate_response
from .chromium import open_page, sign_in
from .conftest import ACTION_TIMEOUT_MS, OpenClient, WireLog
from .elicitations import Action, UrlElicitations

API_KEY = "sk_CANARYKEY_e2e_1"
MARKUP_KEY = '"><img src=x onerror=alert(1)>'
TEST_DEADLINE = 55.0  # every test stays under a minute
WAIT = ACTION_TIMEOUT_MS / 1000


def flow_url_pattern(broker: BrokerProcess) -> re.Pattern[str]:
    return re.compile(re.escape(f"{broker.url}/connect/") + r"[A-Za-z0-9_-]{43}")


def result_wire(result: CallToolResult) -> dict[str, Any]:
    wire: dict[str, Any] = result.model_dump(by_alias=True, mode="json", exclude_none=True)
    validate(wire, "CallToolResult")
    return wire


async def submit_key(page: Page, key: str) -> Response:
    await page.fill('input[name="api_key"]', key, timeout=ACTION_TIMEOUT_MS)
    async with page.expect_navigation(timeout=ACTION_TIMEOUT_MS) as navigation:
        await page.click("[data-action=submit-api-key]", timeout=ACTION_TIMEOUT_MS)
    response = await navigation.value
    assert response is not None
    return response


async def heading(page: Page) -> str:
    return await page.locator("h1").inner_text(timeout=ACTION_TIMEOUT_MS)


async def cookies_set_by(responses: list[Response], origin: str) -> list[str]:
    headers: list[str] = []
    for response in responses:
        if response.url.startswith(origin + "/"):
            headers += await response.header_values("set-cookie")
    return headers


def assert_host_only_lax_cookies(set_cookies: list[str], jar: list[Cookie]) -> None:
    """H3 as Chromium keeps them: what the broker set is `__Host-`, Secure, HttpOnly, Lax."""
    assert set_cookies, "the broker set no cookie"
    names = {header.split("=", 1)[0] for header in set_cookies}
    assert all(name.startswith("__Host-") for name in names), names
    assert all("domain=" not in header.lower() for header in set_cookies)
    kept = [cookie for cookie in jar if cookie.get("name") in names]
    assert kept, "the session cookie did not survive the redirect back from the IdP"
    for cookie in kept:
        assert cookie.get("secure") is True
        assert cookie.get("httpOnly") is True
        assert cookie.get("sameSite") == "Lax"
        assert cookie.get("path") == "/"
        assert cookie.get("domain") == "127.0.0.1"  # host-only: no Domain attribute


async def start_flow(mcp: McpHttp, token: str) -> str:
    """Round 1 over raw HTTP; the flow URL of the answer."""
    response = await mcp.call_tool(token, "connect_account", {"provider": "demo"})
    body = response.json()
    validate_response(body, "InputRequiredResult")
    ((request,),) = [body["result"]["inputRequests"].values()]
    url: str = request["params"]["url"]
    return url


async def sign_in_on_the_flow_page(page: Page, idp: IdpProcess, url: str, user: str) -> Response:
    await page.goto(url, timeout=ACTION_TIMEOUT_MS)
    return await sign_in(page, idp.issuer, user)


async def test_h7_mcp_client_connects_an_api_key_through_the_browser(
    official_client: OpenClient,
    access_token: Callable[[str], Awaitable[str]],
    context: BrowserContext,
    idp: IdpProcess,
    broker: BrokerProcess,
    wire: WireLog,
    db: AsyncEngine,
) -> None:
    """H7. The official client, Chromium and the IdP complete a connect flow; the retry finishes."""
    user = "alice-e2e-h7"
    token = await access_token(user)
    seen: dict[str, Any] = {}

    async def connect_in_browser(url: str) -> Action:
        async with open_page(context) as page:
            responses: list[Response] = []
            page.on("response", lambda response: responses.append(response))
            await page.goto(url, timeout=ACTION_TIMEOUT_MS)
            seen["login_page"] = page.url
            landed = await sign_in(page, idp.issuer, user)
            seen["landed"] = (landed.url, landed.status)
            seen["submitted"] = (await submit_key(page, API_KEY)).status
            seen["heading"] = await heading(page)
            seen["html"] = await page.content()
            seen["set_cookies"] = await cookies_set_by(responses, broker.url)
        return "accept"

    elicitations = UrlElicitations(connect_in_browser)
    async with asyncio.timeout(TEST_DEADLINE), official_client(token, elicitations) as client:
        result = await client.call_tool("connect_account", {"provider": "demo"})

    assert elicitations.modes == ["url"]
    (url,) = elicitations.urls
    assert flow_url_pattern(broker).fullmatch(url)
    assert seen["login_page"].startswith(f"{idp.issuer}/interaction/")
    assert seen["landed"] == (url, 200)
    assert seen["submitted"] == 200
    assert seen["heading"] == "Demo is connected"
    assert API_KEY not in seen["html"]
    assert result_wire(result) == {
        "resultType": "complete",
        "content": [{"type": "text", "text": "Demo is connected."}],
        "structuredContent": {"provider": "demo", "status": "connected", "account": None},
        "isError": False,
        "_meta": {"io.modelcontextprotocol/serverInfo": {"name": "connect-broker", "version": ANY}},
    }
    wire.validate()
    assert wire.result_types() == ["input_required", "complete"]
    flow_id = url.rsplit("/", 1)[1]
    assert (await flow_row(db, flow_id) or {})["status"] == "consumed"
    assert await count_rows(db, "connections", subject=user, provider="demo") == 1

    assert_host_only_lax_cookies(seen["set_cookies"], await context.cookies(broker.url))


async def test_retry_before_completion_gets_the_result_within_the_default_rounds(
    official_client: OpenClient,
    access_token: Callable[[str], Awaitable[str]],
    context: BrowserContext,
    idp: IdpProcess,
    broker: BrokerProcess,
    wire: WireLog,
) -> None:
    """MRTR: the client accepts at once and retries; the broker's bounded waits bridge the gap."""
    user = "alice-e2e-early"
    token = await access_token(user)
    browser_work: list[asyncio.Task[float]] = []

    async def complete_later(url: str) -> float:
        async with open_page(context) as page:
            await sign_in_on_the_flow_page(page, idp, url, user)
            await page.fill('input[name="api_key"]', API_KEY, timeout=ACTION_TIMEOUT_MS)
            # the client's retry is on its way before the key is saved: that is the case under test
            await asyncio.wait_for(wire.retry_sent.wait(), WAIT)
            submitted_at = time.monotonic()
            await submit_key(page, API_KEY)
        return submitted_at

    async def accept_now(url: str) -> Action:
        if not browser_work:
            browser_work.append(asyncio.create_task(complete_later(url)))
        return "accept"

    elicitations = UrlElicitations(accept_now)
    async with asyncio.timeout(TEST_DEADLINE), official_client(token, elicitations) as client:
        result = await client.call_tool("connect_account", {"provider": "demo"})
        submitted_at = await asyncio.wait_for(browser_work[0], WAIT)

    assert result.structured_content == {"provider": "demo", "status": "connected", "account": None}
    assert result.is_error is False
    (task,) = browser_work
    assert task.done() and task.exception() is None
    wire.validate()
    calls = wire.calls()
    assert 2 <= len(calls) <= 11  # round 1, then at most the client's default 10 retries
    assert calls[1].sent_at < submitted_at  # the first retry was waiting when the key was saved
    assert wire.result_types()[-1] == "complete"
    assert len(set(elicitations.urls)) == 1  # a re-issued elicitation keeps the same flow URL
    assert flow_url_pattern(broker).fullmatch(elicitations.urls[0])


async def test_wrong_user_is_refused_and_the_flow_is_untouched(
    official_client: OpenClient,
    access_token: Callable[[str], Awaitable[str]],
    context: BrowserContext,
    idp: IdpProcess,
    broker: BrokerProcess,
    wire: WireLog,
    db: AsyncEngine,
) -> None:
    """D2 in Chromium: bob cannot use alice's link; nothing moves until alice's client cancels."""
    alice, bob = "alice-e2e-d2", "bob-e2e-d2"
    token = await access_token(alice)
    seen: dict[str, Any] = {}

    async def open_as_bob(url: str) -> Action:
        flow_id = url.rsplit("/", 1)[1]
        async with open_page(context) as page:
            landed = await sign_in_on_the_flow_page(page, idp, url, bob)
            seen["landed"] = (landed.url, landed.status)
            seen["heading"] = await heading(page)
            seen["key_inputs"] = await page.locator('input[name="api_key"]').count()
        seen["flow"] = await flow_row(db, flow_id)
        return "cancel"

    elicitations = UrlElicitations(open_as_bob)
    async with asyncio.timeout(TEST_DEADLINE), official_client(token, elicitations) as client:
        result = await client.call_tool("connect_account", {"provider": "demo"})

    (url,) = elicitations.urls
    flow_id = url.rsplit("/", 1)[1]
    assert seen["landed"] == (url, 403)
    assert seen["heading"] == "This link belongs to a different account"
    assert seen["key_inputs"] == 0
    assert seen["flow"]["status"] == "pending"
    assert seen["flow"]["subject"] == alice
    assert result.is_error is True
    assert result.structured_content == {"status": "cancelled"}
    result_wire(result)
    wire.validate()
    assert (await flow_row(db, flow_id) or {})["status"] == "cancelled"
    assert await count_rows(db, "connections", subject=alice) == 0
    assert await count_rows(db, "connections", subject=bob) == 0
    assert await broker.log_shows(f"connect.identity_mismatch flow_id={flow_id}")


@asynccontextmanager
async def framing_site(target: str) -> AsyncIterator[str]:
    """A page on another origin (its own port) that puts `target` in an iframe."""
    page = f'<!doctype html><title>elsewhere</title><iframe src="{target}"></iframe>'.encode()

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        head = f"HTTP/1.1 200 OK\r\nContent-Type: text/html\r\nContent-Length: {len(page)}\r\n"
        writer.write(head.encode() + b"Connection: close\r\n\r\n" + page)
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(answer, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}/"
    finally:
        server.close()
        await server.wait_closed()


async def test_h6_framing_is_blocked(
    mcp: McpHttp, token_for: Any, context: BrowserContext, idp: IdpProcess
) -> None:
    """H6. A foreign page cannot frame the connect page, even for the signed-in owner."""
    user = "alice-e2e-h6"
    url = await start_flow(mcp, token_for(user))

    async with asyncio.timeout(TEST_DEADLINE):
        async with open_page(context) as page:
            landed = await sign_in_on_the_flow_page(page, idp, url, user)
            top_level_inputs = await page.locator('input[name="api_key"]').count()
        async with framing_site(url) as site, open_page(context) as page:
            framed: list[Response] = []
            page.on(
                "response",
                lambda response: framed.append(response) if response.url == url else None,
            )
            await page.goto(site, timeout=ACTION_TIMEOUT_MS)
            frames = page.frames
            inputs = [await frame.locator('input[name="api_key"]').count() for frame in frames]
            child_urls = [frame.url for frame in frames if frame is not page.main_frame]
            statuses = [response.status for response in framed]
            headers = [await response.all_headers() for response in framed]

    assert (landed.status, top_level_inputs) == (200, 1)  # at top level the form is usable
    assert len(frames) == 2
    assert inputs == [0, 0]
    assert len(child_urls) == 1 and child_urls[0] != url
    assert child_urls[0].startswith(("chrome-error:", "about:blank"))
    assert statuses == [200]  # the broker answered the framed request; the browser hid it
    assert "frame-ancestors 'none'" in headers[0]["content-security-policy"]
    assert headers[0]["x-frame-options"] == "DENY"


async def test_e13_like_no_script_runs(
    mcp: McpHttp,
    token_for: Any,
    context: BrowserContext,
    idp: IdpProcess,
    db: AsyncEngine,
) -> None:
    """E13-like. Markup typed as an API key is refused with an error page that runs no script."""
    user = "alice-e2e-e13"
    url = await start_flow(mcp, token_for(user))
    dialogs: list[str] = []

    async def record(dialog: Dialog) -> None:
        dialogs.append(dialog.message)
        await dialog.dismiss()

    async with asyncio.timeout(TEST_DEADLINE):
        async with open_page(context) as control:  # the recorder does see a script's dialog
            control.on("dialog", record)
            async with control.expect_event("dialog", timeout=ACTION_TIMEOUT_MS):
                await control.set_content(f"<p>{MARKUP_KEY}</p>", timeout=ACTION_TIMEOUT_MS)
        control_dialogs = list(dialogs)
        async with open_page(context) as page:
            page.on("dialog", record)
            await sign_in_on_the_flow_page(page, idp, url, user)
            refused = await submit_key(page, MARKUP_KEY)
            error = await page.locator("[role=alert]").inner_text(timeout=ACTION_TIMEOUT_MS)
            images = await page.locator("img").count()
            html = await page.content()

    assert control_dialogs == ["1"]
    assert refused.status == 400
    assert error == "That does not look like a Demo API key."
    assert images == 0
    assert "onerror" not in html  # not reflected at all, so nothing to escape wrongly
    assert dialogs == control_dialogs  # none from the broker's page
    assert await count_rows(db, "connections", subject=user) == 0
