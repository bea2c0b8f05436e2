"""A stored GitHub connection over its life: used by github_whoami, refreshed when due (once, even
from two processes), stepped up to more scopes, and revoked upstream on disconnect.

DESIGN.md §3.3; SECURITY.md I3 and T8. The fake GitHub issues expiring tokens with rotating
refresh tokens when `expiring_tokens` is set, as GitHub Apps do.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import httpx2
import pytest
from sqlalchemy import delete
from sqlalchemy.ext.asyncio import AsyncEngine

from app.models import PendingRevocation

from ..conftest import count_rows, flow_row
from ..support.broker import BrokerProcess, LogWindow, database_kind, serve_replica
from ..support.clients import Browser, McpHttp
from ..support.fake_github import FakeGitHub
from ..support.http import local_client
from ..support.schema import validate_response
from .flows import (
    authorize,
    connect,
    elicit,
    input_required,
    make_due,
    return_to_broker,
    tool_result,
)
from .helpers import connection_row
from .helpers import unique as fresh_user

pytestmark = pytest.mark.both_databases

CALLS_PER_PROCESS = 4
START_TIMEOUT = 30.0
CONFIRM = {"confirm_disconnect": {"action": "accept", "content": {"confirm": True}}}
PROFILE = {"login": "octocat", "id": 1, "name": "The Octocat"}


@pytest.fixture(autouse=True)
def _fresh_fake(fake_github: FakeGitHub) -> Iterator[None]:
    """The session fake keeps counters and faults: every test starts (and leaves) it clean."""
    fake_github.reset()
    yield
    fake_github.reset()


async def at_fake(fake: FakeGitHub, method: str, path: str, **kwargs: Any) -> httpx2.Response:
    """A request straight to the fake, to see what it thinks of a token."""
    async with local_client(timeout=10) as http:
        return await http.request(method, f"{fake.url}{path}", **kwargs)


async def refresh_at_fake(fake: FakeGitHub, refresh_token: str) -> httpx2.Response:
    return await at_fake(
        fake,
        "POST",
        "/login/oauth/access_token",
        data={
            "grant_type": "refresh_token",
            "refresh_token": refresh_token,
            "client_id": fake.client_id,
            "client_secret": fake.client_secret,
        },
        headers={"Accept": "application/json"},
    )


# ------------------------------------------------------------------------------------------------
# github_whoami, I3, T8
# ------------------------------------------------------------------------------------------------


async def test_github_whoami_without_a_connection_elicits_a_connect_flow(
    mcp: McpHttp, token_for: Any, db: AsyncEngine
) -> None:
    """DESIGN §3.1: a tool that needs GitHub asks for the connection through a URL elicitation."""
    user = fresh_user("whoami-new")

    response = await mcp.call_tool(token_for(user), "github_whoami")

    elicited = input_required(response)
    assert elicited.key == "connect_github"
    row = await flow_row(db, elicited.flow_id) or {}
    assert (row["tool_name"], row["provider"], row["scopes"]) == (
        "github_whoami",
        "github",
        "read:user",
    )


async def test_github_whoami_with_a_connection_returns_the_profile(
    mcp: McpHttp, token_for: Any, browser: Browser, fake_github: FakeGitHub
) -> None:
    """The tool proves the stored token works: it calls GitHub's /user with it."""
    user = fresh_user("whoami")
    token = token_for(user)
    await connect(mcp, browser, token, user)

    response = await mcp.call_tool(token, "github_whoami")

    result = tool_result(response)
    assert result["structuredContent"] == PROFILE
    assert result["content"][0]["text"] == "Connected to GitHub as @octocat."
    assert fake_github.seen_authorization[-1] == f"Bearer {fake_github.issued_access_tokens[-1]}"


