"""The URL-mode connect flow over HTTP: round 1, the browser side, and the client's retry."""

from __future__ import annotations

from typing import Any

import pytest
from sqlalchemy.ext.asyncio import AsyncEngine

from ..conftest import count_rows, flow_row
from ..support.broker import BrokerProcess
from ..support.clients import Browser, McpHttp, flow_id_from
from ..support.schema import validate_response

pytestmark = pytest.mark.both_databases

API_KEY = "sk_CANARYKEY_connect_flow_1"


async def start_connect(mcp: McpHttp, token: str, provider: str = "demo") -> dict[str, Any]:
    response = await mcp.call_tool(token, "connect_account", {"provider": provider})
    assert response.status_code == 200, response.text
    body = response.json()
    validate_response(body, "InputRequiredResult")
    result: dict[str, Any] = body["result"]
    return result


async def submit_key(browser: Browser, flow_id: str, key: str = API_KEY) -> Any:
    csrf = await browser.csrf_token(f"/connect/{flow_id}")
    return await browser.post(f"/connect/{flow_id}/api-key", data={"csrf": csrf, "api_key": key})


async def test_round_one_answers_a_url_elicitation_holding_only_a_flow_id(
    mcp: McpHttp, token_for: Any, broker: BrokerProcess, db: AsyncEngine
) -> None:
    """DESIGN §3.1 step 3: the URL carries an opaque 43-character flow id and nothing else."""
    result = await start_connect(mcp, token_for("alice-r1"))

    key, flow_id = flow_id_from(result)
    params = result["inputRequests"][key]["params"]
    assert key == "connect_demo"
    assert params["mode"] == "url"
    assert params["url"] == f"{broker.url}/connect/{flow_id}"
    assert len(flow_id) == 43
    assert "requestState" in result
    row = await flow_row(db, flow_id)
    assert row is not None and row["status"] == "pending" and row["subject"] == "alice-r1"


async def test_api_key_flow_completes_and_the_retry_returns_connected(
    mcp: McpHttp, token_for: Any, browser: Browser, db: AsyncEngine
) -> None:
    """H7-style happy path without a browser: login, API-key form, retry gets the result."""
    token = token_for("alice-happy")
    result = await start_connect(mcp, token)
    key, flow_id = flow_id_from(result)

    await browser.login_as("alice-happy", next_path=f"/connect/{flow_id}")
    page = await browser.get(f"/connect/{flow_id}")
    assert page.status_code == 200
    assert 'type="password" name="api_key"' in page.text
    assert 'data-action="submit-api-key"' in page.text
    submitted = await submit_key(browser, flow_id)
    assert submitted.status_code == 303
    assert submitted.headers["location"] == f"/connect/{flow_id}"
    done = await browser.get(f"/connect/{flow_id}")
    assert "is connected" in done.text

    retry = await mcp.call_tool(
        token,
        "connect_account",
        {"provider": "demo"},
        input_responses={key: {"action": "accept"}},
        request_state=result["requestState"],
    )
    body = retry.json()
    validate_response(body, "CallToolResult")
    assert body["result"]["structuredContent"] == {
        "provider": "demo",
        "status": "connected",
        "account": None,
    }
    assert API_KEY not in retry.text
    assert (await flow_row(db, flow_id) or {})["status"] == "consumed"
    assert await count_rows(db, "connections", subject="alice-happy", provider="demo") == 1
