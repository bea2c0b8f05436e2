"""Every lifecycle event lands in `audit_events`, in the transaction of the change it records,
and no row holds a secret.

The flows are driven as users drive them (tool calls, the browser, the fake GitHub); the broker's
housekeeping (flow expiry, revocation retries) is run in this process on the broker's database,
as the revocation tests do.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest
from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncEngine, async_sessionmaker

from app.clock import utcnow
from app.connect import service as flows
from app.main import Shared
from app.models import BROKER_AUDIENCE, AuditEvent, PendingRevocation

from .integration_api.test_api import (
    API_KEY,
    ServiceApi,
    connected,
    fresh_name,
    input_required,
    register,
    submit_api_key,
)
from .oauth.flows import connect, elicit, make_due, press_continue, return_to_broker, tool_result
from .oauth.helpers import connection_row, expire
from .oauth.helpers import unique as fresh_user
from .oauth.test_refresh_revoke import ask_to_disconnect, confirm_disconnect
from .oauth.test_revocation_retries import close_runtime, open_runtime
from .support.broker import BrokerProcess
from .support.clients import Browser, McpHttp, provider_url
from .support.fake_github import FakeGitHub

pytestmark = pytest.mark.both_databases


@pytest.fixture(autouse=True)
def _fresh_fake(fake_github: FakeGitHub) -> Iterator[None]:
    fake_github.reset()
    yield
    fake_github.reset()


@pytest.fixture
async def runtime(broker: BrokerProcess) -> AsyncIterator[Shared]:
    """The broker's configuration and database in this process: its sweeps are ours to run."""
    opened = await open_runtime(broker)
    yield opened
    await close_runtime(opened)


async def events_of(db: AsyncEngine, user: str) -> list[dict[str, Any]]:
    """The user's audit rows, oldest first, every column."""
    statement = (
        select(AuditEvent.__table__).where(AuditEvent.subject == user).order_by(AuditEvent.id)
    )
    async with db.connect() as connection:
        return [dict(row) for row in (await connection.execute(statement)).mappings()]


def names(rows: list[dict[str, Any]]) -> list[str]:
    return [row["event"] for row in rows]


def assert_no_secret(rows: list[dict[str, Any]], *secrets: str) -> None:
    text = repr(rows)
    for secret in secrets:
        assert secret
        assert secret not in text


async def test_a_connection_made_in_the_browser_records_created_completed_and_stored(
    mcp: McpHttp,
    token_for: Any,
    browser: Browser,
    fake_github: FakeGitHub,
    db: AsyncEngine,
    broker: BrokerProcess,
) -> None:
    user = fresh_user("audit-connect")
    token = token_for(user)

    await connect(mcp, browser, token, user)

    rows = await events_of(db, user)
    assert names(rows) == ["flow.created", "flow.completed", "credential.stored"]
    issuer = broker.config.issuer
    for row in rows:
        assert (row["actor_kind"], row["actor_id"]) == ("user", f"{issuer}|{user}")
        assert (row["issuer"], row["provider"], row["audience"]) == (issuer, "github", "mcp")
        assert row["request_id"]
    created, completed, stored = rows
    assert created["account_label"] is None
    assert completed["account_label"] == stored["account_label"] == "@octocat"
    assert created["request_id"] != completed["request_id"]  # the tool call, then the callback
    assert completed["request_id"] == stored["request_id"]  # one transaction, one request
    assert_no_secret(rows, token, fake_github.issued_access_tokens[-1])


async def test_a_decline_and_a_cancel_from_the_client_are_recorded(
    mcp: McpHttp, token_for: Any, db: AsyncEngine
) -> None:
    user = fresh_user("audit-decline")
    token = token_for(user)
    for action in ("decline", "cancel"):
        round_one = await elicit(mcp, token)
        await mcp.call_tool(
            token,
            "connect_account",
            {"provider": "github"},
            input_responses={round_one.key: {"action": action}},
            request_state=round_one.request_state,
        )

    rows = await events_of(db, user)

    assert names(rows) == ["flow.created", "flow.declined", "flow.created", "flow.cancelled"]
    assert {row["actor_kind"] for row in rows} == {"user"}
    assert all(row["request_id"] for row in rows)


async def test_a_decline_in_the_browser_is_recorded_once(
    mcp: McpHttp, token_for: Any, browser: Browser, db: AsyncEngine
) -> None:
    user = fresh_user("audit-page-decline")
    round_one = await elicit(mcp, token_for(user))
    await browser.login_as(user, next_path=f"/connect/{round_one.flow_id}")
    csrf = await browser.csrf_token(f"/connect/{round_one.flow_id}")

    for _ in range(2):  # a double click: one transition, one event
        declined = await browser.post(f"/connect/{round_one.flow_id}/decline", data={"csrf": csrf})
        assert declined.status_code == 303

    assert names(await events_of(db, user)) == ["flow.created", "flow.declined"]


async def test_a_flow_past_its_expiry_is_recorded_expired_by_the_sweep(
    mcp: McpHttp, token_for: Any, db: AsyncEngine
) -> None:
    user = fresh_user("audit-expired")
    round_one = await elicit(mcp, token_for(user))
    await expire(db, round_one.flow_id)

    await flows.purge(async_sessionmaker(db, expire_on_commit=False))
    await flows.purge(async_sessionmaker(db, expire_on_commit=False))  # nothing more to record

    rows = await events_of(db, user)
    assert names(rows) == ["flow.created", "flow.expired"]
    assert (rows[1]["actor_kind"], rows[1]["actor_id"]) == ("broker", "broker")
    assert rows[1]["provider"] == "github"
    assert rows[1]["request_id"] is None


