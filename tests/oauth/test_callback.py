"""The OAuth legs of a connect flow under attack: start and callback (SECURITY.md E1-E15 and
threats T1, T2, T3, T9, T10, T12, T13).

GitHub flows run against the fake GitHub, whose counters show whether the broker ever spent a
code (`token_calls`) or sent a browser to the provider (`authorize_hits`); the generic OIDC
provider "acme" (a second oidc-provider) covers what only OpenID providers do (RFC 9207 `iss`).
Wherever a callback is refused, the token endpoint must not have been called and the flow row
must be exactly as before (no claim, no state burnt), so its owner can still finish.
"""

from __future__ import annotations

import asyncio
import secrets
from typing import Any

import pytest
from sqlalchemy.ext.asyncio import AsyncEngine

from ..conftest import count_rows
from ..support.broker import BrokerProcess, LogWindow
from ..support.clients import Browser, McpHttp, provider_url
from ..support.fake_github import FakeGitHub
from ..support.idp import IdpProcess
from ..support.schema import validate_response
from .helpers import (
    approve_at_provider,
    arm,
    callback_url,
    connect,
    connection_row,
    deliver,
    expire,
    flow_of,
    local,
    open_flow,
    query,
    retry_connect,
    start_at_broker,
    unique,
)

pytestmark = pytest.mark.both_databases

XSS = "<img src=x onerror=alert(1)>"
OVERSIZED = "C" * 10 * 1024


@pytest.fixture(autouse=True)
def fake(fake_github: FakeGitHub) -> FakeGitHub:
    """The session's fake GitHub with fresh counters and no armed faults."""
    fake_github.reset()
    return fake_github


async def github_connections(db: AsyncEngine, *users: str) -> int:
    """How many GitHub connections these users have between them."""
    return sum([await count_rows(db, "connections", subject=u, provider="github") for u in users])


# --- E: the callback ----------------------------------------------------------------------------


async def test_e1_callback_without_state_is_refused_before_any_exchange(
    mcp: McpHttp, token_for: Any, browser: Browser, fake: FakeGitHub, db: AsyncEngine
) -> None:
    """E1. A code with no state cannot belong to any flow: 400, and the code is never spent."""
    user = unique("cb-e1")
    armed = await arm(mcp, browser, token_for(user), user)
    code = query(await approve_at_provider(browser.http, armed.authorize_url))["code"]
    before = await flow_of(db, armed.flow_id)

    response = await browser.get(callback_url("github", code=code))

    assert response.status_code == 400
    assert "cannot be used" in response.text
    assert fake.token_calls == 0
    assert await flow_of(db, armed.flow_id) == before


async def test_e2_unknown_state_is_refused_before_any_exchange(
    mcp: McpHttp, token_for: Any, browser: Browser, fake: FakeGitHub, db: AsyncEngine
) -> None:
    """E2. A well-formed but unknown state (43 random characters) is refused with 400."""
    user = unique("cb-e2")
    armed = await arm(mcp, browser, token_for(user), user)
    code = query(await approve_at_provider(browser.http, armed.authorize_url))["code"]
    before = await flow_of(db, armed.flow_id)

    response = await browser.get(callback_url("github", code=code, state=secrets.token_urlsafe(32)))

    assert response.status_code == 400
    assert fake.token_calls == 0
    assert await flow_of(db, armed.flow_id) == before


