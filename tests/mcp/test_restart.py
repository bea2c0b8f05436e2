"""J6: the broker killed with SIGKILL mid-flow and started again on the same configuration and
database (SECURITY.md §J), in each state a flow waits in: pending and completed (an API key),
authorizing and exchanging (OAuth); J3 and J4: killed during the exchange, and once the exchange
is committed but its answer has not reached the browser; R3: 20 flows in each state at once.

A flow's state lives in the database, and what the client and the browser hold was derived from
the configured keys: the client's requestState, the browser's session cookie and the form's CSRF
token issued before the crash all still verify after it, and the flow finishes as if nothing had
happened. An exchange cut short is handed back to the user once its lease runs out. Killed, not
stopped: no shutdown work may be needed for any of this.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections.abc import AsyncIterator, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import httpx2
import pytest
from sqlalchemy import update
from sqlalchemy.ext.asyncio import AsyncEngine, async_sessionmaker

from app.clock import utcnow
from app.connect.service import EXCHANGE_LEASE, purge
from app.db import create_engine
from app.models import Flow

from ..conftest import DEMO_PROVIDER, count_rows, flow_row, github_provider
from ..connect import unique
from ..oauth.helpers import (
    Opened,
    approve_at_provider,
    arm,
    connect,
    deliver,
    local,
    open_flow,
    retry_connect,
)
from ..support.broker import BrokerProcess
from ..support.clients import Browser, McpHttp, flow_id_from
from ..support.fake_github import FakeGitHub
from ..support.relay import TcpRelay
from ..support.schema import validate_response
from ..support.stack import Stack, running_stack
from .test_retry import API_KEY, retry, round_one, tool_result

pytestmark = pytest.mark.both_databases

CLAIM_SECONDS = 10.0  # callback delivered to the flow seen `exchanging`; takes milliseconds
COMMIT_SECONDS = 10.0  # callback delivered to the exchange committed; takes milliseconds


@pytest.fixture(scope="module")
def stack(workdir: Path) -> Iterator[tuple[Stack, FakeGitHub]]:
    """A broker of its own (it gets killed) with `demo` and a GitHub of its own."""
    with FakeGitHub(redirect_uri="http://127.0.0.1:9/set-below") as fake:
        providers = {"demo": DEMO_PROVIDER, "github": github_provider(fake)}
        with running_stack(workdir, "restart", providers=providers) as stack:
            fake.redirect_uri = f"{stack.broker.url}/oauth/github/callback"
            yield stack, fake


@dataclasses.dataclass(frozen=True)
class Clients:
    mcp: McpHttp
    browser: Browser
    db: AsyncEngine


@pytest.fixture
async def clients(stack: tuple[Stack, FakeGitHub]) -> AsyncIterator[Clients]:
    broker = stack[0].broker
    stack[1].reset()
    engine = create_engine(broker.database_url, pool_size=1)
    mcp, browser = McpHttp(broker.mcp_url), Browser(broker.url)
    yield Clients(mcp, browser, engine)
    await mcp.aclose()
    await browser.aclose()
    await engine.dispose()


async def crash_and_restart(broker: BrokerProcess) -> None:
    await asyncio.to_thread(broker.kill)
    await asyncio.to_thread(broker.restart)


async def test_j6_api_key_flow_killed_while_pending_and_once_completed_still_finishes(
    stack: tuple[Stack, FakeGitHub], clients: Clients
) -> None:
    """Killed with the flow pending: the old requestState still verifies (the retry gets the
    same URL again), and the browser's session and CSRF token from before the crash submit the
    key without a new login. Killed again with the flow completed: the retry gets the result."""
    broker, token, user = _user(stack[0], "j6-key")
    mcp, browser, db = clients.mcp, clients.browser, clients.db
    first, _, flow_id = await round_one(mcp, token)
    await browser.login_as(user, next_path=f"/connect/{flow_id}")
    csrf = await browser.csrf_token(f"/connect/{flow_id}")

    await crash_and_restart(broker)

    body = _input_required(await retry(mcp, token, first["requestState"]), flow_id)
    submitted = await browser.post(
        f"/connect/{flow_id}/api-key", data={"csrf": csrf, "api_key": API_KEY}
    )
    assert submitted.status_code == 303, submitted.text
    assert await _status(db, flow_id) == "completed"

    await crash_and_restart(broker)

    final = tool_result(await retry(mcp, token, body["result"]["requestState"]))
    assert final["structuredContent"]["status"] == "connected"
    assert await _status(db, flow_id) == "consumed"
    again = tool_result(await retry(mcp, token, body["result"]["requestState"]))
    assert again["structuredContent"] == final["structuredContent"]


async def test_j6_oauth_flow_killed_while_authorizing_completes_at_the_callback(
    stack: tuple[Stack, FakeGitHub], clients: Clients
) -> None:
    """Killed while the browser is at the provider: the callback that comes back afterwards
    still matches the flow's state digest and PKCE verifier, and the retry gets the result."""
    broker, token, user = _user(stack[0], "j6-authz")
    armed = await arm(clients.mcp, clients.browser, token, user)

    await crash_and_restart(broker)

    back = await approve_at_provider(clients.browser.http, armed.authorize_url)
    callback = await deliver(clients.browser, back)
    assert callback.status_code == 303, callback.text
    result = tool_result(await retry_connect(clients.mcp, token, armed.opened))
    assert result["structuredContent"]["status"] == "connected"
    assert await count_rows(clients.db, "connections", subject=user, provider="github") == 1


