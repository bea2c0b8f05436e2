"""A disconnected grant the provider did not confirm revoking is revoked later (DESIGN.md §3.3).

The broker deletes the connection and queues the revocation in one transaction, asks GitHub once
in the request, and its housekeeping sweep (app/connect/revocations.py) asks again until GitHub
confirms or the attempts run out. The sweeps here run in the test's process, on the broker's
database and configuration, with the clock moved past the retry delays (time-machine); the
broker processes' own sweeps run on the real clock and find nothing due meanwhile.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx2
import pytest
import time_machine
from sqlalchemy import delete, select
from sqlalchemy.ext.asyncio import AsyncEngine

from app import credentials
from app.auth.principal import Principal
from app.clock import utcnow
from app.config import load_settings
from app.connect import revocations
from app.main import Shared, build_shared
from app.mcp.registry import ToolRegistry
from app.models import BROKER_AUDIENCE, Connection, PendingRevocation

from ..conftest import count_rows
from ..support.broker import BrokerProcess, cli, serve_replica
from ..support.clients import Browser, McpHttp
from ..support.fake_github import FakeGitHub
from .flows import connect, tool_result
from .helpers import unique as fresh_user
from .test_refresh_revoke import (
    ask_to_disconnect,
    at_fake,
    confirm_disconnect,
    disconnect_with_the_tool,
    github_received_revocations,
    users_with_github,
)

pytestmark = [pytest.mark.usefixtures("_fresh_fake"), pytest.mark.both_databases]


@pytest.fixture
def _fresh_fake(fake_github: FakeGitHub) -> Iterator[None]:
    fake_github.reset()
    yield
    fake_github.reset()


async def open_runtime(broker: BrokerProcess) -> Shared:
    return build_shared(load_settings(broker.config_path), ToolRegistry())


async def close_runtime(runtime: Shared) -> None:
    await runtime.http.aclose()
    await runtime.store.close()
    await runtime.engine.dispose()


@pytest.fixture
async def runtime(broker: BrokerProcess) -> AsyncIterator[Shared]:
    """The broker's configuration and database, in this process: its sweep is ours to run."""
    opened = await open_runtime(broker)
    yield opened
    await close_runtime(opened)


@contextlib.contextmanager
def later(seconds: float) -> Iterator[None]:
    """This process's clock `seconds` ahead (asyncio's monotonic clock is left alone)."""
    with time_machine.travel(time.time() + seconds, tick=True):
        yield


async def github_answers(fake: FakeGitHub, token: str) -> int:
    """GitHub's status for /user with this access token: 200 while the grant lives."""
    response = await at_fake(fake, "GET", "/user", headers={"Authorization": f"Bearer {token}"})
    return response.status_code


async def pending_for(db: AsyncEngine, user: str) -> list[tuple[int, str | None]]:
    """(attempts, last_error) of the user's queued revocations."""
    async with db.connect() as connection:
        rows = await connection.execute(
            select(PendingRevocation.attempts, PendingRevocation.last_error).where(
                PendingRevocation.subject == user
            )
        )
        return [(attempts, error) for attempts, error in rows]


async def disconnected_while_github_fails(
    mcp: McpHttp, token_for: Any, browser: Browser, fake: FakeGitHub, prefix: str
) -> tuple[str, str, httpx2.Response]:
    """A fresh user connects GitHub, then disconnects while GitHub's revocation endpoint answers
    500: the user, their GitHub access token and the disconnect's answer."""
    user = fresh_user(prefix)
    token = token_for(user)
    await connect(mcp, browser, token, user)
    github_token = fake.issued_access_tokens[-1]
    fake.revoke_fault = "500"
    return user, github_token, await disconnect_with_the_tool(mcp, token)


