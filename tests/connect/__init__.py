"""Helpers shared by the connect-page and API-key-form tests.

`open_flow` starts a connect flow the way a client does (round 1 of `tools/call connect_account`);
a test that needs a specially configured broker runs its own with tests/support/stack.py.
"""

from __future__ import annotations

import secrets
from datetime import timedelta
from html.parser import HTMLParser
from typing import Any
from urllib.parse import urlsplit

import httpx2
from sqlalchemy import select, update
from sqlalchemy.ext.asyncio import AsyncEngine

from app.clock import utcnow
from app.models import Connection, Flow

from ..support.clients import Browser, McpHttp, flow_id_from
from ..support.schema import validate_response


def unique(name: str) -> str:
    """A user name no other test (or earlier run against the same database) has used."""
    return f"{name}-{secrets.token_hex(4)}"


def local(url: str) -> str:
    """Path and query of an absolute URL (what Browser.get takes)."""
    parts = urlsplit(url)
    return f"{parts.path}?{parts.query}" if parts.query else parts.path


async def start_connect(
    mcp: McpHttp, token: str, provider: str = "demo", *, call: str | None = None
) -> dict[str, Any]:
    """Round 1 of `connect_account`: the InputRequiredResult (validated against the schema).
    `call`: a call of its own (a scope by that name, which an API-key provider ignores), so the
    user's open link of the plain call is not handed out again."""
    arguments: dict[str, Any] = {"provider": provider}
    if call is not None:
        arguments["scopes"] = [call]
    response = await mcp.call_tool(token, "connect_account", arguments)
    assert response.status_code == 200, response.text
    body = response.json()
    validate_response(body, "InputRequiredResult")
    result: dict[str, Any] = body["result"]
    return result


async def open_flow(
    mcp: McpHttp, token: str, provider: str = "demo", *, call: str | None = None
) -> str:
    """The id of the flow a `connect_account` elicitation points at (`call`: see
    `start_connect`)."""
    return flow_id_from(await start_connect(mcp, token, provider, call=call))[1]


async def submit_key(browser: Browser, flow_id: str, key: str, **extra: str) -> httpx2.Response:
    """Fill in and post the API-key form as its owner would (CSRF token from the page)."""
    csrf = await browser.csrf_token(f"/connect/{flow_id}")
    return await browser.post(
        f"/connect/{flow_id}/api-key", data={"csrf": csrf, "api_key": key, **extra}
    )


def html_forms(text: str) -> list[dict[str, Any]]:
    """The page's forms: action, method and {input name: attributes}."""
    parser = _Forms()
    parser.feed(text)
    return parser.forms


class _Forms(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.forms: list[dict[str, Any]] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        values = {name: value or "" for name, value in attrs}
        if tag == "form":
            self.forms.append(
                {"action": values.get("action"), "method": values.get("method"), "inputs": {}}
            )
        elif tag == "input" and self.forms and "name" in values:
            self.forms[-1]["inputs"][values["name"]] = values


async def flow_snapshot(db: AsyncEngine, flow_id: str) -> dict[str, Any]:
    """Every column of the flow row (updated_at included, so any write shows)."""
    async with db.connect() as connection:
        statement = select(Flow.__table__).where(Flow.id == flow_id)
        row = (await connection.execute(statement)).mappings().one()
    return dict(row)


async def expire_flow(db: AsyncEngine, flow_id: str) -> None:
    """Move the flow's expiry into the past, as ten minutes of waiting would."""
    async with db.begin() as connection:
        await connection.execute(
            update(Flow)
            .where(Flow.id == flow_id)
            .values(expires_at=utcnow() - timedelta(minutes=1))
        )


async def connections_of(db: AsyncEngine, *subjects: str) -> list[dict[str, Any]]:
    """The connection rows stored for these subjects."""
    async with db.connect() as connection:
        rows = (
            (
                await connection.execute(
                    select(Connection.__table__).where(Connection.subject.in_(subjects))
                )
            )
            .mappings()
            .all()
        )
    return [dict(row) for row in rows]