async def test_i3_tool_result_never_carries_a_token_the_provider_echoes(
    mcp: McpHttp, token_for: Any, browser: Browser, fake_github: FakeGitHub
) -> None:
    """I3. GitHub's answer may contain the credential (here the echoed Authorization header);
    only the named profile fields leave the broker."""
    user = fresh_user("i3")
    token = token_for(user)
    await connect(mcp, browser, token, user)
    fake_github.echo_authorization = True

    response = await mcp.call_tool(token, "github_whoami")

    assert tool_result(response)["structuredContent"] == PROFILE
    assert fake_github.user_calls >= 1
    assert fake_github.issued_access_tokens[-1] not in response.text
    assert "gho_" not in response.text and "received_authorization" not in response.text


async def test_t8_mcp_bearer_token_is_never_sent_to_the_provider(
    mcp: McpHttp, token_for: Any, browser: Browser, fake_github: FakeGitHub
) -> None:
    """T8 (token passthrough): the MCP access token is for the broker only; GitHub sees the
    client credentials and the user's GitHub token, nothing else."""
    fake_github.expiring_tokens = True
    user = fresh_user("t8")
    token = token_for(user)

    await connect(mcp, browser, token, user)
    tool_result(await mcp.call_tool(token, "github_whoami"))

    seen = list(fake_github.seen_authorization)
    assert len(seen) >= 2  # the token exchange (client) and /user (user token) at least
    assert all(token not in header for header in seen)
    assert all(header.startswith(("Bearer gho_", "Basic ")) for header in seen), seen


# ------------------------------------------------------------------------------------------------
# Refresh
# ------------------------------------------------------------------------------------------------


async def test_due_token_is_refreshed_once_and_the_rotated_refresh_token_is_stored(
    mcp: McpHttp, token_for: Any, browser: Browser, fake_github: FakeGitHub, db: AsyncEngine
) -> None:
    """DESIGN §3.3: a token expiring within 5 minutes is refreshed before use, once; the
    rotated refresh token is persisted (the old one is dead at GitHub, and the next refresh,
    which only the stored new one can do, succeeds)."""
    fake_github.expiring_tokens = True
    user = fresh_user("refresh")
    token = token_for(user)
    await connect(mcp, browser, token, user)
    before = await connection_row(db, user)
    old_refresh_token = fake_github.issued_refresh_tokens[-1]
    await make_due(db, before["id"])

    first = await mcp.call_tool(token, "github_whoami")
    second = await mcp.call_tool(token, "github_whoami")
    refreshes = fake_github.refresh_calls
    after = await connection_row(db, user)
    replay = await refresh_at_fake(fake_github, old_refresh_token)
    await make_due(db, before["id"])
    refreshes_before_third = fake_github.refresh_calls  # the replay above counts as one
    third = await mcp.call_tool(token, "github_whoami")

    assert tool_result(first)["structuredContent"] == PROFILE
    assert tool_result(second)["structuredContent"] == PROFILE
    assert refreshes == 1
    assert after["status"] == "active"
    assert after["sealed_credential"] != before["sealed_credential"]
    assert after["expires_at"] > datetime.now(UTC) + timedelta(hours=7)
    assert replay.json()["error"] == "bad_refresh_token"
    assert tool_result(third)["structuredContent"] == PROFILE
    assert fake_github.refresh_calls == refreshes_before_third + 1
    assert (await connection_row(db, user))["status"] == "active"
    assert old_refresh_token not in first.text + second.text