async def test_j3_oauth_flow_killed_during_the_exchange_can_be_started_again_after_the_lease(
    stack: tuple[Stack, FakeGitHub], clients: Clients
) -> None:
    """J3, and J6 in the `exchanging` state: killed after the provider spent the code and issued
    a token, before the broker had it. Nothing is stored and the flow stays `exchanging`
    (another process may still be finishing it) until the lease runs out; then the sweeper
    hands it back (`pending`, failure `interrupted`: the page says to try again), the retry gets
    the same URL again, and the user's second attempt connects, with one connection row."""
    (broker_stack, fake) = stack
    broker, token, user = _user(broker_stack, "j6-exch")
    mcp, browser, db = clients.mcp, clients.browser, clients.db
    armed = await arm(mcp, browser, token, user)
    back = await approve_at_provider(browser.http, armed.authorize_url)
    fake.token_fault = "timeout"  # the token endpoint holds its answer
    delivering = asyncio.create_task(deliver(browser, back))
    deadline = time.monotonic() + CLAIM_SECONDS
    while await _status(db, armed.flow_id) != "exchanging" and time.monotonic() < deadline:
        await asyncio.sleep(0.02)
    assert await _status(db, armed.flow_id) == "exchanging"

    await crash_and_restart(broker)
    with contextlib.suppress(httpx2.HTTPError):
        await delivering  # the connection died with the broker

    assert await _status(db, armed.flow_id) == "exchanging"
    assert await count_rows(db, "connections", subject=user) == 0
    await _sweep_after_lease(db, armed.flow_id)
    row = await flow_row(db, armed.flow_id) or {}
    assert (row["status"], row["failure"], row["sealed_pkce_verifier"]) == (
        "pending",
        "interrupted",
        None,
    )
    waited = await retry_connect(mcp, token, armed.opened)
    body = _input_required(waited, armed.flow_id)

    _, callback = await connect(browser, armed.flow_id)
    assert callback.status_code == 303, callback.text
    reissued = dataclasses.replace(armed.opened, request_state=body["result"]["requestState"])
    result = tool_result(await retry_connect(mcp, token, reissued))
    assert result["structuredContent"]["status"] == "connected"
    assert await count_rows(db, "connections", subject=user, provider="github") == 1
    assert fake.token_calls == 2


