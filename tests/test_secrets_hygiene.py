"""Secrets hygiene: nothing secret in pages or errors during a database outage (SECURITY.md I2).

I1, nothing secret in any log or the database after the whole suite, is the canary sweep that
ends every run (tests/support/canary.py).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from .support.broker import BrokerConfig, BrokerProcess, database_kind, running_broker
from .support.clients import Browser, McpHttp
from .support.idp import IdpProcess, mint_token
from .support.outage import behind_proxy
from .support.relay import TcpRelay

pytestmark = pytest.mark.both_databases

LEAK_MARKERS = (
    "Traceback",
    "postgresql://",
    "sqlite:///",
    "SELECT ",
    "INSERT ",
    "asyncpg",
    "sqlalchemy",
    "127.0.0.1:5432",
)


@pytest.fixture
async def broker_behind_proxy(
    idp: IdpProcess, workdir: Path
) -> AsyncIterator[tuple[BrokerProcess, TcpRelay | None]]:
    """A broker whose database can be taken away (PostgreSQL through a cuttable proxy)."""
    config = BrokerConfig(
        issuer=idp.issuer, providers={"demo": {"kind": "api_key", "display_name": "Demo"}}
    )
    with running_broker(config, workdir, name="outage") as broker:
        proxy = await behind_proxy(broker) if database_kind() == "postgresql" else None
        yield broker, proxy


async def _take_database_away(broker: BrokerProcess, proxy: TcpRelay | None) -> None:
    if proxy is not None:
        await proxy.cut()
    else:
        path = Path(broker.database_url.removeprefix("sqlite:///"))
        for suffix in ("-wal", "-shm"):
            Path(f"{path}{suffix}").unlink(missing_ok=True)
        path.write_bytes(b"this is not a database" * 100)


async def test_i2_database_outage_answers_generically_without_leaks(
    broker_behind_proxy: tuple[BrokerProcess, TcpRelay | None], idp: IdpProcess
) -> None:
    """I2/J1: with the database gone, /mcp answers -32603 + 503 + Retry-After, pages a 503 page;
    nothing names the DSN, SQL or a stack trace; /healthz stays 200, /readyz 503."""
    broker, proxy = broker_behind_proxy
    token = mint_token(
        idp.signing_jwk, issuer=idp.issuer, audience=broker.mcp_url, subject="outage-user"
    )
    mcp, browser = McpHttp(broker.mcp_url), Browser(broker.url)
    await _take_database_away(broker, proxy)

    started = asyncio.get_running_loop().time()
    answer = await mcp.call_tool(token, "connect_account", {"provider": "demo"})
    elapsed = asyncio.get_running_loop().time() - started
    page = await browser.get("/connect/" + "A" * 43, headers={"Cookie": "__Host-broker_session=x"})
    health = await browser.get("/healthz")
    ready = await browser.get("/readyz")
    await mcp.aclose()
    await browser.aclose()

    assert answer.status_code == 503 and answer.headers["retry-after"] == "5"
    assert answer.json()["error"]["code"] == -32603
    assert elapsed < 8
    assert page.status_code == 503 and "Temporarily unavailable" in page.text
    assert health.status_code == 200 and ready.status_code == 503
    for body in (answer.text, page.text, ready.text):
        assert not any(marker in body for marker in LEAK_MARKERS), body