async def test_refresh_refused_by_the_provider_needs_reauth_and_elicits_a_new_flow(
    mcp: McpHttp,
    token_for: Any,
    browser: Browser,
    fake_github: FakeGitHub,
    db: AsyncEngine,
    broker: BrokerProcess,
) -> None:
    """DESIGN §3.3: `invalid_grant` on refresh marks the connection `needs_reauth`; the next
    tool call elicits a new connect flow, and completing it makes the connection active."""
    fake_github.expiring_tokens = True
    user = fresh_user("reauth")
    token = token_for(user)
    first_flow = await connect(mcp, browser, token, user)
    await make_due(db, (await connection_row(db, user))["id"])
    fake_github.token_fault = "refresh_invalid"
    log = LogWindow(broker)

    whoami = await mcp.call_tool(token, "github_whoami")
    status_after_refusal = (await connection_row(db, user))["status"]
    again = await elicit(mcp, token)
    await return_to_broker(browser, await authorize(browser, again.flow_id))

    assert input_required(whoami).key == "connect_github"
    assert fake_github.refresh_calls == 1
    assert status_after_refusal == "needs_reauth"
    assert await log.shows("credential.refresh_rejected provider=github")
    assert again.flow_id not in (first_flow, input_required(whoami).flow_id)
    assert (await connection_row(db, user))["status"] == "active"
    assert tool_result(await mcp.call_tool(token, "github_whoami"))["structuredContent"] == PROFILE


async def warm_up(client: McpHttp, token: str) -> None:
    """Open as many keep-alive connections as the burst will use, so its calls overlap.

    One call first: a fresh process fetches the IdP's keys on its first request, and concurrent
    cold requests would race that fetch (a separate JWKS issue, not what this test is about).
    """
    tool_result(await client.call_tool(token, "list_connections"))
    burst = [client.call_tool(token, "list_connections") for _ in range(CALLS_PER_PROCESS)]
    for response in await asyncio.gather(*burst):
        tool_result(response)


@pytest.fixture
def processes(broker: BrokerProcess) -> Iterator[list[BrokerProcess]]:
    """PostgreSQL: the session broker and a twin on its database. SQLite: the broker alone
    (an embedded database is one process by design)."""
    if database_kind() == "sqlite":
        yield [broker]
        return
    twin = serve_replica(broker, name="twin")
    try:
        yield [broker, twin]
    finally:
        twin.stop()


async def test_concurrent_calls_on_every_process_refresh_upstream_exactly_once(
    processes: list[BrokerProcess],
    mcp: McpHttp,
    token_for: Any,
    browser: Browser,
    fake_github: FakeGitHub,
    db: AsyncEngine,
) -> None:
    """DESIGN §3.3: one refresh at a time per connection across all replicas. On PostgreSQL two
    broker processes share the database (row lock); on SQLite, which is single-process by
    design, the concurrent calls go to the one process (in-process lock)."""
    fake_github.expiring_tokens = True
    user = fresh_user("twins")
    await connect(mcp, browser, token_for(user), user)
    clients = [McpHttp(process.mcp_url) for process in processes]
    tokens = [token_for(user, audience=process.mcp_url) for process in processes]
    try:
        for client, token in zip(clients, tokens, strict=True):
            await warm_up(client, token)
        await make_due(db, (await connection_row(db, user))["id"])
        logs = [LogWindow(process) for process in processes]

        responses = await asyncio.wait_for(
            asyncio.gather(
                *(
                    client.call_tool(token, "github_whoami")
                    for client, token in zip(clients, tokens, strict=True)
                    for _ in range(CALLS_PER_PROCESS)
                )
            ),
            timeout=60,
        )
    finally:
        for client in clients:
            await client.aclose()

    assert len(responses) == CALLS_PER_PROCESS * len(processes)
    assert [tool_result(r)["structuredContent"] for r in responses] == [PROFILE] * len(responses)
    assert fake_github.refresh_calls == 1
    logged = [await log.wait_for("POST /mcp 200", CALLS_PER_PROCESS) for log in logs]
    assert [text.count("POST /mcp 200") for text in logged] == [CALLS_PER_PROCESS] * len(logs)


async def users_with_github(
    broker: BrokerProcess, mcp: McpHttp, token_for: Any, prefix: str, count: int
) -> list[str]:
    """`count` fresh users, each of whom has connected GitHub (in a browser of their own)."""
    users = [fresh_user(f"{prefix}-{n}") for n in range(count)]
    for user in users:
        browser = Browser(broker.url)
        try:
            await connect(mcp, browser, token_for(user), user)
        finally:
            await browser.aclose()
    return users


