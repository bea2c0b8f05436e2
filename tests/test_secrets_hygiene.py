"""Secrets hygiene: nothing secret in logs, pages, errors or the database (SECURITY.md I1, I2).

The canary sweep runs last (see `pytest_collection_modifyitems` in conftest.py): every test that
handles a secret uses a value containing "CANARY", so one grep over every broker and IdP log and a
dump of the session broker's database proves none of them leaked in plaintext.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from .conftest import ARTIFACTS
from .support.broker import BrokerConfig, BrokerProcess, database_kind, running_broker
from .support.clients import Browser, McpHttp
from .support.idp import IdpProcess, mint_token
from .support.outage import behind_proxy
from .support.relay import TcpRelay

CANARY = "CANARY"
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


def _canary_hits(text_: str) -> list[str]:
    return [line[:200] for line in text_.splitlines() if CANARY in line]


async def _dump(db: AsyncEngine) -> str:
    lines: list[str] = []
    async with db.connect() as connection:
        for table in ("flows", "connections", "login_sessions"):
            rows = (await connection.execute(text(f"SELECT * FROM {table}"))).all()
            lines += [repr(row) for row in rows]
    return "\n".join(lines)


async def test_i1_canary_sweep_finds_no_secret_in_logs_or_database(
    broker: BrokerProcess, db: AsyncEngine, workdir: Path
) -> None:
    """I1: after the whole suite, no canary secret appears in any log or the database dump."""
    logs: dict[str, Any] = {
        path.name: path.read_text(errors="replace") for path in sorted(ARTIFACTS.rglob("*.log"))
    }
    dump = await _dump(db)

    leaks = {name: hits for name, body in logs.items() if (hits := _canary_hits(body))}
    assert logs, "no logs were collected"
    assert "CANARY" not in dump
    assert leaks == {}
