"""A generic OpenID provider end to end: the session broker's "acme" is a second node IdP.

Chromium, driven from the official `mcp` client's elicitation callback, signs in at the MCP IdP,
consents on the broker's page, follows the 303 to acme's authorize endpoint (CSP `form-action`
must allow that origin, SECURITY.md H7), signs in at acme and comes back through the callback; the
client's own retry returns the account. Over plain HTTP, the same flow shows the `nonce` the
broker sends and that an ID token carrying any other nonce is refused.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any
from unittest.mock import ANY
from urllib.parse import parse_qs, parse_qsl, urlencode, urlsplit, urlunsplit

import httpx2
import pytest
from mcp_types import CallToolResult
from playwright.async_api import BrowserContext, Page, Request
from playwright.async_api import Error as PlaywrightError
from sqlalchemy.ext.asyncio import AsyncEngine

from ..conftest import count_rows, flow_row
from ..support.broker import BrokerProcess
from ..support.clients import Browser, McpHttp, flow_id_from, provider_url
from ..support.idp import IdpProcess, idp_login
from ..support.schema import validate, validate_response
from .chromium import open_page, press_continue, sign_in
from .conftest import ACTION_TIMEOUT_MS, CLIENT_INFO, OpenClient, WireLog
from .elicitations import Action, UrlElicitations

PROVIDER = "acme"
ACME_USER = "acme-user"
ACME_CLIENT_ID = "broker-acme"
ACME_SCOPES = ["openid", "profile"]
TEST_DEADLINE = 55.0  # every test stays under a minute


@dataclass
class RequestLog:
    """Every request any page of a browser context sent (redirect hops included)."""

    urls: list[str] = field(default_factory=list)

    def record(self, request: Request) -> None:
        self.urls.append(request.url)

    def to(self, origin: str) -> list[str]:
        return [url for url in self.urls if url.startswith(origin + "/")]


def query_of(url: str) -> dict[str, str]:
    return dict(parse_qsl(urlsplit(url).query, keep_blank_values=True))


def result_wire(result: CallToolResult) -> dict[str, Any]:
    wire: dict[str, Any] = result.model_dump(by_alias=True, mode="json", exclude_none=True)
    validate(wire, "CallToolResult")
    return wire


async def test_h7_mcp_client_connects_a_generic_oidc_provider_through_the_browser(
    official_client: OpenClient,
    access_token: Callable[[str], Awaitable[str]],
    context: BrowserContext,
    idp: IdpProcess,
    provider_idp: IdpProcess,
    broker: BrokerProcess,
    wire: WireLog,
    db: AsyncEngine,
) -> None:
    """H7. Official client, Chromium and two real OpenID providers complete an OAuth connect flow.

    The consent POST answers 303 to acme: Chromium applies CSP `form-action` to that redirect, so
    reaching acme's login proves the consent page's policy names acme's origin.
    """
    user = "alice-e2e-acme"
    token = await access_token(user)
    requests = RequestLog()
    context.on("request", requests.record)
    seen: dict[str, Any] = {}
    console: list[str] = []

    async def connect_in_browser(url: str) -> Action:
        async with open_page(context) as page:
            page.on("console", lambda message: console.append(message.text))
            await page.goto(url, timeout=ACTION_TIMEOUT_MS)
            consent = await sign_in(page, idp.issuer, user)
            seen["consent"] = (consent.url, consent.status, await consent.all_headers())
            seen["asks"] = await page.locator("p", has_text="asks to use").inner_text()
            seen["scopes"] = await page.locator("ul.scopes li").all_inner_texts()
            at_acme = await press_continue(page)
            seen["at_acme"] = (at_acme.url, at_acme.status)
            seen["acme_login_form"] = await page.locator('input[name="login"]').count()
            back = await sign_in(page, provider_idp.issuer, ACME_USER)
            seen["back"] = (back.url, back.status, page.url)
            seen["heading"] = await page.locator("h1").inner_text()
            seen["html"] = await page.content()
        return "accept"

    elicitations = UrlElicitations(connect_in_browser)
    async with asyncio.timeout(TEST_DEADLINE), official_client(token, elicitations) as client:
        result = await client.call_tool("connect_account", {"provider": PROVIDER})

    (url,) = elicitations.urls
    flow_id = url.rsplit("/", 1)[1]
    consent_url, consent_status, consent_headers = seen["consent"]
    assert (consent_url, consent_status) == (url, 200)
    assert seen["asks"] == (
        f"A client that calls itself “{CLIENT_INFO.name}” asks to use your Acme account on your "
        "behalf."
    )
    assert seen["scopes"] == ACME_SCOPES
    csp = consent_headers["content-security-policy"]
    assert re.search(r"form-action 'self'[ ;]", csp)
    at_acme_url, at_acme_status = seen["at_acme"]
    assert at_acme_url.startswith(f"{provider_idp.issuer}/interaction/")
    assert (at_acme_status, seen["acme_login_form"]) == (200, 1)
    assert not [line for line in console if "Content Security Policy" in line]
    (authorize, *_) = requests.to(provider_idp.issuer)
    sent = query_of(authorize)
    assert sent["client_id"] == ACME_CLIENT_ID
    assert sent["redirect_uri"] == f"{broker.url}/oauth/{PROVIDER}/callback"
    assert (sent["scope"], sent["code_challenge_method"]) == ("openid profile", "S256")
    assert sent["nonce"] and sent["state"]
    (callback,) = [u for u in requests.to(broker.url) if "/oauth/" in u]
    assert urlsplit(callback).path == f"/oauth/{PROVIDER}/callback"
    assert query_of(callback)["state"] == sent["state"]
    assert seen["back"] == (url, 200, url)  # the address bar keeps neither code= nor state=
    assert urlsplit(seen["back"][2]).query == ""
    assert seen["heading"] == "Acme is connected"
    assert f"Connected as <strong>{ACME_USER}</strong>" in seen["html"]
    assert result_wire(result) == {
        "resultType": "complete",
        "content": [{"type": "text", "text": f"Acme is connected as {ACME_USER}."}],
        "structuredContent": {"provider": PROVIDER, "status": "connected", "account": ACME_USER},
        "isError": False,
        "_meta": {"io.modelcontextprotocol/serverInfo": {"name": "connect-broker", "version": ANY}},
    }
    wire.validate()
    assert wire.result_types() == ["input_required", "complete"]
    assert (await flow_row(db, flow_id) or {})["status"] == "consumed"
    assert await count_rows(db, "connections", subject=user, provider=PROVIDER) == 1
    assert await broker.log_shows(f"credential.stored flow_id={flow_id}")


async def test_d2_wrong_user_never_reaches_the_oauth_provider(
    official_client: OpenClient,
    access_token: Callable[[str], Awaitable[str]],
    context: BrowserContext,
    idp: IdpProcess,
    provider_idp: IdpProcess,
    broker: BrokerProcess,
    wire: WireLog,
    db: AsyncEngine,
) -> None:
    """D2 for an OAuth provider in Chromium: bob gets a refusal for alice's link, no consent
    button, and his browser never asks acme for anything."""
    alice, bob = "alice-e2e-acme-d2", "bob-e2e-acme-d2"
    token = await access_token(alice)
    requests = RequestLog()
    context.on("request", requests.record)
    seen: dict[str, Any] = {}

    async def open_as_bob(url: str) -> Action:
        async with open_page(context) as page:
            await page.goto(url, timeout=ACTION_TIMEOUT_MS)
            landed = await sign_in(page, idp.issuer, bob)
            seen["landed"] = (landed.url, landed.status)
            seen["heading"] = await page.locator("h1").inner_text()
            seen["continue_buttons"] = await page.locator("[data-action=continue]").count()
        seen["flow"] = await flow_row(db, url.rsplit("/", 1)[1])
        return "cancel"

    elicitations = UrlElicitations(open_as_bob)
    async with asyncio.timeout(TEST_DEADLINE), official_client(token, elicitations) as client:
        result = await client.call_tool("connect_account", {"provider": PROVIDER})

    (url,) = elicitations.urls
    flow_id = url.rsplit("/", 1)[1]
    assert seen["landed"] == (url, 403)
    assert seen["heading"] == "This link belongs to a different account"
    assert seen["continue_buttons"] == 0
    assert requests.to(idp.issuer)  # the recorder saw the IdP login, so it was listening
    assert requests.to(provider_idp.issuer) == []
    assert seen["flow"]["status"] == "pending"
    assert seen["flow"]["state_digest"] is None
    assert result.is_error is True
    assert result.structured_content == {"status": "cancelled"}
    result_wire(result)
    wire.validate()
    assert await count_rows(db, "connections", provider=PROVIDER, subject=alice) == 0
    assert await count_rows(db, "connections", provider=PROVIDER, subject=bob) == 0
    assert await broker.log_shows(f"connect.identity_mismatch flow_id={flow_id}")


@asynccontextmanager
async def form_site(csp: str, redirect_to: str, *, refresh: bool) -> AsyncIterator[str]:
    """A page on its own origin with a form under `csp`; the POST answers 303 to `redirect_to`,
    or (`refresh`) a page under the same policy that refreshes to it, as the broker's does."""
    page = b'<!doctype html><title>form</title><form method="post" action="/go">'
    page += b'<button type="submit">go</button></form>'

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1")
        length = re.search(r"(?im)^content-length:\s*(\d+)", head)
        if length:
            await reader.readexactly(int(length.group(1)))
        onward = f'<meta http-equiv="refresh" content="0; url={redirect_to}">'.encode()
        if head.startswith("POST") and refresh:
            reply = (
                f"HTTP/1.1 200 OK\r\nContent-Type: text/html\r\nContent-Security-Policy: {csp}\r\n"
                f"Content-Length: {len(onward)}\r\n"
            )
        elif head.startswith("POST"):
            reply = f"HTTP/1.1 303 See Other\r\nLocation: {redirect_to}\r\nContent-Length: 0\r\n"
        else:
            reply = (
                f"HTTP/1.1 200 OK\r\nContent-Type: text/html\r\nContent-Security-Policy: {csp}\r\n"
                f"Content-Length: {len(page)}\r\n"
            )
        writer.write(reply.encode() + b"Connection: close\r\n\r\n")
        if not head.startswith("POST"):
            writer.write(page)
        elif refresh:
            writer.write(onward)
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(answer, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}/"
    finally:
        server.close()
        await server.wait_closed()