async def test_e3_t2_forwarded_authorize_url_is_refused_and_stays_usable_by_its_owner(
    mcp: McpHttp,
    token_for: Any,
    browser: Browser,
    second_browser: Browser,
    fake: FakeGitHub,
    db: AsyncEngine,
    broker: BrokerProcess,
) -> None:
    """E3/T2. The attacker forwards the provider authorize URL of their own flow; the victim
    approves it and lands on the callback with the attacker's state: 403 before any exchange,
    nothing stored for either, and the attacker's flow is untouched (its owner can finish)."""
    attacker, victim = unique("cb-e3-attacker"), unique("cb-e3-victim")
    armed = await arm(mcp, browser, token_for(attacker), attacker)
    await second_browser.login_as(victim)
    before = await flow_of(db, armed.flow_id)
    log = LogWindow(broker)

    back = await approve_at_provider(second_browser.http, armed.authorize_url)
    refused = await deliver(second_browser, back)

    assert query(back)["state"] == armed.state
    assert refused.status_code == 403
    assert "different account" in refused.text
    assert fake.token_calls == 0
    assert await github_connections(db, attacker, victim) == 0
    assert await flow_of(db, armed.flow_id) == before
    assert before["status"] == "authorizing"
    assert await log.shows(f"callback.session_mismatch flow_id={armed.flow_id}")

    own = await deliver(browser, await approve_at_provider(browser.http, armed.authorize_url))

    assert own.status_code == 303
    assert own.headers["location"] == f"/connect/{armed.flow_id}"
    assert fake.token_calls == 1
    assert await github_connections(db, attacker) == 1
    assert await github_connections(db, victim) == 0


async def test_e4_callback_without_a_browser_session_is_refused(
    mcp: McpHttp,
    token_for: Any,
    browser: Browser,
    fake: FakeGitHub,
    db: AsyncEngine,
    broker: BrokerProcess,
) -> None:
    """E4. The right code and state, but no session cookie: 403, no exchange, flow unchanged."""
    user = unique("cb-e4")
    armed = await arm(mcp, browser, token_for(user), user)
    back = await approve_at_provider(browser.http, armed.authorize_url)
    before = await flow_of(db, armed.flow_id)

    response = await browser.http.get(f"{broker.url}{local(back)}")  # no broker cookie

    assert response.status_code == 403
    assert "set-cookie" not in response.headers
    assert fake.token_calls == 0
    assert await github_connections(db, user) == 0
    assert await flow_of(db, armed.flow_id) == before


async def test_e5_replayed_callback_shows_the_connection_without_a_second_exchange(
    mcp: McpHttp, token_for: Any, browser: Browser, fake: FakeGitHub, db: AsyncEngine
) -> None:
    """E5. The same code and state again after success: 303 to the flow's page, which says
    "connected"; the token endpoint was called once and the stored credential is unchanged."""
    user = unique("cb-e5")
    armed = await arm(mcp, browser, token_for(user), user)
    back = await approve_at_provider(browser.http, armed.authorize_url)
    first = await deliver(browser, back)
    stored = await connection_row(db, user)

    replay = await deliver(browser, back)
    page = await browser.get(replay.headers["location"])

    assert first.status_code == 303
    assert replay.status_code == 303
    assert replay.headers["location"] == f"/connect/{armed.flow_id}"
    assert "GitHub is connected" in page.text
    assert fake.token_calls == 1
    assert await connection_row(db, user) == stored
    assert (await flow_of(db, armed.flow_id))["status"] == "completed"


async def test_e6_parallel_identical_callbacks_exchange_once(
    mcp: McpHttp,
    token_for: Any,
    browser: Browser,
    fake: FakeGitHub,
    db: AsyncEngine,
    broker: BrokerProcess,
) -> None:
    """E6/T25. Ten concurrent copies of the callback (double clicks, prefetch): exactly one
    token call, one connection row, one completion; every copy lands on the flow's page."""
    user = unique("cb-e6")
    armed = await arm(mcp, browser, token_for(user), user)
    back = await approve_at_provider(browser.http, armed.authorize_url)
    log = LogWindow(broker)

    responses = await asyncio.gather(*(deliver(browser, back) for _ in range(10)))

    assert [r.status_code for r in responses] == [303] * 10
    assert {r.headers["location"] for r in responses} == {f"/connect/{armed.flow_id}"}
    assert fake.token_calls == 1
    assert await github_connections(db, user) == 1
    assert (await flow_of(db, armed.flow_id))["status"] == "completed"
    stored = f"credential.stored flow_id={armed.flow_id}"
    assert (await log.wait_for(stored)).count(stored) == 1


