"""Steps of a GitHub connect flow over HTTP, for the failure, refresh and revocation tests.

A test drives the same path a user does: the tool call that elicits, the broker login, "Continue"
on the consent page, the authorization at the fake GitHub, and the browser's return to the
callback. Each step is a helper so a test can put a fault between any two of them.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any
from urllib.parse import parse_qs, urlsplit

import httpx2
from sqlalchemy import update
from sqlalchemy.ext.asyncio import AsyncEngine

from app.models import Connection

from ..support.clients import Browser, McpHttp, flow_id_from, provider_url
from ..support.schema import validate_response


@dataclass(frozen=True)
class Elicited:
    """Round one of a tool call that needs a connection."""

    key: str
    flow_id: str
    request_state: str


def input_required(response: httpx2.Response) -> Elicited:
    """The URL-mode connect elicitation of an InputRequiredResult (wire shape checked)."""
    assert response.status_code == 200, response.text
    body = response.json()
    validate_response(body, "InputRequiredResult")
    result = body["result"]
    key, flow_id = flow_id_from(result)
    return Elicited(key, flow_id, result["requestState"])


def tool_result(response: httpx2.Response) -> dict[str, Any]:
    """The final CallToolResult (wire shape checked)."""
    assert response.status_code == 200, response.text
    body = response.json()
    assert body.get("result", {}).get("resultType") == "complete", body
    validate_response(body, "CallToolResult")
    result: dict[str, Any] = body["result"]
    assert not result.get("isError"), result
    return result


async def elicit(mcp: McpHttp, token: str, arguments: dict[str, Any] | None = None) -> Elicited:
    """Round one of `connect_account` for GitHub: the flow the user must finish."""
    response = await mcp.call_tool(token, "connect_account", arguments or {"provider": "github"})
    return input_required(response)


async def press_continue(browser: Browser, flow_id: str) -> httpx2.Response:
    """POST the consent form (a page that sends the browser on to the provider's authorize URL
    when it can start: `provider_url`)."""
    csrf = await browser.csrf_token(f"/connect/{flow_id}")
    return await browser.post(f"/connect/{flow_id}/start", data={"csrf": csrf})


async def authorize(browser: Browser, flow_id: str) -> str:
    """Continue on the consent page and approve at the fake; the callback URL it sends back."""
    started = await press_continue(browser, flow_id)
    approved = await browser.http.get(provider_url(started))
    assert approved.status_code == 302, approved.text
    location: str = approved.headers["location"]
    assert "code=" in location, location  # not an error redirect
    return location


async def return_to_broker(browser: Browser, callback_url: str) -> httpx2.Response:
    """The browser follows the provider's redirect to the broker's callback."""
    parts = urlsplit(callback_url)
    return await browser.get(f"{parts.path}?{parts.query}")


def code_of(callback_url: str) -> str:
    return parse_qs(urlsplit(callback_url).query)["code"][0]


async def connect(
    mcp: McpHttp,
    browser: Browser,
    token: str,
    user: str,
    arguments: dict[str, Any] | None = None,
    *,
    retried: bool = True,
) -> str:
    """Make a GitHub connection for `user` end to end; the completed flow's id. Not
    `retried`: the client never retries the call: the connection is stored, its credential never
    handed out (so the broker notes no use of it)."""
    arguments = arguments or {"provider": "github"}
    round_one = await elicit(mcp, token, arguments)
    await browser.login_as(user, next_path=f"/connect/{round_one.flow_id}")
    callback = await return_to_broker(browser, await authorize(browser, round_one.flow_id))
    assert callback.status_code == 303, callback.text
    if not retried:
        return round_one.flow_id
    retry = await mcp.call_tool(
        token,
        "connect_account",
        arguments,
        input_responses={round_one.key: {"action": "accept"}},
        request_state=round_one.request_state,
    )
    assert tool_result(retry)["structuredContent"]["status"] == "connected"
    return round_one.flow_id


async def make_due(db: AsyncEngine, connection_id: int, *, in_seconds: int = 60) -> None:
    """Move the stored access token's expiry inside the broker's refresh margin."""
    async with db.begin() as conn:
        await conn.execute(
            update(Connection)
            .where(Connection.id == connection_id)
            .values(expires_at=datetime.now(UTC) + timedelta(seconds=in_seconds))
        )