def small_pool_replica(
    broker: BrokerProcess, name: str, *, github_timeout_seconds: float
) -> BrokerProcess:
    """A replica of `broker` with 2 database connections (pool_size 1 + 1 overflow) and a GitHub
    provider that gives up after `github_timeout_seconds`."""
    github = {**broker.config.providers["github"], "timeout_seconds": github_timeout_seconds}
    return serve_replica(
        broker,
        name=name,
        extra={**broker.config.extra, "database": {"pool_size": 1}},
        providers={**broker.config.providers, "github": github},
    )


async def test_t21_refreshes_stuck_at_a_slow_provider_leave_the_database_to_the_rest(
    broker: BrokerProcess, mcp: McpHttp, token_for: Any, fake_github: FakeGitHub, db: AsyncEngine
) -> None:
    """T21 (slow provider responses). A refresh holds a pooled connection (and the row's lock)
    while the provider answers. On a replica with 2 connections (pool_size 1 + 1 overflow), two
    users' refreshes hang at GitHub: at most half the pool is theirs, so the database check of
    /readyz still gets a connection; each call gets an answer (a tool result made with the stored
    token, which is still valid, or 503 to retry shortly)."""
    fake_github.expiring_tokens = True
    users = await users_with_github(broker, mcp, token_for, "slow-refresh", 2)
    small = small_pool_replica(broker, "small-pool", github_timeout_seconds=4)
    client = McpHttp(small.mcp_url)
    tokens = [token_for(user, audience=small.mcp_url) for user in users]
    try:
        await warm_up(client, tokens[0])
        for user in users:
            await make_due(db, (await connection_row(db, user))["id"])
        fake_github.token_fault, fake_github.sticky_faults = "timeout", True
        calls = [asyncio.create_task(client.call_tool(token, "github_whoami")) for token in tokens]
        async with asyncio.timeout(10):
            while fake_github.refresh_calls < 1:
                await asyncio.sleep(0.02)
        await asyncio.sleep(0.5)  # both calls are in: refreshing, or waiting to

        ready = await client.http.get(f"{small.url}/readyz")
        answers = await asyncio.wait_for(asyncio.gather(*calls), timeout=30)
    finally:
        fake_github.reset()
        await client.aclose()
        small.stop()

    assert ready.status_code == 200, ready.text
    for answer in answers:
        validate_response(answer.json())
        if answer.status_code == 503:
            assert answer.json()["error"]["code"] == -32603
            assert answer.headers["retry-after"] == "5"
        else:  # the stored token (which the fake may have rotated away meanwhile)
            assert answer.json()["result"]["resultType"] == "complete", answer.text


# ------------------------------------------------------------------------------------------------
# Step-up
# ------------------------------------------------------------------------------------------------


async def test_step_up_asks_for_the_union_of_scopes_and_stores_what_was_granted(
    mcp: McpHttp, token_for: Any, browser: Browser, fake_github: FakeGitHub, db: AsyncEngine
) -> None:
    """A connection that lacks a scope a tool needs is not used: a new flow asks for what it
    has plus the new scope, and the completed flow replaces the stored grant."""
    user = fresh_user("stepup")
    token = token_for(user)
    await connect(mcp, browser, token, user)
    wants_repo = {"provider": "github", "scopes": ["repo"]}

    stepped = await elicit(mcp, token, wants_repo)
    flow_scopes = (await flow_row(db, stepped.flow_id) or {})["scopes"]
    await return_to_broker(browser, await authorize(browser, stepped.flow_id))
    retry = await mcp.call_tool(
        token,
        "connect_account",
        wants_repo,
        input_responses={stepped.key: {"action": "accept"}},
        request_state=stepped.request_state,
    )

    assert flow_scopes == "read:user repo"
    assert fake_github.authorize_requests[-1]["scope"] == "read:user,repo"
    assert tool_result(retry)["structuredContent"]["status"] == "connected"
    row = await connection_row(db, user)
    assert set(row["scopes"].split()) == {"read:user", "repo"}
    assert await count_rows(db, "connections", subject=user) == 1