async def test_e7_user_denying_at_the_provider_declines_the_flow(
    mcp: McpHttp, token_for: Any, browser: Browser, fake: FakeGitHub, db: AsyncEngine
) -> None:
    """E7. The user clicks "Cancel" at GitHub: the flow is declined, the page says so, and the
    client's retry gets an `isError` result saying the user declined; no token call."""
    user = unique("cb-e7")
    token = token_for(user)
    armed = await arm(mcp, browser, token, user)
    fake.deny_next = True

    back = await approve_at_provider(browser.http, armed.authorize_url)
    callback = await deliver(browser, back)
    page = await browser.get(callback.headers["location"])
    retry = await retry_connect(mcp, token, armed.opened)

    assert query(back)["error"] == "access_denied"
    assert callback.status_code == 303
    assert callback.headers["location"] == f"/connect/{armed.flow_id}"
    assert "You chose not to connect GitHub" in page.text
    assert (await flow_of(db, armed.flow_id))["status"] == "declined"
    body = retry.json()
    validate_response(body, "CallToolResult")
    assert body["result"]["isError"] is True
    assert body["result"]["structuredContent"] == {"status": "declined"}
    assert fake.token_calls == 0
    assert await github_connections(db, user) == 0


async def test_e8_denial_with_a_foreign_state_cannot_cancel_someone_elses_flow(
    mcp: McpHttp,
    token_for: Any,
    browser: Browser,
    second_browser: Browser,
    fake: FakeGitHub,
    db: AsyncEngine,
    broker: BrokerProcess,
) -> None:
    """E8. `error=access_denied` with A's state, sent without a session or from B's browser:
    403 both times, and A's flow is unchanged (still waiting for A's own callback)."""
    owner, other = unique("cb-e8-a"), unique("cb-e8-b")
    armed = await arm(mcp, browser, token_for(owner), owner)
    await second_browser.login_as(other)
    denial = callback_url("github", error="access_denied", state=armed.state)
    before = await flow_of(db, armed.flow_id)

    anonymous = await browser.http.get(f"{broker.url}{denial}")
    foreign = await second_browser.get(denial)

    assert anonymous.status_code == 403
    assert foreign.status_code == 403
    assert await flow_of(db, armed.flow_id) == before
    assert before["status"] == "authorizing"
    assert fake.token_calls == 0


async def test_e9_t12_state_delivered_to_another_providers_callback_is_refused(
    mcp: McpHttp,
    token_for: Any,
    browser: Browser,
    fake: FakeGitHub,
    db: AsyncEngine,
    broker: BrokerProcess,
) -> None:
    """E9/T12. Mix-up: a GitHub flow's code and state delivered to /oauth/acme/callback are
    refused with 400; the flow is not claimed, so no token endpoint (GitHub's or Acme's) was
    called."""
    user = unique("cb-e9")
    armed = await arm(mcp, browser, token_for(user), user)
    back = await approve_at_provider(browser.http, armed.authorize_url)
    before = await flow_of(db, armed.flow_id)
    log = LogWindow(broker)

    response = await browser.get(local(back).replace("/oauth/github/", "/oauth/acme/", 1))

    assert response.status_code == 400
    assert fake.token_calls == 0
    assert await flow_of(db, armed.flow_id) == before
    assert await log.shows("callback.refused reason=provider_mismatch")