async def test_a_refresh_and_a_refresh_the_provider_rejects_are_recorded(
    mcp: McpHttp, token_for: Any, browser: Browser, fake_github: FakeGitHub, db: AsyncEngine
) -> None:
    fake_github.expiring_tokens = True
    user = fresh_user("audit-refresh")
    token = token_for(user)
    await connect(mcp, browser, token, user)
    connection_id = (await connection_row(db, user))["id"]
    await make_due(db, connection_id)
    tool_result(await mcp.call_tool(token, "github_whoami"))
    await mcp.call_tool(token, "github_whoami")  # not due any more: nothing to record
    await make_due(db, connection_id)
    fake_github.token_fault = "refresh_invalid"

    await mcp.call_tool(token, "github_whoami")

    rows = await events_of(db, user)
    assert names(rows)[3:] == [
        "credential.refreshed",
        "credential.refresh_rejected",
        "flow.created",  # the call that found the connection needing reauth elicits anew
    ]
    for row in rows[3:5]:
        assert (row["actor_kind"], row["provider"], row["account_label"]) == (
            "broker",
            "github",
            "@octocat",
        )
        assert row["request_id"]  # the tool call that needed the token
    assert_no_secret(
        rows, *fake_github.issued_access_tokens, *fake_github.issued_refresh_tokens, token
    )


async def test_a_disconnect_records_the_user_s_disconnect_and_the_upstream_revocation(
    mcp: McpHttp, token_for: Any, browser: Browser, db: AsyncEngine
) -> None:
    user = fresh_user("audit-disconnect")
    token = token_for(user)
    await connect(mcp, browser, token, user)

    asked = await ask_to_disconnect(mcp, token)
    tool_result(await confirm_disconnect(mcp, token, asked))

    rows = await events_of(db, user)
    assert names(rows)[3:] == ["connection.disconnected", "revocation.confirmed"]
    disconnected, revoked = rows[3:]
    assert disconnected["actor_kind"] == "user"
    assert disconnected["account_label"] == "@octocat"
    assert revoked["actor_kind"] == "broker"
    assert revoked["detail"] == "attempts=1"
    assert disconnected["request_id"] == revoked["request_id"]


async def test_a_revocation_given_up_is_recorded_abandoned(
    db: AsyncEngine, runtime: Shared
) -> None:
    user = fresh_user("audit-abandoned")
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

    await runtime.revoker.sweep()

    (row,) = await events_of(db, user)
    assert (row["event"], row["actor_kind"], row["provider"]) == (
        "revocation.abandoned",
        "broker",
        "gone",
    )
    assert row["detail"] == "attempts=1 reason=provider_not_configured"
    assert "not-opened" not in repr(row)


async def test_a_sibling_service_s_flow_is_recorded_with_the_service_as_actor(
    broker: BrokerProcess, browser: Browser, db: AsyncEngine
) -> None:
    service = register(broker, fresh_name("audited"))
    api = ServiceApi(broker.url, service)
    user = fresh_user("audit-service")
    who = {"issuer": broker.config.issuer, "subject": user}
    try:
        body, flow_id = input_required(await api.require("demo", who))
        await submit_api_key(browser, user, flow_id)
        connected(await api.resume("demo", who, body["requestState"]))
        assert (await api.delete("demo", who)).status_code == 200
    finally:
        await api.aclose()

    rows = await events_of(db, user)
    assert names(rows) == [
        "flow.created",
        "flow.completed",
        "credential.stored",
        "connection.disconnected",
    ]
    actors = [(row["actor_kind"], row["actor_id"]) for row in rows]
    assert actors == [
        ("service", service.name),
        ("user", f"{broker.config.issuer}|{user}"),
        ("user", f"{broker.config.issuer}|{user}"),
        ("service", service.name),
    ]
    assert {row["audience"] for row in rows} == {service.name}
    assert_no_secret(rows, API_KEY, service.secret)


async def test_starting_the_oauth_leg_records_nothing_but_the_provider_s_no_is_a_decline(
    mcp: McpHttp,
    token_for: Any,
    browser: Browser,
    fake_github: FakeGitHub,
    db: AsyncEngine,
) -> None:
    """Only lifecycle events are recorded: pressing Continue is not one; the user's refusal at
    the provider (`access_denied`) is the flow's decline."""
    user = fresh_user("audit-denied")
    round_one = await elicit(mcp, token_for(user))
    await browser.login_as(user, next_path=f"/connect/{round_one.flow_id}")
    fake_github.deny_next = True
    callback = await authorize_denied(browser, round_one.flow_id)
    await return_to_broker(browser, callback)

    assert names(await events_of(db, user)) == ["flow.created", "flow.declined"]


async def authorize_denied(browser: Browser, flow_id: str) -> str:
    """Continue, then the fake GitHub answers the authorize hop with `access_denied`: the
    callback URL it sends the browser back to."""
    started = await press_continue(browser, flow_id)
    denied = await browser.http.get(provider_url(started))
    location: str = denied.headers["location"]
    assert "error=access_denied" in location, location
    return location