# ------------------------------------------------------------------------------------------------
# Disconnect and revocation
# ------------------------------------------------------------------------------------------------


async def ask_to_disconnect(mcp: McpHttp, token: str, provider: str = "github") -> str:
    """disconnect_account's first round: its form-mode confirmation's request state."""
    asked = await mcp.call_tool(token, "disconnect_account", {"provider": provider})
    body = asked.json()
    validate_response(body, "InputRequiredResult")
    assert body["result"]["inputRequests"]["confirm_disconnect"]["params"]["mode"] == "form"
    state: str = body["result"]["requestState"]
    return state


async def confirm_disconnect(
    mcp: McpHttp, token: str, request_state: str, provider: str = "github"
) -> httpx2.Response:
    """disconnect_account's retry, answering the confirmation with yes."""
    return await mcp.call_tool(
        token,
        "disconnect_account",
        {"provider": provider},
        input_responses=CONFIRM,
        request_state=request_state,
    )


async def disconnect_with_the_tool(
    mcp: McpHttp, token: str, provider: str = "github"
) -> httpx2.Response:
    """disconnect_account, answering its form-mode confirmation with yes."""
    state = await ask_to_disconnect(mcp, token, provider)
    return await confirm_disconnect(mcp, token, state, provider)


async def github_received_revocations(fake: FakeGitHub, count: int) -> None:
    """Wait (10 s at most) until the fake GitHub has received `count` revocation requests."""
    async with asyncio.timeout(10):
        while fake.revocations < count:
            await asyncio.sleep(0.02)


async def test_disconnect_account_revokes_the_grant_upstream_and_deletes_the_connection(
    mcp: McpHttp, token_for: Any, browser: Browser, fake_github: FakeGitHub, db: AsyncEngine
) -> None:
    """DESIGN §3.3: disconnect revokes upstream where the provider supports it (GitHub: DELETE
    /applications/{client_id}/grant) and deletes the sealed credential."""
    user = fresh_user("disconnect")
    token = token_for(user)
    await connect(mcp, browser, token, user)
    github_token = fake_github.issued_access_tokens[-1]

    done = await disconnect_with_the_tool(mcp, token)
    probe = await at_fake(
        fake_github, "GET", "/user", headers={"Authorization": f"Bearer {github_token}"}
    )

    assert tool_result(done)["structuredContent"]["status"] == "disconnected"
    assert await count_rows(db, "connections", subject=user) == 0
    assert fake_github.revocations == 1
    assert probe.status_code == 401


async def test_t21_revocations_stuck_at_a_slow_provider_hold_no_database_connection(
    broker: BrokerProcess, mcp: McpHttp, token_for: Any, fake_github: FakeGitHub, db: AsyncEngine
) -> None:
    """T21 (slow provider responses). Disconnecting deletes the connection and commits before
    GitHub is asked to revoke: on a replica with 2 connections (pool_size 1 + 1 overflow), while
    two users' revocations hang at GitHub, both connections are already gone and /readyz still
    gets a connection; each disconnect then says the revocation was not confirmed, and leaves it
    queued for the broker to retry (tests/oauth/test_revocation_retries.py)."""
    users = await users_with_github(broker, mcp, token_for, "slow-revoke", 2)
    small = small_pool_replica(broker, "small-pool-revoke", github_timeout_seconds=3)
    client = McpHttp(small.mcp_url)
    tokens = [token_for(user, audience=small.mcp_url) for user in users]
    try:
        await warm_up(client, tokens[0])
        states = [await ask_to_disconnect(client, token) for token in tokens]
        fake_github.revoke_fault, fake_github.sticky_faults = "timeout", True
        confirmations = [
            asyncio.create_task(confirm_disconnect(client, token, state))
            for token, state in zip(tokens, states, strict=True)
        ]
        await github_received_revocations(fake_github, len(users))

        left = [await count_rows(db, "connections", subject=user) for user in users]
        ready = await client.http.get(f"{small.url}/readyz")
        answers = await asyncio.wait_for(asyncio.gather(*confirmations), timeout=30)
        queued = [await count_rows(db, "pending_revocations", subject=user) for user in users]
    finally:
        fake_github.reset()
        await client.aclose()
        small.stop()
        async with db.begin() as connection:  # retried elsewhere: leave nothing to the sweep
            await connection.execute(
                delete(PendingRevocation).where(PendingRevocation.subject.in_(users))
            )

    assert left == [0, 0]
    assert queued == [1, 1]
    assert ready.status_code == 200, ready.text
    for answer in answers:
        result = tool_result(answer)
        assert result["structuredContent"]["status"] == "disconnected"
        assert result["structuredContent"]["revoked_upstream"] is False
        assert "could not confirm" in result["content"][0]["text"]