async def test_e10_callback_after_the_flow_expired_is_refused(
    mcp: McpHttp,
    token_for: Any,
    browser: Browser,
    fake: FakeGitHub,
    db: AsyncEngine,
    broker: BrokerProcess,
) -> None:
    """E10. The user comes back after the flow's expiry: 410 "expired", no exchange."""
    user = unique("cb-e10")
    armed = await arm(mcp, browser, token_for(user), user)
    back = await approve_at_provider(browser.http, armed.authorize_url)
    await expire(db, armed.flow_id)
    log = LogWindow(broker)

    response = await deliver(browser, back)

    assert response.status_code == 410
    assert "expired" in response.text
    assert fake.token_calls == 0
    assert await github_connections(db, user) == 0
    assert await log.shows("callback.refused reason=expired")


async def test_e11_code_and_error_together_are_refused(
    mcp: McpHttp, token_for: Any, browser: Browser, fake: FakeGitHub, db: AsyncEngine
) -> None:
    """E11. A callback carrying both `code` and `error` is malformed: 400, nothing moves."""
    user = unique("cb-e11")
    armed = await arm(mcp, browser, token_for(user), user)
    code = query(await approve_at_provider(browser.http, armed.authorize_url))["code"]
    before = await flow_of(db, armed.flow_id)

    response = await browser.get(
        callback_url("github", code=code, error="access_denied", state=armed.state)
    )

    assert response.status_code == 400
    assert fake.token_calls == 0
    assert await flow_of(db, armed.flow_id) == before


@pytest.mark.parametrize("oversized", ["code", "state"])
async def test_e12_oversized_code_or_state_is_refused(
    oversized: str,
    mcp: McpHttp,
    token_for: Any,
    browser: Browser,
    fake: FakeGitHub,
    db: AsyncEngine,
    broker: BrokerProcess,
) -> None:
    """E12. A 10 KB `code` or `state` is refused with 400 by the length cap, before lookup."""
    user = unique("cb-e12")
    armed = await arm(mcp, browser, token_for(user), user)
    params = query(await approve_at_provider(browser.http, armed.authorize_url))
    before = await flow_of(db, armed.flow_id)
    log = LogWindow(broker)

    response = await browser.get(callback_url("github", **(params | {oversized: OVERSIZED})))

    assert response.status_code == 400
    assert fake.token_calls == 0
    assert await flow_of(db, armed.flow_id) == before
    assert await log.shows("callback.refused reason=oversized")
    assert OVERSIZED not in response.text + log.text()


@pytest.mark.parametrize(
    ("error", "status", "says"),
    [
        pytest.param("access_denied", "declined", "You chose not to connect", id="denied"),
        pytest.param("server_error", "pending", "GitHub had a problem", id="provider-error"),
    ],
)
async def test_e13_provider_error_description_is_never_reflected_as_markup(
    error: str,
    status: str,
    says: str,
    mcp: McpHttp,
    token_for: Any,
    browser: Browser,
    fake: FakeGitHub,
    db: AsyncEngine,
) -> None:
    """E13/T19. A provider error with a script payload in `error_description` (valid state and
    session): neither the callback nor the page it leads to carries the raw tag, the page says
    what happened in its own words, and its CSP forbids inline script. A denial declines the
    flow; any other provider error lets the user start again."""
    user = unique("cb-e13")
    armed = await arm(mcp, browser, token_for(user), user)

    callback = await browser.get(
        callback_url("github", error=error, error_description=XSS, state=armed.state)
    )
    page = await browser.get(callback.headers["location"])

    assert callback.status_code == 303
    assert callback.headers["location"] == f"/connect/{armed.flow_id}"
    assert page.status_code == 200
    assert says in page.text
    for response in (callback, page):
        assert XSS not in response.text
        assert "<img" not in response.text
    policy = page.headers["content-security-policy"]
    assert "default-src 'none'" in policy
    assert "unsafe-inline" not in policy
    assert "script-src" not in policy  # so scripts fall back to default-src 'none'
    assert (await flow_of(db, armed.flow_id))["status"] == status
    assert fake.token_calls == 0