async def test_a_revocation_github_failed_is_retried_until_github_confirms(
    mcp: McpHttp,
    token_for: Any,
    browser: Browser,
    fake_github: FakeGitHub,
    db: AsyncEngine,
    runtime: Shared,
) -> None:
    """GitHub answers the disconnect's revocation with a 500: the connection is gone at once, the
    user is told the revocation is not confirmed yet, and a sweep after the retry delay (not
    before) revokes the grant: GitHub then refuses the token."""
    user, github_token, done = await disconnected_while_github_fails(
        mcp, token_for, browser, fake_github, "revoke-retry"
    )
    queued = await pending_for(db, user)
    await runtime.revoker.sweep()  # the sweep is global: other tests' rows may be due
    left_too_early = await pending_for(db, user)
    alive_meanwhile = await github_answers(fake_github, github_token)
    with later(revocations.FIRST_RETRY_SECONDS + 1):
        attempted = await runtime.revoker.sweep()

    result = tool_result(done)
    assert result["structuredContent"]["revoked_upstream"] is False
    assert "could not confirm revoking its grant yet" in result["content"][0]["text"]
    assert await count_rows(db, "connections", subject=user) == 0
    assert queued == [(1, "revocation_status_500")]
    assert (left_too_early, alive_meanwhile) == (queued, 200)
    assert attempted >= 1
    assert await github_answers(fake_github, github_token) == 401
    assert await pending_for(db, user) == []


async def test_a_revocation_left_by_a_process_that_died_is_made_by_another(
    broker: BrokerProcess,
    mcp: McpHttp,
    token_for: Any,
    fake_github: FakeGitHub,
    db: AsyncEngine,
    runtime: Shared,
) -> None:
    """A replica is killed (SIGKILL) while GitHub holds its revocation request: the connection
    was already deleted and the grant still lives at GitHub, but the queued revocation survives
    the process. Another process's sweep makes it once the dead one's claim has run out."""
    (user,) = await users_with_github(broker, mcp, token_for, "dies", 1)
    github_token = fake_github.issued_access_tokens[-1]
    replica = serve_replica(broker, name="dies-revoking")
    client = McpHttp(replica.mcp_url)
    token = token_for(user, audience=replica.mcp_url)
    confirming: asyncio.Task[Any] | None = None
    try:
        state = await ask_to_disconnect(client, token)
        fake_github.revoke_fault = "timeout"
        confirming = asyncio.create_task(confirm_disconnect(client, token, state))
        await github_received_revocations(fake_github, 1)
        replica.kill()
    finally:
        if confirming is not None:
            confirming.cancel()
            with contextlib.suppress(BaseException):
                await confirming
        await client.aclose()
        replica.stop()

    connections_left = await count_rows(db, "connections", subject=user)
    queued = await pending_for(db, user)
    alive_after_the_crash = await github_answers(fake_github, github_token)
    still_claimed = await runtime.revoker.sweep()
    with later(revocations.CLAIM_SECONDS + 1):
        attempted = await runtime.revoker.sweep()

    assert connections_left == 0
    assert queued == [(0, None)]
    assert alive_after_the_crash == 200
    assert still_claimed == 0
    assert attempted == 1
    assert await github_answers(fake_github, github_token) == 401
    assert await pending_for(db, user) == []


