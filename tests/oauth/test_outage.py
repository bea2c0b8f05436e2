"""J2: the provider's redirect reaches the callback while the database is unavailable.

The callback claims the flow in the database before it spends the code at the provider, so an
outage at that moment answers a 503 page and calls nobody: the code is still good, and the user
reloading the same callback URL once the database is back completes the flow. The other order
would spend the code and lose the token.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from app.db import create_engine

from ..conftest import count_rows, github_provider
from ..connect import Stack, dedicated_stack
from ..mcp.test_retry import retry, tool_result
from ..support.clients import Browser, McpHttp
from ..support.fake_github import FakeGitHub
from ..support.outage import DatabaseOutage
from .helpers import approve_at_provider, arm, deliver, unique


@dataclass(frozen=True)
class OutageStack:
    stack: Stack
    fake: FakeGitHub
    outage: DatabaseOutage


@pytest.fixture
async def outage_stack(workdir: Path) -> AsyncIterator[OutageStack]:
    """A broker of its own whose database can be taken away, with a GitHub of its own."""
    with (
        FakeGitHub(redirect_uri="http://127.0.0.1:9/set-below") as fake,
        dedicated_stack(
            workdir, "callback-outage", providers={"github": github_provider(fake)}
        ) as stack,
    ):
        fake.redirect_uri = f"{stack.broker.url}/oauth/github/callback"
        outage = await DatabaseOutage.arrange(stack.broker)
        try:
            yield OutageStack(stack, fake, outage)
        finally:
            await outage.close()


async def test_j2_callback_during_a_database_outage_spends_no_code_and_completes_on_reload(
    outage_stack: OutageStack,
) -> None:
    stack, fake, outage = outage_stack.stack, outage_stack.fake, outage_stack.outage
    broker = stack.broker
    user = unique("j2")
    token = stack.token(user)
    mcp, browser = McpHttp(broker.mcp_url), Browser(broker.url)
    db = create_engine(broker.database_url, pool_size=1)
    try:
        armed = await arm(mcp, browser, token, user)
        back = await approve_at_provider(browser.http, armed.authorize_url)

        await outage.begin()
        during = await deliver(browser, back)
        await outage.end()

        assert during.status_code == 503, during.text
        assert "Temporarily unavailable" in during.text
        assert fake.token_calls == 0
        reloaded = await deliver(browser, back)
        assert reloaded.status_code == 303, reloaded.text
        assert reloaded.headers["location"] == f"/connect/{armed.flow_id}"
        answer = await retry(
            mcp,
            token,
            armed.opened.request_state,
            responses={armed.opened.key: {"action": "accept"}},
            arguments={"provider": "github"},
        )
        assert tool_result(answer)["structuredContent"]["status"] == "connected"
        assert fake.token_calls == 1
        assert await count_rows(db, "connections", subject=user, provider="github") == 1
    finally:
        await mcp.aclose()
        await browser.aclose()
        await db.dispose()