async def test_e14_oidc_callback_with_a_foreign_issuer_is_refused(
    mcp: McpHttp,
    token_for: Any,
    browser: Browser,
    db: AsyncEngine,
    broker: BrokerProcess,
    provider_idp: IdpProcess,
) -> None:
    """E14. RFC 9207: the Acme (OIDC) flow's callback says `iss=https://evil.example`: 400, and
    the flow was not claimed, so nothing reached Acme's token endpoint."""
    user = unique("cb-e14")
    armed = await arm(mcp, browser, token_for(user), user, provider="acme")
    before = await flow_of(db, armed.flow_id)
    log = LogWindow(broker)

    response = await browser.get(
        callback_url(
            "acme", code="CANARYCODE-acme-e14", state=armed.state, iss="https://evil.example"
        )
    )

    assert armed.authorize_url.startswith(f"{provider_idp.issuer}/")
    assert response.status_code == 400
    assert await flow_of(db, armed.flow_id) == before
    assert before["status"] == "authorizing"
    assert await log.shows("callback.refused reason=issuer_mismatch")


async def test_e15_t13_successful_callback_leaves_no_code_or_state_behind(
    mcp: McpHttp,
    token_for: Any,
    browser: Browser,
    fake: FakeGitHub,
    broker: BrokerProcess,
) -> None:
    """E15/T13. The callback answers 303 to the bare flow page (no query), with
    `Referrer-Policy: no-referrer` and `Cache-Control: no-store`; the broker's log holds neither
    the code nor the state."""
    user = unique("cb-e15")
    armed = await arm(mcp, browser, token_for(user), user)
    back, response = await connect(browser, armed.flow_id)
    page = await browser.get(response.headers["location"])
    code, state = query(back)["code"], query(back)["state"]

    assert code.startswith("CANARYCODE")
    assert response.status_code == 303
    assert response.headers["location"] == f"/connect/{armed.flow_id}"
    assert response.headers["referrer-policy"] == "no-referrer"
    assert "no-store" in response.headers["cache-control"]
    assert "GitHub is connected" in page.text
    assert code not in page.text and state not in page.text
    assert fake.token_calls == 1
    logged = await broker.wait_for_log(f"credential.stored flow_id={armed.flow_id}")
    assert f"credential.stored flow_id={armed.flow_id}" in logged
    assert code not in logged
    assert state not in logged


# --- T1, T3: identity and code injection --------------------------------------------------------


async def test_t1_another_account_opening_the_link_never_reaches_the_provider(
    mcp: McpHttp,
    token_for: Any,
    second_browser: Browser,
    fake: FakeGitHub,
    db: AsyncEngine,
    broker: BrokerProcess,
) -> None:
    """T1. V, signed in, opens A's connect link: 403 on the page and on the start button, no
    redirect towards the provider, and A's flow stays pending."""
    owner, visitor = unique("cb-t1-a"), unique("cb-t1-v")
    opened = await open_flow(mcp, token_for(owner))
    await second_browser.login_as(visitor)
    before = await flow_of(db, opened.flow_id)
    log = LogWindow(broker)

    page = await second_browser.get(f"/connect/{opened.flow_id}")
    csrf = await second_browser.csrf_token(f"/connect/{opened.flow_id}")  # V's own (logout form)
    start = await second_browser.post(f"/connect/{opened.flow_id}/start", data={"csrf": csrf})

    assert page.status_code == 403
    assert "different account" in page.text
    assert start.status_code == 403
    assert "location" not in page.headers and "location" not in start.headers
    assert fake.authorize_hits == 0
    assert await flow_of(db, opened.flow_id) == before
    assert before["status"] == "pending"
    assert await log.shows(f"connect.identity_mismatch flow_id={opened.flow_id}")