async def post_form(page: Page) -> str:
    """Click the form's button; the URL the browser lands on past the form's own answer, or the
    error that stopped it."""
    try:
        async with page.expect_navigation(
            url=lambda url: not url.endswith("/go"), timeout=ACTION_TIMEOUT_MS
        ) as navigation:
            await page.click("button", timeout=ACTION_TIMEOUT_MS)
        landed = await navigation.value
    except PlaywrightError as error:  # a blocked navigation is aborted, not answered
        return error.message.splitlines()[0]
    return landed.url if landed else page.url


@asynccontextmanager
async def hop(to: str) -> AsyncIterator[str]:
    """An origin that redirects every request to `to`: a provider whose sign-in passes through
    another origin (a company's single sign-on, a consumer-account login)."""

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(
            f"HTTP/1.1 302 Found\r\nLocation: {to}\r\nContent-Length: 0\r\n"
            "Connection: close\r\n\r\n".encode()
        )
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(answer, "127.0.0.1", 0)
    try:
        yield f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    finally:
        server.close()
        await server.wait_closed()


@pytest.mark.parametrize(
    ("refresh", "allow_hop", "reached"),
    [(False, False, False), (False, True, False), (True, False, True)],
    ids=["303-self-only", "303-first-origin-allowed", "refresh-self-only"],
)
async def test_h7_control_chromium_checks_form_action_at_every_redirect_after_a_post(
    context: BrowserContext,
    provider_idp: IdpProcess,
    refresh: bool,
    allow_hop: bool,
    reached: bool,
) -> None:
    """H7 control, and why the consent form's answer is a refreshing page. Chromium stops a
    form's 303 to an origin `form-action` leaves out, and also any later redirect to such an
    origin, even when the first one was allowed: with a 303, a provider whose sign-in passes
    through another origin could never be reached. A page that refreshes is a navigation of its
    own: it reaches that provider under `form-action 'self'`."""
    target = f"{provider_idp.issuer}/.well-known/openid-configuration"
    requests = RequestLog()
    context.on("request", requests.record)
    console: list[str] = []

    async with asyncio.timeout(TEST_DEADLINE), hop(target) as provider:
        csp = "form-action 'self'" + (f" {provider}" if allow_hop else "")
        async with (
            form_site(csp, f"{provider}/authorize", refresh=refresh) as site,
            open_page(context) as page,
        ):
            page.on("console", lambda message: console.append(message.text))
            await page.goto(site, timeout=ACTION_TIMEOUT_MS)
            landed = await post_form(page)

    assert f"{site}go" in requests.urls  # the form was posted each time
    assert (f"{provider}/authorize" in requests.urls) is (refresh or allow_hop)
    assert (landed == target) is reached, landed
    assert (requests.to(provider_idp.issuer) == [target]) is reached
    assert any("violates" in line and "form-action" in line for line in console) is not reached