async def test_j4_oauth_flow_killed_after_the_commit_before_the_browser_has_the_answer(
    stack: tuple[Stack, FakeGitHub], clients: Clients
) -> None:
    """J4: the callback goes through a relay that passes the request on and keeps the answer;
    the broker is killed once the exchange is committed (the flow `completed`), and the browser
    sees its connection die without an answer. What was committed is all there is: reloading
    the callback shows GitHub connected without a second exchange, and the retry gets the
    result, with one connection row and one token call."""
    (broker_stack, fake) = stack
    broker, token, user = _user(broker_stack, "j4-commit")
    mcp, browser, db = clients.mcp, clients.browser, clients.db
    armed = await arm(mcp, browser, token, user)
    back = await approve_at_provider(browser.http, armed.authorize_url)
    relay = TcpRelay(broker.config.port)
    await relay.start()
    relay.hold_answers()
    lost = browser.on_new_connection(f"http://127.0.0.1:{relay.port}")
    try:
        delivering = asyncio.create_task(
            lost.get(local(back), headers={"Host": f"127.0.0.1:{broker.config.port}"})
        )
        deadline = time.monotonic() + COMMIT_SECONDS
        while await _status(db, armed.flow_id) != "completed" and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        assert await _status(db, armed.flow_id) == "completed"

        await crash_and_restart(broker)
        await relay.cut()
        with pytest.raises(httpx2.HTTPError):
            await delivering  # the browser's error page: no answer came
    finally:
        await lost.aclose()

    reloaded = await deliver(browser, back)
    assert reloaded.status_code == 303, reloaded.text
    assert reloaded.headers["location"] == f"/connect/{armed.flow_id}"
    page = await browser.get(reloaded.headers["location"])
    assert "GitHub is connected" in page.text
    result = tool_result(await retry_connect(mcp, token, armed.opened))
    assert result["structuredContent"]["status"] == "connected"
    assert await count_rows(db, "connections", subject=user, provider="github") == 1
    assert fake.token_calls == 1


FLOWS_PER_STATE = 20
SETUP_CONCURRENCY = 10


@dataclasses.dataclass
class Journey:
    """One user's OAuth flow, taken up to the state it is in when the broker dies."""

    user: str
    token: str
    browser: Browser
    opened: Opened | None = None
    authorize_url: str | None = None
    callback_url: str | None = None


@pytest.mark.slow  # 100 flows through five kill -9 restarts
async def test_r3_kill_9_with_20_flows_in_each_state_every_flow_finishes_once(
    stack: tuple[Stack, FakeGitHub], clients: Clients
) -> None:
    """R3: 20 OAuth flows in each state a flow waits in (pending; authorizing, the browser at
    GitHub; before the claim, the callback not yet delivered; exchanging, the token endpoint
    holding its answer; after the commit, the retry not yet made), then one SIGKILL and a
    restart. Flows killed in any state but `exchanging` finish with nothing but the user's next
    step; the `exchanging` ones are handed back once the lease has passed, the retry gets the
    same URL, and the user's second attempt connects. In the end all 100 flows are consumed
    (none stuck), each user has one connection row, and GitHub saw exactly one token call per
    flow plus the 20 that were cut short."""
    broker_stack, fake = stack
    broker, mcp, db = broker_stack.broker, clients.mcp, clients.db
    limit = asyncio.Semaphore(SETUP_CONCURRENCY)

    async def begin(state: str, n: int) -> Journey:
        user = unique(f"r3-{state}-{n}")
        journey = Journey(user, broker_stack.token(user), Browser(broker.url))
        async with limit:
            await _take_to(state, journey, mcp)
        return journey

    journeys = {
        state: list(await asyncio.gather(*(begin(state, n) for n in range(FLOWS_PER_STATE))))
        for state in ("pending", "authorizing", "before_claim", "committed", "exchanging")
    }
    fake.sticky_faults, fake.token_fault = True, "timeout"  # every token call holds its answer
    exchanging = journeys["exchanging"]
    delivering = [
        asyncio.create_task(deliver(journey.browser, journey.callback_url or ""))
        for journey in exchanging
    ]
    deadline = time.monotonic() + CLAIM_SECONDS
    while time.monotonic() < deadline and await _statuses(db, exchanging) != {"exchanging"}:
        await asyncio.sleep(0.05)
    assert await _statuses(db, exchanging) == {"exchanging"}
    assert fake.token_calls == 2 * FLOWS_PER_STATE  # the committed ones, the held ones

    await crash_and_restart(broker)
    fake.sticky_faults, fake.token_fault = False, None
    for task in delivering:
        with contextlib.suppress(httpx2.HTTPError):
            await task  # each connection died with the broker

    assert await _statuses(db, journeys["committed"]) == {"completed"}
    assert await _statuses(db, exchanging) == {"exchanging"}
    for journey in exchanging:
        assert await count_rows(db, "connections", subject=journey.user) == 0
    await _sweep_after_lease(db, *(_flow_id(journey) for journey in exchanging))

    async def finish(state: str, journey: Journey) -> None:
        async with limit:
            await _finish(state, journey, mcp)

    await asyncio.gather(
        *(finish(state, journey) for state, group in journeys.items() for journey in group)
    )

    everyone = [journey for group in journeys.values() for journey in group]
    assert await _statuses(db, everyone) == {"consumed"}
    for journey in everyone:
        assert await count_rows(db, "connections", subject=journey.user, provider="github") == 1
    # one exchange per flow, and the 20 cut short: no code was ever spent twice
    assert fake.token_calls == 6 * FLOWS_PER_STATE