async def test_t3_code_minted_for_another_pkce_challenge_is_rejected_and_nothing_stored(
    mcp: McpHttp, token_for: Any, browser: Browser, fake: FakeGitHub, db: AsyncEngine
) -> None:
    """T3 (a). Code injection: the code of A's second flow delivered with the state of A's first
    flow. The verifier does not match the code's challenge, GitHub answers
    `bad_verification_code`, the first flow goes back to pending with a failure on its page,
    and nothing is stored."""
    user = unique("cb-t3a")
    token = token_for(user)
    first = await arm(mcp, browser, token, user)
    second = await open_flow(mcp, token, scopes=["gist"])  # another call: a flow of its own
    second_url = await start_at_broker(browser, second.flow_id)
    first_back = await approve_at_provider(browser.http, first.authorize_url)
    second_back = await approve_at_provider(browser.http, second_url)

    injected = await browser.get(
        callback_url("github", code=query(second_back)["code"], state=query(first_back)["state"])
    )
    page = await browser.get(injected.headers["location"])

    assert injected.status_code == 303
    assert fake.token_calls == 1
    row = await flow_of(db, first.flow_id)
    assert row["status"] == "pending"
    assert row["failure"] == "provider_error:bad_verification_code"
    assert "had a problem completing the connection" in page.text
    assert 'data-action="continue"' in page.text
    assert await github_connections(db, user) == 0
    assert (await flow_of(db, second.flow_id))["status"] == "authorizing"


async def test_t3_replay_of_a_consumed_state_makes_no_token_call(
    mcp: McpHttp, token_for: Any, browser: Browser, fake: FakeGitHub, db: AsyncEngine
) -> None:
    """T3 (b). After the client received its result (flow consumed), replaying the callback
    shows the outcome and spends nothing."""
    user = unique("cb-t3b")
    token = token_for(user)
    armed = await arm(mcp, browser, token, user)
    back, _ = await connect(browser, armed.flow_id)
    retry = await retry_connect(mcp, token, armed.opened)
    assert (await flow_of(db, armed.flow_id))["status"] == "consumed", retry.text

    replay = await deliver(browser, back)
    page = await browser.get(replay.headers["location"])

    assert replay.status_code == 303
    assert "GitHub is connected" in page.text
    assert fake.token_calls == 1
    assert (await flow_of(db, armed.flow_id))["status"] == "consumed"
    assert await github_connections(db, user) == 1


# --- T9, T10: consent before redirect, server-chosen state --------------------------------------


async def test_t9_opening_the_link_shows_consent_and_only_the_post_redirects(
    mcp: McpHttp,
    token_for: Any,
    browser: Browser,
    fake: FakeGitHub,
    broker: BrokerProcess,
) -> None:
    """T9. GET /connect/F is the broker's consent page (never a redirect to GitHub); only
    POST /connect/F/start with the CSRF token answers the provider's authorize URL, with a
    state and an S256 PKCE challenge."""
    user = unique("cb-t9")
    opened = await open_flow(mcp, token_for(user))
    await browser.login_as(user, next_path=f"/connect/{opened.flow_id}")

    page = await browser.get(f"/connect/{opened.flow_id}")
    authorize_url = await start_at_broker(browser, opened.flow_id)

    assert page.status_code == 200
    assert "location" not in page.headers
    assert 'data-action="continue"' in page.text
    assert f'action="/connect/{opened.flow_id}/start"' in page.text
    assert fake.authorize_hits == 0
    assert authorize_url.startswith(f"{fake.authorize_url}?")
    params = query(authorize_url)
    assert params["client_id"] == fake.client_id
    assert params["redirect_uri"] == f"{broker.url}/oauth/github/callback"
    assert params["code_challenge_method"] == "S256"
    assert len(params["state"]) == 43