# --------------------------------------------------------------------------------------------
# The same provider over plain HTTP: what the broker asks acme for, and what it accepts back
# --------------------------------------------------------------------------------------------


async def start_flow(mcp: McpHttp, token: str) -> tuple[dict[str, Any], str, str]:
    """Round 1: (result, input key, flow id)."""
    body = (await mcp.call_tool(token, "connect_account", {"provider": PROVIDER})).json()
    validate_response(body, "InputRequiredResult")
    key, flow_id = flow_id_from(body["result"])
    return body["result"], key, flow_id


async def continue_to_acme(browser: Browser, flow_id: str) -> str:
    """Press "Continue" on the consent page; the authorize URL the broker sends the browser to."""
    csrf = await browser.csrf_token(f"/connect/{flow_id}")
    started = await browser.post(f"/connect/{flow_id}/start", data={"csrf": csrf})
    return provider_url(started)


async def come_back_from_acme(browser: Browser, authorize_url: str) -> httpx2.Response:
    """Sign in at acme as ACME_USER and deliver its redirect to the broker's callback."""
    redirect = await idp_login(browser.http, authorize_url, user=ACME_USER)
    location = urlsplit(redirect.headers["location"])
    assert location.path == f"/oauth/{PROVIDER}/callback", redirect.headers["location"]
    return await browser.get(location.path, params=parse_qs(location.query))


