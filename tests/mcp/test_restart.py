"""J6: the broker killed with SIGKILL mid-flow and started again on the same configuration and
database (SECURITY.md §J).

A flow's state lives in the database, and what the client and the browser hold was derived from
the configured keys: the client's requestState, the browser's session cookie and the form's CSRF
token issued before the crash all still verify after it, and the flow finishes as if nothing had
happened. Killed, not stopped: no shutdown work may be needed for this.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy.ext.asyncio import AsyncEngine

from app.db import create_engine

from ..conftest import DEMO_PROVIDER, flow_row
from ..connect import Stack, dedicated_stack, unique
from ..support.broker import BrokerProcess
from ..support.clients import Browser, McpHttp, flow_id_from
from ..support.schema import validate_response
from .test_retry import API_KEY, retry, round_one, tool_result


@pytest.fixture(scope="module")
def stack(workdir: Path) -> Iterator[Stack]:
    with dedicated_stack(workdir, "restart", providers={"demo": DEMO_PROVIDER}) as stack:
        yield stack


async def crash_and_restart(broker: BrokerProcess) -> None:
    await asyncio.to_thread(broker.kill)
    await asyncio.to_thread(broker.restart)


async def test_j6_flow_killed_while_pending_and_once_completed_still_finishes(
    stack: Stack,
) -> None:
    """Killed with the flow pending: the old requestState still verifies (the retry gets the
    same URL again), and the browser's session and CSRF token from before the crash submit the
    key without a new login. Killed again with the flow completed: the retry gets the result."""
    broker = stack.broker
    user = unique("j6")
    token = stack.token(user)
    mcp, browser = McpHttp(broker.mcp_url), Browser(broker.url)
    db = create_engine(broker.database_url, pool_size=1)
    try:
        first, _, flow_id = await round_one(mcp, token)
        await browser.login_as(user, next_path=f"/connect/{flow_id}")
        csrf = await browser.csrf_token(f"/connect/{flow_id}")

        await crash_and_restart(broker)

        waited = await retry(mcp, token, first["requestState"])
        assert waited.status_code == 200, waited.text
        body = waited.json()
        assert "result" in body, body  # not -32602: the state from before the crash verifies
        validate_response(body, "InputRequiredResult")
        assert flow_id_from(body["result"])[1] == flow_id
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
    finally:
        await mcp.aclose()
        await browser.aclose()
        await db.dispose()


async def _status(db: AsyncEngine, flow_id: str) -> str | None:
    row = await flow_row(db, flow_id)
    return None if row is None else str(row["status"])