async def test_t9_consent_page_csp_keeps_forms_on_the_broker(
    mcp: McpHttp, token_for: Any, browser: Browser, fake: FakeGitHub
) -> None:
    """T9/H7. The consent page's forms post to the broker only (`form-action 'self'`, no
    provider origin: its answer sends the browser on with a refresh, not a redirect, which
    Chromium would check against `form-action` at every hop), and it cannot be framed. The
    answer itself is a page under the same policy, never cached."""
    user = unique("cb-t9-csp")
    opened = await open_flow(mcp, token_for(user))
    await browser.login_as(user, next_path=f"/connect/{opened.flow_id}")

    page = await browser.get(f"/connect/{opened.flow_id}")
    csrf = await browser.csrf_token(f"/connect/{opened.flow_id}")
    started = await browser.post(f"/connect/{opened.flow_id}/start", data={"csrf": csrf})

    for answer in (page, started):
        directives = {
            part.strip().split(" ", 1)[0]: part.strip().split(" ")[1:]
            for part in answer.headers["content-security-policy"].split(";")
        }
        assert directives["form-action"] == ["'self'"]
        assert directives["frame-ancestors"] == ["'none'"]
        assert answer.headers["cache-control"] == "no-store"
    assert provider_url(started).startswith(f"{fake.authorize_url}?")


async def test_t9_start_without_csrf_token_gives_no_provider_location(
    mcp: McpHttp, token_for: Any, browser: Browser, fake: FakeGitHub, db: AsyncEngine
) -> None:
    """T9/D7. POST /connect/F/start by the owner's browser but without the CSRF token: 403, no
    `Location`, and the flow is not armed."""
    user = unique("cb-t9-csrf")
    opened = await open_flow(mcp, token_for(user))
    await browser.login_as(user, next_path=f"/connect/{opened.flow_id}")
    before = await flow_of(db, opened.flow_id)

    response = await browser.post(f"/connect/{opened.flow_id}/start", data={})

    assert response.status_code == 403
    assert "location" not in response.headers
    assert await flow_of(db, opened.flow_id) == before
    assert before["state_digest"] is None
    assert fake.authorize_hits == 0


async def test_t10_state_is_chosen_by_the_server_fresh_for_every_start(
    mcp: McpHttp, token_for: Any, browser: Browser, db: AsyncEngine
) -> None:
    """T10. A state offered by the request (query or form) is ignored; each start mints a new
    43-character state, and the database keeps only its digest."""
    user = unique("cb-t10")
    opened = await open_flow(mcp, token_for(user))
    await browser.login_as(user, next_path=f"/connect/{opened.flow_id}")
    csrf = await browser.csrf_token(f"/connect/{opened.flow_id}")

    fixed = await browser.post(
        f"/connect/{opened.flow_id}/start?state=attacker", data={"csrf": csrf, "state": "attacker"}
    )
    again = await start_at_broker(browser, opened.flow_id)

    first, second = query(provider_url(fixed))["state"], query(again)["state"]
    assert first != "attacker"
    assert "attacker" not in provider_url(fixed)
    assert first != second
    assert len(first) == len(second) == 43
    stored = (await flow_of(db, opened.flow_id))["state_digest"]
    assert stored is not None and stored not in (first, second)


async def test_t10_a_second_start_retires_the_first_state(
    mcp: McpHttp, token_for: Any, browser: Browser, fake: FakeGitHub, db: AsyncEngine
) -> None:
    """T10. Two tabs press "Continue": the first tab's state no longer works (400, no exchange),
    the second tab's completes the flow."""
    user = unique("cb-t10-tabs")
    armed = await arm(mcp, browser, token_for(user), user)
    second_url = await start_at_broker(browser, armed.flow_id)
    first_back = await approve_at_provider(browser.http, armed.authorize_url)
    second_back = await approve_at_provider(browser.http, second_url)

    stale = await deliver(browser, first_back)

    assert stale.status_code == 400
    assert fake.token_calls == 0

    fresh = await deliver(browser, second_back)

    assert fresh.status_code == 303
    assert fake.token_calls == 1
    assert (await flow_of(db, armed.flow_id))["status"] == "completed"
    assert await github_connections(db, user) == 1