def with_nonce(url: str, nonce: str | None) -> str:
    """The authorize URL with its nonce replaced (or removed, for None)."""
    parts = urlsplit(url)
    params = [(k, v) for k, v in parse_qsl(parts.query) if k != "nonce"]
    if nonce is not None:
        params.append(("nonce", nonce))
    return urlunsplit(parts._replace(query=urlencode(params)))


async def test_acme_authorize_request_carries_a_nonce_and_the_flow_completes(
    mcp: McpHttp,
    token_for: Any,
    browser: Browser,
    broker: BrokerProcess,
    provider_idp: IdpProcess,
    db: AsyncEngine,
) -> None:
    """OIDC Core §3.1.2.1, §3.1.3.7: an oidc provider is asked with a nonce, and the ID token that
    comes back (signed by acme, for broker-acme, with that nonce) is accepted."""
    user = "alice-http-acme"
    token = token_for(user)
    first, key, flow_id = await start_flow(mcp, token)
    await browser.login_as(user, next_path=f"/connect/{flow_id}")

    authorize = await continue_to_acme(browser, flow_id)
    callback = await come_back_from_acme(browser, authorize)
    done = await browser.get(callback.headers["location"])
    retry = await mcp.call_tool(
        token,
        "connect_account",
        {"provider": PROVIDER},
        input_responses={key: {"action": "accept"}},
        request_state=first["requestState"],
    )

    sent = query_of(authorize)
    assert authorize.startswith(f"{provider_idp.issuer}/")
    assert len(sent["nonce"]) >= 32 and sent["nonce"] != sent["state"]
    assert sent["client_id"] == ACME_CLIENT_ID
    assert (sent["response_type"], sent["code_challenge_method"]) == ("code", "S256")
    assert callback.status_code == 303
    assert callback.headers["location"] == f"/connect/{flow_id}"
    assert f"Connected as <strong>{ACME_USER}</strong>" in done.text
    validate_response(retry.json(), "CallToolResult")
    assert retry.json()["result"]["structuredContent"] == {
        "provider": PROVIDER,
        "status": "connected",
        "account": ACME_USER,
    }
    assert (await flow_row(db, flow_id) or {})["status"] == "consumed"
    assert await count_rows(db, "connections", subject=user, provider=PROVIDER) == 1


@pytest.mark.parametrize("nonce", ["attacker-chosen-nonce-0123456789abcdef", None])
async def test_t3_an_id_token_without_the_brokers_nonce_is_refused_and_nothing_is_stored(
    mcp: McpHttp,
    token_for: Any,
    browser: Browser,
    broker: BrokerProcess,
    db: AsyncEngine,
    nonce: str | None,
) -> None:
    """T3 for OpenID providers: a code from an authorize request the broker did not make (here
    its nonce changed or dropped) brings an ID token that is not ours; nothing is stored and the
    user can start again."""
    user = f"alice-http-acme-nonce-{'forged' if nonce else 'missing'}"
    _, _, flow_id = await start_flow(mcp, token_for(user))
    await browser.login_as(user, next_path=f"/connect/{flow_id}")

    authorize = await continue_to_acme(browser, flow_id)
    refused = await come_back_from_acme(browser, with_nonce(authorize, nonce))
    after = await browser.get(refused.headers["location"])
    failed_row = await flow_row(db, flow_id) or {}
    stored_after_failure = await count_rows(db, "connections", subject=user)
    again = await come_back_from_acme(browser, await continue_to_acme(browser, flow_id))
    done = await browser.get(again.headers["location"])

    assert refused.status_code == 303
    assert refused.headers["location"] == f"/connect/{flow_id}"
    assert (failed_row["status"], failed_row["failure"]) == ("pending", "id_token_invalid")
    assert stored_after_failure == 0
    assert "Acme had a problem completing the connection. Nothing was stored" in after.text
    assert 'data-action="continue"' in after.text
    assert await broker.log_shows(
        f"token_exchange.failed flow_id={flow_id} reason=id_token_invalid"
    )
    assert f"Connected as <strong>{ACME_USER}</strong>" in done.text
    assert await count_rows(db, "connections", subject=user, provider=PROVIDER) == 1
