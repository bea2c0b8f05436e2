"""Browser steps shared by the end-to-end tests."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from playwright.async_api import BrowserContext, Page, Response

from .conftest import ACTION_TIMEOUT_MS

MAX_IDP_PAGES = 4  # login, and a consent page if the IdP shows one


@asynccontextmanager
async def open_page(context: BrowserContext) -> AsyncIterator[Page]:
    page = await context.new_page()
    try:
        yield page
    finally:
        await page.close()


async def sign_in(page: Page, issuer: str, user: str) -> Response:
    """On an oidc-provider login page, sign in as `user`; the response the browser lands on.

    devInteractions shows a login form (any password), then a consent form if the IdP wants one
    (ours grant on their own, so normally none appears; if one does, it is submitted).
    """
    for _ in range(MAX_IDP_PAGES):
        assert page.url.startswith(f"{issuer}/"), f"not at {issuer}: {page.url}"
        login = page.locator('input[name="login"]')
        if await login.count():
            await login.fill(user, timeout=ACTION_TIMEOUT_MS)
            await page.fill('input[name="password"]', "any-password", timeout=ACTION_TIMEOUT_MS)
        async with page.expect_navigation(timeout=ACTION_TIMEOUT_MS) as navigation:
            await page.click('button[type="submit"]', timeout=ACTION_TIMEOUT_MS)
        landed = await navigation.value
        assert landed is not None
        if not landed.url.startswith(issuer):
            return landed
    raise AssertionError(f"still at {issuer} after {MAX_IDP_PAGES} pages: {page.url}")


def _past_the_broker_start(url: str) -> bool:
    return not url.endswith("/start")


async def press_continue(page: Page) -> Response:
    """Press "Continue" on the consent page: the broker answers a page that refreshes to the
    provider; the response at the end of the navigations that follow (the provider's page, or
    the broker's own once the provider sent the browser back)."""
    async with page.expect_navigation(
        url=_past_the_broker_start, timeout=ACTION_TIMEOUT_MS
    ) as navigation:
        await page.click("[data-action=continue]", timeout=ACTION_TIMEOUT_MS)
    landed = await navigation.value
    assert landed is not None
    return landed