async def _take_to(state: str, journey: Journey, mcp: McpHttp) -> None:
    """Round 1, then as far as `state`: login and start at the broker, approval at GitHub, the
    callback delivered (`committed`; `exchanging` delivers it later, with GitHub holding)."""
    if state == "pending":
        journey.opened = await open_flow(mcp, journey.token)
        return
    armed = await arm(mcp, journey.browser, journey.token, journey.user)
    journey.opened, journey.authorize_url = armed.opened, armed.authorize_url
    if state == "authorizing":
        return
    journey.callback_url = await approve_at_provider(journey.browser.http, armed.authorize_url)
    if state == "committed":
        assert (await deliver(journey.browser, journey.callback_url)).status_code == 303


async def _finish(state: str, journey: Journey, mcp: McpHttp) -> None:
    """The user's next steps after the restart, up to the retry that returns `connected`."""
    assert journey.opened is not None
    opened = journey.opened
    if state == "pending":
        await journey.browser.login_as(journey.user, next_path=f"/connect/{opened.flow_id}")
    if state == "exchanging":  # handed back: the retry re-issues the same URL
        again = _input_required(await retry_connect(mcp, journey.token, opened), opened.flow_id)
        opened = dataclasses.replace(opened, request_state=again["result"]["requestState"])
    if state in ("pending", "exchanging"):  # (again) from the consent page
        _, callback = await connect(journey.browser, opened.flow_id)
        assert callback.status_code == 303, (state, callback.text)
    elif state != "committed":  # at GitHub, or back from it with the callback not delivered
        back = journey.callback_url or await approve_at_provider(
            journey.browser.http, journey.authorize_url or ""
        )
        callback = await deliver(journey.browser, back)
        assert callback.status_code == 303, (state, callback.text)
    result = tool_result(await retry_connect(mcp, journey.token, opened))
    assert result["structuredContent"]["status"] == "connected", (state, result)
    await journey.browser.aclose()


def _flow_id(journey: Journey) -> str:
    assert journey.opened is not None
    return journey.opened.flow_id


async def _statuses(db: AsyncEngine, journeys: list[Journey]) -> set[str | None]:
    return {await _status(db, _flow_id(journey)) for journey in journeys}


def _user(stack: Stack, label: str) -> tuple[BrokerProcess, str, str]:
    user = unique(label)
    return stack.broker, stack.token(user), user


def _input_required(response: httpx2.Response, flow_id: str) -> dict[str, Any]:
    """The retry of an open flow: the same URL again (so its requestState verified)."""
    assert response.status_code == 200, response.text
    body: dict[str, Any] = response.json()
    assert "result" in body, body  # not -32602
    validate_response(body, "InputRequiredResult")
    assert flow_id_from(body["result"])[1] == flow_id
    return body


async def _sweep_after_lease(db: AsyncEngine, *flow_ids: str) -> None:
    """The sweeper's run once the exchange lease has passed (the flows' last write moved back)."""
    async with db.begin() as connection:
        await connection.execute(
            update(Flow)
            .where(Flow.id.in_(flow_ids))
            .values(updated_at=utcnow() - EXCHANGE_LEASE - timedelta(seconds=1))
        )
    await purge(async_sessionmaker(db))


async def _status(db: AsyncEngine, flow_id: str) -> str | None:
    row = await flow_row(db, flow_id)
    return None if row is None else str(row["status"])