async def test_a_revocation_github_keeps_failing_is_given_up_after_the_last_attempt(
    mcp: McpHttp,
    token_for: Any,
    browser: Browser,
    fake_github: FakeGitHub,
    db: AsyncEngine,
    runtime: Shared,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Each failure doubles the wait (60 s up to an hour); after MAX_ATTEMPTS the queued
    revocation is dropped with a `revocation.abandoned` warning naming the provider, for an
    operator to act on. A sweep before a retry is due attempts nothing."""
    fake_github.sticky_faults = True
    user, _, _ = await disconnected_while_github_fails(
        mcp, token_for, browser, fake_github, "revoke-abandoned"
    )

    ahead, attempted, early = 0.0, [], []
    with caplog.at_level(logging.INFO, logger="broker.security"):
        for attempts in range(1, revocations.MAX_ATTEMPTS):
            delay = revocations.retry_delay(attempts).total_seconds()
            with later(ahead + delay - 5):
                early.append(await runtime.revoker.sweep())
            ahead += delay + 1
            with later(ahead):
                attempted.append(await runtime.revoker.sweep())
            queued = await pending_for(db, user)
            if attempts < revocations.MAX_ATTEMPTS - 1:
                assert queued == [(attempts + 1, "revocation_status_500")]

    assert early == [0] * (revocations.MAX_ATTEMPTS - 1)
    assert attempted == [1] * (revocations.MAX_ATTEMPTS - 1)
    assert fake_github.revocations == revocations.MAX_ATTEMPTS
    assert await pending_for(db, user) == []
    abandoned = [r.getMessage() for r in caplog.records if "revocation.abandoned" in r.getMessage()]
    assert len(abandoned) == 1
    assert "provider=github" in abandoned[0]
    assert f"attempts={revocations.MAX_ATTEMPTS}" in abandoned[0]
    assert [revocations.retry_delay(n).total_seconds() for n in (1, 2, 7, 9)] == [
        60,
        120,
        3600,
        3600,
    ]


async def test_a_sweep_racing_another_process_s_claim_skips_the_revocation_it_claimed(
    mcp: McpHttp,
    token_for: Any,
    browser: Browser,
    fake_github: FakeGitHub,
    db: AsyncEngine,
    runtime: Shared,
) -> None:
    """Each attempt is claimed by one conditional UPDATE. Another process's claim of a due
    revocation is still uncommitted when a sweep starts: the sweep waits for it (PostgreSQL's row
    lock, SQLite's write lock) and then claims nothing, so GitHub is not asked twice."""
    user, _, _ = await disconnected_while_github_fails(
        mcp, token_for, browser, fake_github, "revoke-race"
    )

    with later(revocations.FIRST_RETRY_SECONDS + 1):
        async with db.connect() as other_process:
            claiming = await other_process.begin()
            claimed = (await other_process.execute(revocations.claim_due(utcnow()))).all()
            racing = asyncio.create_task(runtime.revoker.sweep())
            await asyncio.sleep(0.5)
            waited = not racing.done()
            await claiming.commit()
        attempted = await asyncio.wait_for(racing, timeout=10)

    assert [row.subject for row in claimed] == [user]
    assert waited
    assert attempted == 0
    assert fake_github.revocations == 1
    assert await pending_for(db, user) == [(1, "revocation_status_500")]
    async with db.begin() as connection:  # leave nothing for the broker's own sweep
        await connection.execute(delete(PendingRevocation).where(PendingRevocation.subject == user))


async def test_a_revocation_for_a_provider_no_longer_configured_is_dropped(
    db: AsyncEngine, runtime: Shared, caplog: pytest.LogCaptureFixture
) -> None:
    """A queued revocation whose provider left the configuration cannot be made: the sweep drops
    it with a warning instead of keeping it forever."""
    user = fresh_user("revoke-gone")
    async with runtime.sessionmaker.begin() as session:
        session.add(
            PendingRevocation(
                issuer=runtime.settings.identity.issuer,
                subject=user,
                provider="gone",
                audience=BROKER_AUDIENCE,
                sealed_credential="not-opened",
                key_id="k",
                attempts=0,
                next_attempt_at=utcnow(),
                created_at=utcnow(),
            )
        )
    with caplog.at_level(logging.WARNING, logger="broker.security"):
        attempted = await runtime.revoker.sweep()

    assert attempted == 1
    assert await pending_for(db, user) == []
    assert any(
        "revocation.abandoned provider=gone" in r.getMessage()
        and "reason=provider_not_configured" in r.getMessage()
        for r in caplog.records
    )


async def test_an_operator_lists_the_revocations_still_to_make(
    broker: BrokerProcess,
    mcp: McpHttp,
    token_for: Any,
    browser: Browser,
    fake_github: FakeGitHub,
    db: AsyncEngine,
) -> None:
    """`connect-broker revocations list`: one line per queued revocation, saying whose grant,
    at which provider, how far the retries went and why; never its tokens."""
    user, github_token, _ = await disconnected_while_github_fails(
        mcp, token_for, browser, fake_github, "revoke-list"
    )
    async with db.connect() as connection:
        sealed = (
            await connection.execute(
                select(PendingRevocation.sealed_credential).where(PendingRevocation.subject == user)
            )
        ).scalar_one()

    listed = cli("revocations", "list", config_path=broker.config_path)

    assert listed.returncode == 0, listed.stderr
    mine = [line.split("\t") for line in listed.stdout.splitlines() if f"\t{user}\t" in line]
    assert len(mine) == 1
    revocation_id, provider, issuer, subject, attempts, error, next_at, queued_at = mine[0]
    assert int(revocation_id) > 0
    assert (provider, issuer, subject) == ("github", broker.config.issuer, user)
    assert (attempts, error) == ("1", "revocation_status_500")
    assert queued_at < next_at  # ISO 8601 UTC: text order is time order
    assert github_token not in listed.stdout + listed.stderr
    assert sealed not in listed.stdout


async def test_a_grant_replacing_a_connection_has_the_replaced_token_revoked(
    mcp: McpHttp,
    token_for: Any,
    browser: Browser,
    fake_github: FakeGitHub,
    db: AsyncEngine,
    runtime: Shared,
) -> None:
    """The user grants the same GitHub account again (a step-up to more scopes): the new grant
    replaces the connection, and the replaced token's revocation is queued with it, due at once:
    the sweep revokes that token only. It does not stay valid at GitHub with nobody holding it,
    and the new one, the same account's, keeps working."""
    fake_github.next_user = fresh_user("replaced-gh")
    user = fresh_user("replaced")
    token = token_for(user)
    await connect(mcp, browser, token, user)
    replaced = fake_github.issued_access_tokens[-1]
    await connect(mcp, browser, token, user, {"provider": "github", "scopes": ["repo"]})
    current = fake_github.issued_access_tokens[-1]
    grant_revocations = fake_github.grant_revocations
    queued = await pending_for(db, user)

    await runtime.revoker.sweep()  # the sweep is global: other tests' rows may be due

    assert replaced != current
    assert queued == [(0, None)]
    assert await github_answers(fake_github, replaced) == 401
    assert await github_answers(fake_github, current) == 200
    assert fake_github.grant_revocations == grant_revocations
    assert await count_rows(db, "connections", subject=user) == 1
    assert await pending_for(db, user) == []
    whoami = await mcp.call_tool(token, "github_whoami", {})
    assert tool_result(whoami)["structuredContent"]["login"] == fake_github.next_user


async def test_a_grant_adopting_a_connection_of_old_has_its_token_revoked(
    mcp: McpHttp,
    token_for: Any,
    browser: Browser,
    fake_github: FakeGitHub,
    db: AsyncEngine,
    runtime: Shared,
) -> None:
    """A connection made before accounts were told apart (no upstream account id) is taken over
    by a new grant of the account with its label: its token, which GitHub never expires, is
    revoked like any replaced token, not left valid with nobody holding it."""
    fake_github.next_user = fresh_user("adopted-gh")
    user = fresh_user("adopted")
    token = token_for(user)
    await connect(mcp, browser, token, user)
    old = fake_github.issued_access_tokens[-1]
    async with runtime.sessionmaker.begin() as session:  # as it was stored before ids were kept
        row = (
            await session.execute(select(Connection).where(Connection.subject == user))
        ).scalar_one()
        label, principal = row.account_label, Principal(row.issuer, row.subject)
        await session.delete(row)
        await session.flush()
        await credentials.store(
            session,
            keys=runtime.keys.sealing,
            principal=principal,
            provider="github",
            audience=BROKER_AUDIENCE,
            secret={"access_token": old},
            account_label=label,
        )
    await connect(mcp, browser, token, user, {"provider": "github", "scopes": ["repo"]})
    current = fake_github.issued_access_tokens[-1]
    queued = await pending_for(db, user)

    await runtime.revoker.sweep()

    assert queued == [(0, None)]
    assert await github_answers(fake_github, old) == 401
    assert await github_answers(fake_github, current) == 200
    assert await count_rows(db, "connections", subject=user) == 1


async def test_a_grant_of_another_account_revokes_nothing(
    mcp: McpHttp, token_for: Any, browser: Browser, fake_github: FakeGitHub, db: AsyncEngine
) -> None:
    """A second account of the provider adds a connection: both tokens stay, nothing is queued."""
    user = fresh_user("two-accounts")
    token = token_for(user)
    fake_github.next_user = fresh_user("work-gh")
    await connect(mcp, browser, token, user)
    work = fake_github.issued_access_tokens[-1]
    fake_github.next_user = fresh_user("home-gh")
    await connect(mcp, browser, token, user, {"provider": "github", "account": "new"})

    assert await pending_for(db, user) == []
    assert await github_answers(fake_github, work) == 200
    assert await count_rows(db, "connections", subject=user) == 2
