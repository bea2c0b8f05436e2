"""A sign-in the IdP refuses because of the broker's own client credentials: the operator finds
the reason in the log (never the secret), the visitor the usual "sign-in did not complete" page."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from ..connect import local
from ..support.broker import BrokerProcess
from ..support.clients import Browser
from ..support.idp import idp_login
from ..support.stack import running_stack

WRONG_SECRET = "wrong-login-secret-9f2c"


@pytest.fixture(scope="module")
def misconfigured_broker(workdir: Path) -> Iterator[BrokerProcess]:
    idp = {"login_secret": "right-secret"}
    with running_stack(workdir, "wrong-secret", idp=idp, login_client_secret=WRONG_SECRET) as stack:
        yield stack.broker


async def test_a_refused_login_client_is_logged_with_the_idps_reason(
    misconfigured_broker: BrokerProcess,
) -> None:
    browser = Browser(misconfigured_broker.url)
    try:
        start = await browser.get("/login")
        back = await idp_login(browser.http, start.headers["location"], user="dana")
        page = await browser.get(local(back.headers["location"]))
    finally:
        await browser.aclose()

    log = await misconfigured_broker.wait_for_log("login.client_refused")
    assert (
        "login.client_refused idp_error=invalid_client: the IdP refused the broker's login "
        "client; check identity.login_client_id and identity.login_client_secret against the "
        "client registered at the IdP (its secret, and its token endpoint auth method)"
    ) in log
    assert page.status_code == 400
    assert "Sign-in did not complete" in page.text
    assert WRONG_SECRET not in misconfigured_broker.log()
    assert "invalid_client" not in page.text
