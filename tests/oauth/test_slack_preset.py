"""The Slack preset against a fake Slack (tests/support/fake_slack.py): the broker connects the
user's own token (asked with `user_scope`, answered under `authed_user`), not the app's bot token,
reads Slack's Web API errors, which come in a 200, when it revokes on disconnect, and refreshes
a token of an app with token rotation (the new pair comes at the top level of the answer).
"""

from __future__ import annotations

from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from types import SimpleNamespace
from typing import Any

import pytest
from sqlalchemy import delete
from sqlalchemy.ext.asyncio import AsyncEngine

from app import credentials
from app.crypto import Keyring
from app.models import PendingRevocation

from ..conftest import count_rows, flow_row
from ..support.broker import BrokerProcess, LogWindow
from ..support.clients import Browser, McpHttp
from ..support.fake_slack import ROTATED_TOKEN_SECONDS, FakeSlack
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
from .test_refresh_revoke import disconnect_with_the_tool
from .test_revocation_retries import pending_for

pytestmark = pytest.mark.both_databases

SLACK = {"provider": "slack"}


@pytest.fixture(autouse=True)
def _plain_slack(fake_slack: FakeSlack) -> Iterator[None]:
    """Each test starts from a plain app, and leaves none of its faults to the next."""
    fake_slack.reset()
    yield
    fake_slack.reset()


async def connect_slack(mcp: McpHttp, browser: Browser, token_for: Any, prefix: str) -> str:
    user = fresh_user(prefix)
    await connect(mcp, browser, token_for(user), user, SLACK)
    return user


async def stored_secret(broker: BrokerProcess, db: AsyncEngine, user: str) -> dict[str, str]:
    row = SimpleNamespace(**await connection_row(db, user, "slack"))
    keys = Keyring.parse(tuple(broker.config.encryption))
    secret = credentials.open_row(row, keys=keys)
    assert secret is not None
    return secret


async def test_slack_connects_the_user_s_own_token(
    mcp: McpHttp,
    token_for: Any,
    browser: Browser,
    broker: BrokerProcess,
    fake_slack: FakeSlack,
    db: AsyncEngine,
) -> None:
    """The authorize request names the scopes as `user_scope`; the stored credential is the
    `authed_user` token (xoxp-…); the account is the workspace's name."""
    user = await connect_slack(mcp, browser, token_for, "slack-user")

    asked = fake_slack.authorize_requests[-1]
    listed = tool_result(await mcp.call_tool(token_for(user), "list_connections"))
    secret = await stored_secret(broker, db, user)

    assert asked["user_scope"] == "users:read"
    assert "scope" not in asked
    (item,) = listed["structuredContent"]["connections"]
    assert (item["provider"], item["account"]) == ("slack", "Acme Workspace")
    assert secret == {"access_token": fake_slack.issued_user_tokens[-1]}
    assert secret["access_token"].startswith("xoxp-")


async def test_slack_disconnect_revokes_the_user_s_token(
    mcp: McpHttp, token_for: Any, browser: Browser, fake_slack: FakeSlack, db: AsyncEngine
) -> None:
    user = await connect_slack(mcp, browser, token_for, "slack-revoke")
    slack_token = fake_slack.issued_user_tokens[-1]

    done = await disconnect_with_the_tool(mcp, token_for(user), "slack")

    assert tool_result(done)["structuredContent"]["revoked_upstream"] is True
    assert fake_slack.revocations[-1] == slack_token
    assert not fake_slack.works(slack_token)
    assert await count_rows(db, "pending_revocations", subject=user) == 0


async def test_slack_s_error_in_a_200_is_not_taken_for_a_revocation(
    mcp: McpHttp, token_for: Any, browser: Browser, fake_slack: FakeSlack, db: AsyncEngine
) -> None:
    """auth.revoke answers `{"ok": false, "error": "fatal_error"}` with a 200: the user is told
    the revocation is not confirmed, and it stays queued for the broker to retry."""
    user = await connect_slack(mcp, browser, token_for, "slack-not-ok")
    slack_token = fake_slack.issued_user_tokens[-1]
    fake_slack.revoke_fault = "not_ok"

    done = await disconnect_with_the_tool(mcp, token_for(user), "slack")
    queued = await count_rows(db, "pending_revocations", subject=user)
    async with db.begin() as connection:  # leave nothing for the broker's own sweep
        await connection.execute(delete(PendingRevocation).where(PendingRevocation.subject == user))

    result = tool_result(done)
    assert result["structuredContent"]["revoked_upstream"] is False
    assert "could not confirm" in result["content"][0]["text"]
    assert fake_slack.works(slack_token)
    assert queued == 1


async def test_a_revocation_answer_past_the_size_cap_is_not_taken_for_a_confirmation(
    mcp: McpHttp, token_for: Any, browser: Browser, fake_slack: FakeSlack, db: AsyncEngine
) -> None:
    """Revocation answers are read under the cap every provider answer has (64 KiB): a 96 KiB
    body is not read to its end, so the revocation is not confirmed and stays queued."""
    user = await connect_slack(mcp, browser, token_for, "slack-huge")
    fake_slack.revoke_fault = "huge"

    done = await disconnect_with_the_tool(mcp, token_for(user), "slack")
    queued = await pending_for(db, user)
    async with db.begin() as connection:  # leave nothing for the broker's own sweep
        await connection.execute(delete(PendingRevocation).where(PendingRevocation.subject == user))

    assert tool_result(done)["structuredContent"]["revoked_upstream"] is False
    assert queued == [(1, "revocation_response_too_large")]


