"""The GitHub preset end to end over HTTP: consent, authorize at the fake, callback, retry."""

from __future__ import annotations

from typing import Any
from urllib.parse import parse_qs, urlsplit

import httpx2
import pytest
from sqlalchemy.ext.asyncio import AsyncEngine

from ..conftest import count_rows, flow_row
from ..support.clients import Browser, McpHttp, flow_id_from, provider_url
from ..support.fake_github import FakeGitHub
from ..support.schema import validate_response

pytestmark = pytest.mark.both_databases


async def authorize_at_provider(browser: Browser, flow_id: str) -> httpx2.Response:
    """Press "Continue" on the consent page, let the provider approve, return its redirect."""
    csrf = await browser.csrf_token(f"/connect/{flow_id}")
    started = await browser.post(f"/connect/{flow_id}/start", data={"csrf": csrf})
    return await browser.http.get(provider_url(started))


async def test_github_connection_completes_and_the_retry_returns_the_account(
    mcp: McpHttp, token_for: Any, browser: Browser, fake_github: FakeGitHub, db: AsyncEngine
) -> None:
    token = token_for("gh-happy")
    first = (await mcp.call_tool(token, "connect_account", {"provider": "github"})).json()
    key, flow_id = flow_id_from(first["result"])
    await browser.login_as("gh-happy", next_path=f"/connect/{flow_id}")

    consent = await browser.get(f"/connect/{flow_id}")
    approved = await authorize_at_provider(browser, flow_id)
    query = parse_qs(urlsplit(approved.headers["location"]).query)
    callback = await browser.get(
        urlsplit(approved.headers["location"]).path, params={k: v[0] for k, v in query.items()}
    )
    done = await browser.get(callback.headers["location"])
    retry = await mcp.call_tool(
        token,
        "connect_account",
        {"provider": "github"},
        input_responses={key: {"action": "accept"}},
        request_state=first["result"]["requestState"],
    )
    whoami = await mcp.call_tool(token, "github_whoami")

    assert 'data-action="continue"' in consent.text and "read:user" in consent.text
    assert callback.status_code == 303 and callback.headers["location"] == f"/connect/{flow_id}"
    assert "Connected as <strong>@octocat</strong>" in done.text
    validate_response(retry.json(), "CallToolResult")
    assert retry.json()["result"]["structuredContent"] == {
        "provider": "github",
        "status": "connected",
        "account": "@octocat",
    }
    assert whoami.json()["result"]["structuredContent"] == {
        "login": "octocat",
        "id": 1,
        "name": "The Octocat",
    }
    assert "gho_" not in retry.text + whoami.text
    assert (await flow_row(db, flow_id) or {})["status"] == "consumed"
    assert await count_rows(db, "connections", subject="gh-happy", provider="github") == 1
