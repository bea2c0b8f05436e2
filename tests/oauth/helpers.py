"""Steps of a third-party OAuth connect flow, shared by the tests in this folder.

A flow is driven the way a browser drives it, one hop at a time: round 1 of a tool call gives the
flow id (`open_flow`), the consent form's POST answers the provider's authorize URL
(`start_at_broker`), the provider answers a redirect to the broker's callback
(`approve_at_provider`), and a browser — the owner's or someone else's — delivers it
(`deliver`). Between the hops a test can swap browsers, codes or states.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from datetime import timedelta
from typing import Any
from urllib.parse import parse_qsl, urlencode, urlsplit

import httpx2
from sqlalchemy import select, update
from sqlalchemy.ext.asyncio import AsyncEngine

from app.clock import utcnow
from app.limits import RateLimits
from app.metrics import BrokerMetrics
from app.models import Connection, Flow
from app.security_log import SecurityLog

from ..support.clients import Browser, McpHttp, flow_id_from, provider_url
from ..support.schema import validate_response


@dataclass(frozen=True)
class Opened:
    """Round 1 of a tool call that needs a connection: where the user goes, what to echo."""

    key: str
    flow_id: str
    request_state: str


def security_log() -> SecurityLog:
    """A security log for the broker's objects built in a test's own process, with limits no
    test reaches."""
    limits = RateLimits(
        user_requests_per_minute=600,
        user_burst=60,
        failed_auths_per_minute=60,
        failed_auth_burst=10,
    )
    return SecurityLog(limits, BrokerMetrics())


def unique(name: str) -> str:
    """A user name no other test has used (connections are per user)."""
    return f"{name}-{secrets.token_hex(4)}"


def query(url: str) -> dict[str, str]:
    """The query parameters of a URL (single values)."""
    return dict(parse_qsl(urlsplit(url).query, keep_blank_values=True))


def local(url: str) -> str:
    """Path and query of an absolute URL (what `Browser.get` takes)."""
    parts = urlsplit(url)
    return f"{parts.path}?{parts.query}" if parts.query else parts.path


def callback_url(provider: str, **params: str) -> str:
    """`/oauth/<provider>/callback` with exactly these parameters, in this order."""
    return f"/oauth/{provider}/callback?{urlencode(params)}"


async def open_flow(
    mcp: McpHttp,
    token: str,
    provider: str = "github",
    tool: str = "connect_account",
    *,
    scopes: list[str] | None = None,
) -> Opened:
    """Round 1 of `tools/call`: the URL elicitation's flow id and the sealed requestState."""
    arguments: dict[str, Any] = {"provider": provider} if tool == "connect_account" else {}
    if scopes is not None:
        arguments["scopes"] = scopes
    response = await mcp.call_tool(token, tool, arguments)
    assert response.status_code == 200, response.text
    body = response.json()
    validate_response(body, "InputRequiredResult")
    key, flow_id = flow_id_from(body["result"])
    return Opened(key, flow_id, body["result"]["requestState"])


async def start_at_broker(browser: Browser, flow_id: str) -> str:
    """Press "Continue" on the consent page: the provider authorize URL the broker answers."""
    csrf = await browser.csrf_token(f"/connect/{flow_id}")
    started = await browser.post(f"/connect/{flow_id}/start", data={"csrf": csrf})
    return provider_url(started)


async def approve_at_provider(http: httpx2.AsyncClient, authorize_url: str) -> str:
    """Open the authorize URL at the provider (the fake approves at once): its redirect back."""
    answer = await http.get(authorize_url)
    assert answer.status_code == 302, answer.text
    location: str = answer.headers["location"]
    return location


async def deliver(browser: Browser, url: str) -> httpx2.Response:
    """The browser follows the provider's redirect to the broker's callback."""
    return await browser.get(local(url))


async def connect(browser: Browser, flow_id: str) -> tuple[str, httpx2.Response]:
    """Consent, approval and callback in the owner's browser: (callback URL, its response)."""
    back = await approve_at_provider(browser.http, await start_at_broker(browser, flow_id))
    return back, await deliver(browser, back)


async def retry_connect(
    mcp: McpHttp, token: str, opened: Opened, provider: str = "github"
) -> httpx2.Response:
    """The client's retry of round 1's `connect_account`: the echoed state, the URL accepted."""
    return await mcp.call_tool(
        token,
        "connect_account",
        {"provider": provider},
        input_responses={opened.key: {"action": "accept"}},
        request_state=opened.request_state,
    )


async def flow_of(db: AsyncEngine, flow_id: str) -> dict[str, Any]:
    """Every column of the flow row (`updated_at` included, so any write shows)."""
    async with db.connect() as connection:
        row = (
            (await connection.execute(select(Flow.__table__).where(Flow.id == flow_id)))
            .mappings()
            .one()
        )
    return dict(row)


async def connection_row(db: AsyncEngine, user: str, provider: str = "github") -> dict[str, Any]:
    """The user's connection row for `provider`, every column (exactly one must exist)."""
    statement = select(Connection.__table__).where(
        Connection.subject == user, Connection.provider == provider
    )
    async with db.connect() as connection:
        row = (await connection.execute(statement)).mappings().one()
    return dict(row)


async def expire(db: AsyncEngine, flow_id: str) -> None:
    """Move the flow's expiry into the past, as ten minutes of waiting would."""
    async with db.begin() as connection:
        await connection.execute(
            update(Flow)
            .where(Flow.id == flow_id)
            .values(expires_at=utcnow() - timedelta(minutes=1))
        )


@dataclass(frozen=True)
class Armed:
    """A flow its owner has started: the broker sent the browser to the provider."""

    user: str
    opened: Opened
    authorize_url: str

    @property
    def flow_id(self) -> str:
        return self.opened.flow_id

    @property
    def state(self) -> str:
        return query(self.authorize_url)["state"]


async def arm(
    mcp: McpHttp, browser: Browser, token: str, user: str, provider: str = "github"
) -> Armed:
    """Round 1 for `user`, their browser login, consent and start: up to the provider hop."""
    opened = await open_flow(mcp, token, provider)
    await browser.login_as(user, next_path=f"/connect/{opened.flow_id}")
    return Armed(user, opened, await start_at_broker(browser, opened.flow_id))
