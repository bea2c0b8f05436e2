"""Third-party failures during the OAuth legs of a connect flow (SECURITY.md F1-F10).

The fake GitHub answers the token endpoint badly in one way per test. Whatever it does, the broker
spends the code once, stores nothing, logs a reason (never the body), puts the flow back to
`pending` and shows the user a page that says what happened with a button to try again.
F2, F3 and F10 use a dedicated broker whose GitHub provider has a 2 s deadline; so does R6
(SECURITY.md §4.3), a token endpoint hanging for many users at once while another is served.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import threading
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx2
import pytest
from sqlalchemy.ext.asyncio import AsyncEngine

from app.db import create_engine

from ..conftest import DEMO_PROVIDER, count_rows, flow_row, github_provider
from ..support.broker import BrokerProcess, LogWindow
from ..support.clients import Browser, McpHttp, provider_url
from ..support.fake_github import FakeGitHub, TokenFault
from ..support.http import local_client
from ..support.idp import IdpProcess, free_port, mint_token
from ..support.local_http import LocalServer, QuietHandler
from ..support.stack import running_stack
from .flows import (
    authorize,
    code_of,
    elicit,
    press_continue,
    return_to_broker,
    tool_result,
)
from .helpers import unique as fresh_user

pytestmark = pytest.mark.both_databases

DEADLINE_SECONDS = 2.0  # the dedicated broker's provider timeout_seconds
SLACK_SECONDS = 3.0  # process and network overhead allowed on top of a deadline
TRY_AGAIN = "GitHub had a problem completing the connection. Nothing was stored; try again."
NO_USABLE_TOKEN = "GitHub granted no token for your own account"
TOO_SLOW = "GitHub did not answer in time. Nothing was stored; try again."
CONTINUE_BUTTON = 'data-action="continue"'


@pytest.fixture(autouse=True)
def _fresh_fake(fake_github: FakeGitHub) -> Iterator[None]:
    """The session fake keeps counters and faults: every test starts (and leaves) it clean."""
    fake_github.reset()
    yield
    fake_github.reset()


async def at_callback(
    mcp: McpHttp, browser: Browser, token: str, user: str, provider: str = "github"
) -> tuple[str, str]:
    """A flow the user approved at the provider: (flow id, callback URL not yet delivered)."""
    round_one = await elicit(mcp, token, {"provider": provider})
    await browser.login_as(user, next_path=f"/connect/{round_one.flow_id}")
    return round_one.flow_id, await authorize(browser, round_one.flow_id)


async def assert_nothing_stored(db: AsyncEngine, flow_id: str, user: str, *, reason: str) -> None:
    """The failed exchange put the flow back to `pending` with its reason; no credential."""
    row = await flow_row(db, flow_id) or {}
    assert row["status"] == "pending", row
    assert row["failure"] == reason
    assert row["sealed_pkce_verifier"] is None
    assert await count_rows(db, "connections", subject=user) == 0


async def test_f1_token_endpoint_500_fails_once_and_a_new_start_completes_the_flow(
    mcp: McpHttp,
    token_for: Any,
    browser: Browser,
    fake_github: FakeGitHub,
    db: AsyncEngine,
    broker: BrokerProcess,
) -> None:
    """F1. A provider error is not retried (the code may be spent): one token call, nothing
    stored, the flow is pending again and "Continue" starts over with a new state."""
    user = fresh_user("f1")
    flow_id, callback_url = await at_callback(mcp, browser, token_for(user), user)
    first_state = fake_github.authorize_requests[-1]["state"]
    fake_github.token_fault = "500"
    log = LogWindow(broker)

    callback = await return_to_broker(browser, callback_url)
    page = await browser.get(f"/connect/{flow_id}")
    token_calls = fake_github.token_calls
    await assert_nothing_stored(db, flow_id, user, reason="token_status_500")
    fake_github.reset()
    again = await return_to_broker(browser, await authorize(browser, flow_id))
    done = await browser.get(f"/connect/{flow_id}")

    assert callback.status_code == 303 and callback.headers["location"] == f"/connect/{flow_id}"
    assert token_calls == 1
    assert page.status_code == 200
    assert TRY_AGAIN in page.text and CONTINUE_BUTTON in page.text
    assert await log.shows(f"token_exchange.failed flow_id={flow_id} reason=token_status_500")
    assert fake_github.authorize_requests[-1]["state"] != first_state
    assert again.status_code == 303
    assert "Connected as <strong>@octocat</strong>" in done.text
    assert (await flow_row(db, flow_id) or {})["status"] == "completed"
    assert await count_rows(db, "connections", subject=user, provider="github") == 1


@pytest.mark.parametrize(
    ("fault", "content_type"), [("html", "text/html"), ("truncated", "application/json")]
)
async def test_f4_malformed_token_response_fails_and_only_its_type_and_length_are_logged(
    fault: TokenFault,
    content_type: str,
    mcp: McpHttp,
    token_for: Any,
    browser: Browser,
    fake_github: FakeGitHub,
    db: AsyncEngine,
    broker: BrokerProcess,
) -> None:
    """F4. An unparseable body fails the exchange; the log says what it was, never what it said
    (a truncated body still carries part of the token)."""
    user = fresh_user("f4")
    flow_id, callback_url = await at_callback(mcp, browser, token_for(user), user)
    fake_github.token_fault = fault
    log = LogWindow(broker)

    callback = await return_to_broker(browser, callback_url)
    page = await browser.get(f"/connect/{flow_id}")

    assert callback.status_code == 303
    await assert_nothing_stored(db, flow_id, user, reason="malformed_response")
    assert TRY_AGAIN in page.text and CONTINUE_BUTTON in page.text
    logged = await log.wait_for(f"oauth.response status=200 type={content_type} bytes=")
    assert re.search(rf"oauth\.response status=200 type={content_type} bytes=[1-9]\d*\n", logged)
    assert "Unicorn" not in logged and "gho_CANARYTOKEN" not in logged
    assert '{"access_token"' not in logged


async def test_f5_code_refused_in_a_200_body_fails_the_exchange(
    mcp: McpHttp,
    token_for: Any,
    browser: Browser,
    fake_github: FakeGitHub,
    db: AsyncEngine,
    broker: BrokerProcess,
) -> None:
    """F5 (and T3a). GitHub refuses a spent code or a wrong PKCE verifier with HTTP 200 and
    `bad_verification_code`: the broker reads the body, not just the status."""
    user = fresh_user("f5")
    flow_id, callback_url = await at_callback(mcp, browser, token_for(user), user)
    async with local_client() as http:  # someone spends the code first
        spent = await http.post(
            fake_github.token_url,
            data={
                "code": code_of(callback_url),
                "code_verifier": "not-the-flows-verifier",
                "client_id": fake_github.client_id,
                "client_secret": fake_github.client_secret,
            },
            headers={"Accept": "application/json"},
        )
    log = LogWindow(broker)

    callback = await return_to_broker(browser, callback_url)
    page = await browser.get(f"/connect/{flow_id}")

    assert spent.status_code == 200 and spent.json()["error"] == "bad_verification_code"
    assert callback.status_code == 303
    assert fake_github.token_calls == 2
    await assert_nothing_stored(db, flow_id, user, reason="provider_error:bad_verification_code")
    assert TRY_AGAIN in page.text
    assert await log.shows("reason=provider_error:bad_verification_code")


@pytest.mark.parametrize(
    ("fault", "reason"),
    [("missing_token", "missing_access_token"), ("mac", "unsupported_token_type")],
)
async def test_f6_success_without_a_usable_bearer_token_stores_nothing(
    fault: TokenFault,
    reason: str,
    mcp: McpHttp,
    token_for: Any,
    browser: Browser,
    fake_github: FakeGitHub,
    db: AsyncEngine,
) -> None:
    """F6. A 200 without `access_token`, or with a token type other than bearer, is a failure:
    no empty or unusable credential is stored, and the page says what went wrong."""
    user = fresh_user("f6")
    flow_id, callback_url = await at_callback(mcp, browser, token_for(user), user)
    fake_github.token_fault = fault

    callback = await return_to_broker(browser, callback_url)
    page = await browser.get(f"/connect/{flow_id}")

    assert callback.status_code == 303
    assert fake_github.token_calls == 1
    await assert_nothing_stored(db, flow_id, user, reason=reason)
    assert NO_USABLE_TOKEN in page.text
    assert "Nothing was stored" in page.text


async def test_f7_huge_token_response_is_cut_off_at_the_size_cap(
    mcp: McpHttp,
    token_for: Any,
    browser: Browser,
    fake_github: FakeGitHub,
    db: AsyncEngine,
    broker: BrokerProcess,
) -> None:
    """F7. A 5 MB answer is not read to the end: the exchange stops at 64 KiB and fails."""
    user = fresh_user("f7")
    flow_id, callback_url = await at_callback(mcp, browser, token_for(user), user)
    fake_github.token_fault = "huge"
    log = LogWindow(broker)

    callback = await return_to_broker(browser, callback_url)

    assert callback.status_code == 303
    await assert_nothing_stored(db, flow_id, user, reason="response_too_large")
    assert await log.shows(f"token_exchange.failed flow_id={flow_id} reason=response_too_large")
    assert "xxxxxxxx" not in log.text()


async def test_f8_redirect_to_the_metadata_address_is_not_followed(
    mcp: McpHttp,
    token_for: Any,
    browser: Browser,
    fake_github: FakeGitHub,
    db: AsyncEngine,
    broker: BrokerProcess,
) -> None:
    """F8 (T16). A 302 from the token endpoint fails the exchange as a redirect; no request
    goes to 169.254.169.254 (following it would end as a network error or a timeout)."""
    user = fresh_user("f8")
    flow_id, callback_url = await at_callback(mcp, browser, token_for(user), user)
    fake_github.token_fault = "redirect"
    log = LogWindow(broker)

    started = time.monotonic()
    callback = await return_to_broker(browser, callback_url)
    elapsed = time.monotonic() - started

    assert callback.status_code == 303
    assert elapsed < SLACK_SECONDS
    await assert_nothing_stored(db, flow_id, user, reason="redirect_302")
    assert await log.shows("oauth.response status=302")
    assert await log.shows(f"token_exchange.failed flow_id={flow_id} reason=redirect_302")
    assert "169.254.169.254" not in log.text()


async def test_f9_failed_profile_call_keeps_the_connection_without_a_name(
    mcp: McpHttp,
    token_for: Any,
    browser: Browser,
    fake_github: FakeGitHub,
    db: AsyncEngine,
    broker: BrokerProcess,
) -> None:
    """F9, policy A (our decision): the token is good, so the connection is stored; the page
    says "connected" without a login name and the failure is logged as a warning."""
    user = fresh_user("f9")
    token = token_for(user)
    round_one = await elicit(mcp, token)
    await browser.login_as(user, next_path=f"/connect/{round_one.flow_id}")
    callback_url = await authorize(browser, round_one.flow_id)
    fake_github.user_fault = "500"
    log = LogWindow(broker)

    callback = await return_to_broker(browser, callback_url)
    page = await browser.get(f"/connect/{round_one.flow_id}")
    retry = await mcp.call_tool(
        token,
        "connect_account",
        {"provider": "github"},
        input_responses={round_one.key: {"action": "accept"}},
        request_state=round_one.request_state,
    )

    assert callback.status_code == 303
    assert fake_github.user_calls == 1
    assert "GitHub is connected" in page.text and "Connected as" not in page.text
    assert await log.shows(
        "WARNING broker.providers oauth.account_label_failed provider=GitHub reason=status_500"
    )
    assert tool_result(retry)["structuredContent"] == {
        "provider": "github",
        "status": "connected",
        "account": None,
    }
    assert await count_rows(db, "connections", subject=user, provider="github") == 1


# ------------------------------------------------------------------------------------------------
# F2, F3, F10: a dedicated broker with a short provider deadline and a provider that is down
# ------------------------------------------------------------------------------------------------


HOLD_SECONDS = 8.0  # below the broker's 10 s read timeout for provider documents


@dataclass
class HangingIssuer:
    """An OpenID issuer at `url` that holds every request (its discovery document first) until
    `release` is set, at most HOLD_SECONDS, then answers 503."""

    url: str = ""
    requests: int = 0
    release: threading.Event = field(default_factory=threading.Event)


@contextlib.contextmanager
def hanging_issuer() -> Iterator[HangingIssuer]:
    issuer = HangingIssuer()

    class Handler(QuietHandler):
        def do_GET(self) -> None:
            issuer.requests += 1
            issuer.release.wait(HOLD_SECONDS)
            self.answer(503)

    with LocalServer(Handler, name="hanging-issuer") as server:
        issuer.url = server.url
        try:
            yield issuer
        finally:
            issuer.release.set()


@dataclass(frozen=True)
class Dedicated:
    idp: IdpProcess
    broker: BrokerProcess
    fake: FakeGitHub
    slow_issuer: HangingIssuer


DEDICATED_POOL_SIZE = 2  # pool_size: as many connections again may overflow


@pytest.fixture(scope="module")
def dedicated(workdir: Any) -> Iterator[Dedicated]:
    """A broker whose `github` gives up after 2 s, whose `ghdown` points at a closed port and
    whose `oidc` provider `slowdisco` has an issuer that holds its requests (and an API-key
    `demo`; a database pool of 2), with its own IdP (which knows its login callback) and its own
    fake GitHub."""
    port = free_port()
    down = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    redirect_uri = f"http://127.0.0.1:{port}/oauth/github/callback"
    with (
        FakeGitHub(redirect_uri=redirect_uri) as fake,
        hanging_issuer() as slow_issuer,
    ):
        github = {**github_provider(fake), "timeout_seconds": DEADLINE_SECONDS}
        slowdisco = {
            "kind": "oidc",
            "display_name": "Slow Discovery",
            "issuer": slow_issuer.url,
            "client_id": "broker-slowdisco",
            "client_secret": "slowdisco-client-secret",
            "scopes": ["openid"],
        }
        ghdown = {
            **github_provider(fake),
            "display_name": "GitHub Down",
            "authorize_url": f"{down}/login/oauth/authorize",
            "token_url": f"{down}/login/oauth/access_token",
        }
        providers = {
            "github": github,
            "ghdown": ghdown,
            "slowdisco": slowdisco,
            "demo": DEMO_PROVIDER,
        }
        with running_stack(
            workdir,
            "deadline",
            port=port,
            providers=providers,
            # R6: fewer than the exchanges it holds up
            extra={"database": {"pool_size": DEDICATED_POOL_SIZE}},
        ) as stack:
            yield Dedicated(stack.idp, stack.broker, fake, slow_issuer)


@dataclass(frozen=True)
class DedicatedClients:
    mcp: McpHttp
    browser: Browser
    db: AsyncEngine
    fake: FakeGitHub

    def token(self, dedicated: Dedicated, user: str) -> str:
        return mint_token(
            dedicated.idp.signing_jwk,
            issuer=dedicated.idp.issuer,
            audience=dedicated.broker.mcp_url,
            subject=user,
        )


@pytest.fixture
async def clients(dedicated: Dedicated) -> AsyncIterator[DedicatedClients]:
    dedicated.fake.reset()
    engine = create_engine(dedicated.broker.database_url, pool_size=1)
    mcp, browser = McpHttp(dedicated.broker.mcp_url), Browser(dedicated.broker.url)
    yield DedicatedClients(mcp, browser, engine, dedicated.fake)
    dedicated.fake.reset()  # releases a slow response still pending at the fake
    await mcp.aclose()
    await browser.aclose()
    await engine.dispose()


@pytest.mark.parametrize(("fault", "case"), [("timeout", "F2"), ("trickle", "F3")])
async def test_f2_f3_slow_token_endpoint_is_abandoned_at_the_total_deadline(
    fault: TokenFault, case: str, dedicated: Dedicated, clients: DedicatedClients
) -> None:
    """F2 (no answer for 60 s) and F3 (1 byte/s): httpx timeouts are per read, so only the
    total deadline (2 s here) bounds the exchange; the page then says to try again."""
    user = fresh_user(case.lower())
    token = clients.token(dedicated, user)
    flow_id, callback_url = await at_callback(clients.mcp, clients.browser, token, user)
    clients.fake.token_fault = fault
    log = LogWindow(dedicated.broker)

    started = time.monotonic()
    callback = await return_to_broker(clients.browser, callback_url)
    elapsed = time.monotonic() - started
    page = await clients.browser.get(f"/connect/{flow_id}")

    assert callback.status_code == 303
    assert DEADLINE_SECONDS <= elapsed < DEADLINE_SECONDS + SLACK_SECONDS
    await assert_nothing_stored(clients.db, flow_id, user, reason="timeout")
    assert TOO_SLOW in page.text and CONTINUE_BUTTON in page.text
    assert await log.shows(f"token_exchange.failed flow_id={flow_id} reason=timeout")


async def test_f10_unreachable_authorize_endpoint_still_gets_a_303_and_the_flow_waits(
    dedicated: Dedicated, clients: DedicatedClients
) -> None:
    """F10. The broker does not call the authorize endpoint: it answers 303 and it is the
    browser that fails; the flow stays `authorizing` until it expires."""
    user = fresh_user("f10")
    token = clients.token(dedicated, user)
    round_one = await elicit(clients.mcp, token, {"provider": "ghdown"})
    await clients.browser.login_as(user, next_path=f"/connect/{round_one.flow_id}")

    started = await press_continue(clients.browser, round_one.flow_id)
    with pytest.raises(httpx2.ConnectError):
        await clients.browser.http.get(provider_url(started))

    assert provider_url(started).startswith(
        dedicated.broker.config.providers["ghdown"]["authorize_url"] + "?"
    )
    row = await flow_row(clients.db, round_one.flow_id) or {}
    assert row["status"] == "authorizing" and row["failure"] is None
    assert await count_rows(clients.db, "connections", subject=user) == 0


async def test_t21_starts_waiting_for_a_provider_s_discovery_hold_no_database_connection(
    dedicated: Dedicated, clients: DedicatedClients
) -> None:
    """T21 (slow provider responses). The first start of an `oidc` provider's flow fetches the
    provider's discovery document. While as many starts as the broker's pool has connections
    wait on an issuer that does not answer, another user's page still loads (it needs the
    database); released, each start says the provider could not be reached, and its flow is
    still `pending`, ready to be started again."""
    issuer = dedicated.slow_issuer
    users = [fresh_user("t21-disco") for _ in range(2 * DEDICATED_POOL_SIZE)]
    browsers = [Browser(dedicated.broker.url) for _ in users]
    other = Browser(dedicated.broker.url)
    try:
        flow_ids = []
        for browser, user in zip(browsers, users, strict=True):
            round_one = await elicit(
                clients.mcp, clients.token(dedicated, user), {"provider": "slowdisco"}
            )
            await browser.login_as(user, next_path=f"/connect/{round_one.flow_id}")
            flow_ids.append(round_one.flow_id)
        await other.login_as(fresh_user("t21-other"))
        csrfs = [
            await browser.csrf_token(f"/connect/{flow_id}")
            for browser, flow_id in zip(browsers, flow_ids, strict=True)
        ]
        starts = [
            asyncio.create_task(browser.post(f"/connect/{flow_id}/start", data={"csrf": csrf}))
            for browser, flow_id, csrf in zip(browsers, flow_ids, csrfs, strict=True)
        ]
        async with asyncio.timeout(5):
            while issuer.requests < 1:
                await asyncio.sleep(0.02)
        await asyncio.sleep(0.5)  # every start is in, waiting on that one fetch

        page = await other.get("/connections")
        all_waiting = not any(start.done() for start in starts)
        issuer.release.set()
        answers = await asyncio.gather(*starts)
        rows = [await flow_row(clients.db, flow_id) or {} for flow_id in flow_ids]
    finally:
        issuer.release.set()
        for browser in [*browsers, other]:
            await browser.aclose()

    assert page.status_code == 200, page.text
    assert all_waiting
    assert [answer.status_code for answer in answers] == [502] * len(users)
    assert "The provider could not be reached" in answers[0].text
    assert [row["status"] for row in rows] == ["pending"] * len(users)


HANGING_EXCHANGES = 10
IN_FLIGHT_SECONDS = 10.0  # the callbacks reach the token endpoint within milliseconds


async def test_r6_exchanges_hanging_at_the_provider_leave_other_users_served(
    dedicated: Dedicated, clients: DedicatedClients
) -> None:
    """R6: the token endpoint hangs for ten users' exchanges at once. While all ten are still
    waiting on it, another user completes an API-key flow (round 1, the form, the key, the
    retry): hanging exchanges hold no worker, lock or connection of the broker's pool of two.
    Each hung exchange then ends at its own deadline: one token call each, the flow back to
    `pending` with failure `timeout`, nothing stored, and a page that says to try again."""
    waiting = [fresh_user("r6-hung") for _ in range(HANGING_EXCHANGES)]
    browsers = [Browser(dedicated.broker.url) for _ in waiting]
    other = fresh_user("r6-other")
    other_token = clients.token(dedicated, other)
    try:
        callbacks = [
            await at_callback(clients.mcp, browser, clients.token(dedicated, user), user)
            for browser, user in zip(browsers, waiting, strict=True)
        ]
        first = await elicit(clients.mcp, other_token, {"provider": "demo"})
        await clients.browser.login_as(other, next_path=f"/connect/{first.flow_id}")
        clients.fake.token_fault = "timeout"
        clients.fake.sticky_faults = True  # every exchange hangs, not only the next one
        # new connections: one that sat idle through the other users' set-up may be closed by
        # the server just as a request is sent on it
        returning = [browser.on_new_connection() for browser in browsers]
        browsers.extend(returning)

        hung = [
            asyncio.create_task(return_to_broker(browser, callback_url))
            for browser, (_, callback_url) in zip(returning, callbacks, strict=True)
        ]
        deadline = time.monotonic() + IN_FLIGHT_SECONDS
        while clients.fake.token_calls < HANGING_EXCHANGES and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        assert clients.fake.token_calls == HANGING_EXCHANGES

        form = await clients.browser.get(f"/connect/{first.flow_id}")
        csrf = re.search(r'name="csrf" value="([^"]+)"', form.text)
        assert csrf, form.text
        submitted = await clients.browser.post(
            f"/connect/{first.flow_id}/api-key",
            data={"csrf": csrf.group(1), "api_key": "sk_r6otheruser"},
        )
        assert submitted.status_code == 303, submitted.text
        final = await clients.mcp.call_tool(
            other_token,
            "connect_account",
            {"provider": "demo"},
            input_responses={first.key: {"action": "accept"}},
            request_state=first.request_state,
        )
        assert tool_result(final)["structuredContent"]["status"] == "connected"
        assert not any(task.done() for task in hung)  # all ten still at the provider

        answers = await asyncio.gather(*hung)
        assert [answer.status_code for answer in answers] == [303] * HANGING_EXCHANGES
        assert clients.fake.token_calls == HANGING_EXCHANGES
        for user, (flow_id, _) in zip(waiting, callbacks, strict=True):
            await assert_nothing_stored(clients.db, flow_id, user, reason="timeout")
        page = await browsers[0].get(f"/connect/{callbacks[0][0]}")
        assert TOO_SLOW in page.text and CONTINUE_BUTTON in page.text
    finally:
        for browser in browsers:
            await browser.aclose()