async def test_disconnect_button_revokes_the_grant_upstream_and_deletes_the_connection(
    mcp: McpHttp, token_for: Any, browser: Browser, fake_github: FakeGitHub, db: AsyncEngine
) -> None:
    """The /connections page's Disconnect button does what the disconnect_account tool does."""
    user = fresh_user("disconnect-page")
    token = token_for(user)
    await connect(mcp, browser, token, user)
    github_token = fake_github.issued_access_tokens[-1]
    csrf = await browser.csrf_token("/connections")

    posted = await browser.post("/connections/github/disconnect", data={"csrf": csrf})
    probe = await at_fake(
        fake_github, "GET", "/user", headers={"Authorization": f"Bearer {github_token}"}
    )

    assert posted.status_code == 303 and posted.headers["location"] == "/connections"
    assert await count_rows(db, "connections", subject=user) == 0
    assert fake_github.revocations == 1
    assert probe.status_code == 401


async def test_disconnecting_one_of_two_connections_of_a_github_account_revokes_its_token_only(
    mcp: McpHttp,
    token_for: Any,
    browser: Browser,
    second_browser: Browser,
    fake_github: FakeGitHub,
    db: AsyncEngine,
) -> None:
    """GitHub's grant revocation ends every token of the OAuth app for that GitHub account. Two
    broker users connected the same account (a shared account; the same holds for one user
    through two services): the first disconnect must revoke its own token only, or the other
    connection would stop working with nobody told; the last one revokes the whole grant."""
    fake_github.next_user = fresh_user("shared-gh")
    ann, ben = fresh_user("shared-ann"), fresh_user("shared-ben")
    await connect(mcp, browser, token_for(ann), ann)
    ann_github = fake_github.issued_access_tokens[-1]
    await connect(mcp, second_browser, token_for(ben), ben)
    ben_github = fake_github.issued_access_tokens[-1]

    first = await disconnect_with_the_tool(mcp, token_for(ann))
    after_first = (fake_github.revocations, fake_github.grant_revocations)
    live_after_first = (fake_github.is_live(ann_github), fake_github.is_live(ben_github))
    whoami = await mcp.call_tool(token_for(ben), "github_whoami", {})
    last = await disconnect_with_the_tool(mcp, token_for(ben))

    for done in (first, last):
        assert tool_result(done)["structuredContent"]["status"] == "disconnected"
        assert tool_result(done)["structuredContent"]["revoked_upstream"] is True
    assert after_first == (1, 0)
    assert live_after_first == (False, True)
    assert tool_result(whoami)["structuredContent"]["login"] == fake_github.next_user
    assert (fake_github.revocations, fake_github.grant_revocations) == (2, 1)
    assert not fake_github.is_live(ben_github)
    assert await count_rows(db, "connections", subject=ann) == 0
    assert await count_rows(db, "connections", subject=ben) == 0