async def test_a_slack_token_already_dead_counts_as_revoked(
    mcp: McpHttp, token_for: Any, browser: Browser, fake_slack: FakeSlack, db: AsyncEngine
) -> None:
    """The user removed the app in Slack first: auth.revoke answers `invalid_auth`, which is
    what revoking was for; nothing is left to retry."""
    user = await connect_slack(mcp, browser, token_for, "slack-dead")
    fake_slack.kill(fake_slack.issued_user_tokens[-1])

    done = await disconnect_with_the_tool(mcp, token_for(user), "slack")

    assert tool_result(done)["structuredContent"]["revoked_upstream"] is True
    assert await count_rows(db, "pending_revocations", subject=user) == 0


@pytest.fixture
def rotating_slack(fake_slack: FakeSlack) -> FakeSlack:
    """The fake Slack as an app with token rotation, for one test (`_plain_slack` undoes it)."""
    fake_slack.rotation = True
    return fake_slack


async def test_a_rotated_slack_token_is_refreshed_before_use_and_the_new_pair_stored(
    mcp: McpHttp,
    token_for: Any,
    browser: Browser,
    broker: BrokerProcess,
    rotating_slack: FakeSlack,
    db: AsyncEngine,
) -> None:
    """With token rotation the user's token lasts 12 hours. Once due, the next call refreshes it
    with the stored refresh token, reads the new pair from the top level of Slack's answer (not
    from the token-less `authed_user` beside it) and stores both."""
    user = await connect_slack(mcp, browser, token_for, "slack-rotation")
    first_token = rotating_slack.issued_user_tokens[-1]
    first_refresh = rotating_slack.issued_refresh_tokens[-1]
    refreshes_before = len(rotating_slack.refresh_requests)
    stored = await stored_secret(broker, db, user)
    row = await connection_row(db, user, "slack")
    await make_due(db, row["id"])

    called = await mcp.call_tool(token_for(user), "connect_account", SLACK)
    refreshed = await stored_secret(broker, db, user)
    after = await connection_row(db, user, "slack")

    assert stored == {"access_token": first_token, "refresh_token": first_refresh}
    lifetime = timedelta(seconds=ROTATED_TOKEN_SECONDS)
    assert row["expires_at"] > datetime.now(UTC) + lifetime - timedelta(minutes=5)
    assert tool_result(called)["structuredContent"]["status"] == "connected"
    assert [r["refresh_token"] for r in rotating_slack.refresh_requests[refreshes_before:]] == [
        first_refresh
    ]
    assert refreshed == {
        "access_token": rotating_slack.issued_user_tokens[-1],
        "refresh_token": rotating_slack.issued_refresh_tokens[-1],
    }
    assert refreshed["access_token"] != first_token
    assert refreshed["refresh_token"] != first_refresh
    assert after["status"] == "active"
    assert after["expires_at"] > datetime.now(UTC) + lifetime - timedelta(minutes=5)
    assert first_token not in called.text and first_refresh not in called.text


async def test_a_slack_refresh_refused_after_the_app_was_removed_needs_reauth(
    mcp: McpHttp,
    token_for: Any,
    browser: Browser,
    broker: BrokerProcess,
    rotating_slack: FakeSlack,
    db: AsyncEngine,
) -> None:
    """Slack answers a dead refresh token with `{"ok": false, "error": "invalid_refresh_token"}`
    in a 200: the broker takes it as a refused grant, marks the connection `needs_reauth`, and
    the call elicits a new connect flow."""
    user = await connect_slack(mcp, browser, token_for, "slack-removed")
    await make_due(db, (await connection_row(db, user, "slack"))["id"])
    rotating_slack.remove_app()
    log = LogWindow(broker)
    refreshes_before = len(rotating_slack.refresh_requests)

    called = await mcp.call_tool(token_for(user), "connect_account", SLACK)

    assert input_required(called).key == "connect_slack"
    assert len(rotating_slack.refresh_requests) == refreshes_before + 1
    assert (await connection_row(db, user, "slack"))["status"] == "needs_reauth"
    assert await log.shows("credential.refresh_rejected provider=slack")


async def test_an_install_that_granted_only_the_bot_token_connects_nothing(
    mcp: McpHttp, token_for: Any, browser: Browser, fake_slack: FakeSlack, db: AsyncEngine
) -> None:
    """The answer has no user token, only the workspace's bot token at the top level: the broker
    refuses it (`token_type` "bot" is not the user's) and stores nothing; the flow stays open
    for another try."""
    user = fresh_user("slack-bot-only")
    opened = await elicit(mcp, token_for(user), SLACK)
    await browser.login_as(user, next_path=f"/connect/{opened.flow_id}")
    callback_url = await authorize(browser, opened.flow_id)
    fake_slack.bot_only = True

    callback = await return_to_broker(browser, callback_url)
    flow = await flow_row(db, opened.flow_id) or {}
    page = await browser.get(f"/connect/{opened.flow_id}")

    assert callback.status_code == 303
    assert "Slack granted no token for your own account" in page.text
    assert "Nothing was stored" in page.text
    assert fake_slack.bot_only is False  # the exchange was answered as a bot-only install
    assert (flow["status"], flow["failure"]) == ("pending", "unsupported_token_type")
    assert await count_rows(db, "connections", subject=user) == 0
