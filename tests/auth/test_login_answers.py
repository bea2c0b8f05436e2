"""What /login, /login/callback and /logout answer besides their pages: the 303s that carry the
login's secrets in a URL, and a sign-out form Starlette cannot parse.

`/login`'s 303 sends the browser to the IdP with the state and nonce in `Location`, and the
callback's 303 answers a URL holding the code and state: both carry the page headers (not
cached, no Referer), as the provider callback's do. A sign-out form with too many fields or a
broken multipart body is refused by Starlette before the route's code runs: the answer is the
error page with its security headers and a next step, not `{"detail": …}` JSON, and the session
stays.
"""

from __future__ import annotations

import httpx2
import pytest

from ..connect import unique
from ..connect.test_pages import assert_security_headers
from ..support.clients import Browser
from .test_login import complete_login


def assert_page_headers_on_redirect(label: str, response: httpx2.Response) -> None:
    assert response.status_code == 303, (label, response.status_code)
    assert response.headers.get("cache-control") == "no-store", label
    assert response.headers.get("referrer-policy") == "no-referrer", label
    assert response.headers.get("x-content-type-options") == "nosniff", label


async def test_the_login_redirects_are_neither_cached_nor_sent_on_as_referer(
    browser: Browser,
) -> None:
    start, callback = await complete_login(browser, unique("alice-303"))

    assert "state=" in start.headers["location"] and "nonce=" in start.headers["location"]
    assert_page_headers_on_redirect("GET /login", start)
    assert_page_headers_on_redirect("GET /login/callback", callback)
    assert callback.headers["location"] == "/connections"


@pytest.mark.parametrize(
    ("content", "content_type"),
    [
        (b"csrf=x&f0=x&f1=x&f2=x&f3=x", "application/x-www-form-urlencoded"),
        (b"x", "multipart/form-data"),  # no boundary
    ],
    ids=["too-many-fields", "multipart-without-boundary"],
)
async def test_a_sign_out_form_that_cannot_be_read_gets_the_error_page(
    content: bytes, content_type: str, browser: Browser
) -> None:
    await browser.login_as(unique("alice-form"))

    response = await browser.post(
        "/logout", content=content, headers={"Content-Type": content_type}
    )
    still = await browser.get("/connections")

    assert response.status_code == 400
    assert_security_headers("POST /logout", response)
    assert "This request could not be read" in response.text
    assert "nothing was changed" in response.text
    assert "reload the page and try again" in response.text
    assert "detail" not in response.text
    assert still.status_code == 200  # still signed in
