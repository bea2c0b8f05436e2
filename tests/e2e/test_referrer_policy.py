"""The pages' referrer policy in Chromium (templates/base.html, docs/security.md).

An error page can be shown at a callback URL, whose query holds the IdP's or the provider's
`code` and `state`: nothing that page loads may carry that query as its Referer (a reverse proxy
logging Referer would keep it). The same policy must leave the pages' own form POSTs a real
`Origin`, which the same-origin check of every POST reads when a browser sends no Fetch Metadata.
"""

from __future__ import annotations

from playwright.async_api import BrowserContext, Request

from ..support.broker import BrokerProcess
from ..support.idp import IdpProcess
from .chromium import open_page, sign_in
from .conftest import ACTION_TIMEOUT_MS

SESSION_COOKIE = "__Host-broker_session"
CODE, STATE = "CANARYCODE-e2e-referrer", "CANARYSTATE-e2e-referrer"


async def test_an_error_page_at_a_callback_url_never_sends_its_query_as_referer(
    context: BrowserContext, broker: BrokerProcess
) -> None:
    """No login cookie and no flow: both callbacks answer an error page, at the URL with the
    code and state, that loads the stylesheet."""
    query = f"?code={CODE}&state={STATE}"
    pages = [f"{broker.url}/login/callback{query}", f"{broker.url}/oauth/acme/callback{query}"]
    sent: list[Request] = []
    statuses = []
    async with open_page(context) as page:
        page.on("request", lambda request: sent.append(request))
        for url in pages:
            response = await page.goto(url, timeout=ACTION_TIMEOUT_MS)
            assert response is not None
            statuses.append(response.status)
        headers = [(request.url, await request.all_headers()) for request in sent]

    assert all(status >= 400 for status in statuses), statuses
    loaded = [(url, found) for url, found in headers if url not in pages]
    assert [url for url, _ in loaded] == [f"{broker.url}/static/broker.css"] * 2
    for url, found in headers:
        referer = found.get("referer", "")
        assert CODE not in referer and STATE not in referer, (url, referer)
    assert [found.get("referer") for _, found in loaded] == [f"{broker.url}/"] * 2


async def test_sign_out_posts_with_the_real_origin_and_ends_the_session(
    context: BrowserContext, broker: BrokerProcess, idp: IdpProcess
) -> None:
    """The "Switch account" form of /connections, submitted by Chromium: same-origin, with the
    broker's origin as `Origin` (not `null`) and no path in its Referer."""
    posts: list[Request] = []
    async with open_page(context) as page:
        page.on(
            "request", lambda request: posts.append(request) if request.method == "POST" else None
        )
        await page.goto(f"{broker.url}/login?next=/connections", timeout=ACTION_TIMEOUT_MS)
        landed = await sign_in(page, idp.issuer, "alice-e2e-referrer")
        async with page.expect_navigation(timeout=ACTION_TIMEOUT_MS) as navigation:
            await page.click('form[action="/logout"] button', timeout=ACTION_TIMEOUT_MS)
        signed_out = await navigation.value
        assert signed_out is not None
        text = await page.locator("h1").inner_text(timeout=ACTION_TIMEOUT_MS)
        (logout,) = [request for request in posts if request.url == f"{broker.url}/logout"]
        sent = await logout.all_headers()
    cookies = {cookie.get("name") for cookie in await context.cookies(broker.url)}

    assert landed.url == f"{broker.url}/connections"
    assert (signed_out.status, text) == (200, "You are signed out")
    assert sent["origin"] == broker.url
    assert sent.get("referer") == f"{broker.url}/"
    assert SESSION_COOKIE not in cookies
