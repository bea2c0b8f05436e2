"""An access token's identity claim must be storable before it becomes a principal
(app/auth/bearer.py `TokenVerifier._verify`).

A principal's subject is stored as String(255) text (flows, connections): a longer claim, or
one holding a NUL or an unpaired surrogate (app/storable.py), is an invalid token, refused as
any other on POST /mcp (401 `invalid_token`), before any statement; let through, it failed the
flow's insert (500 on PostgreSQL, or 503 with a false `database.unavailable`). The same holds for
the client id a flow records. Tokens are signed with the IdP's own key, so only the claim is
wrong. The integration API's side (POST /api/v1/token, require with a `subject_token`):
tests/integration_api/test_subject_token_checks.py.
"""

from __future__ import annotations

import re
import secrets
from typing import Any

import httpx2
import pytest
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from ..support.broker import BrokerProcess, LogWindow
from ..support.clients import McpHttp
from .test_bearer import connect_body, flow_ids

pytestmark = pytest.mark.both_databases


def assert_invalid_token(response: httpx2.Response) -> None:
    assert response.status_code == 401, response.text
    challenge = response.headers["www-authenticate"]
    assert re.search(r'error="invalid_token"', challenge), challenge


def fresh(label: str) -> str:
    return f"{label}-{secrets.token_hex(4)}"


@pytest.mark.parametrize(
    "subject",
    [
        "x" * 256,  # one past the column
        "x" * 300,
        "al\x00ice",  # PostgreSQL stores no NUL
        "al\ud800ice",  # not UTF-8: neither database stores it
    ],
    ids=["256-characters", "300-characters", "nul", "unpaired-surrogate"],
)
async def test_an_identity_claim_the_database_cannot_store_is_an_invalid_token(
    subject: str, mcp: McpHttp, token_for: Any, broker: BrokerProcess, db: AsyncEngine
) -> None:
    before = await flow_ids(db)
    window = LogWindow(broker)

    response = await mcp.post(connect_body(), token=token_for(subject))

    assert_invalid_token(response)
    assert await window.shows("auth.invalid_token reason=identity_claim")
    assert await flow_ids(db) <= before  # nothing inserted (the purger may remove rows)
    log = window.text()
    assert "database.unavailable" not in log and "Traceback" not in log


@pytest.mark.parametrize("client_id", ["app\x00", "app\udfff"], ids=["nul", "unpaired-surrogate"])
async def test_a_client_id_the_database_cannot_store_is_an_invalid_token(
    client_id: str, mcp: McpHttp, token_for: Any, broker: BrokerProcess, db: AsyncEngine
) -> None:
    """The client id a flow records comes from the token too (`client_id`, else `azp`)."""
    before = await flow_ids(db)
    window = LogWindow(broker)

    response = await mcp.post(connect_body(), token=token_for(fresh("c"), client_id=client_id))

    assert_invalid_token(response)
    assert await window.shows("auth.invalid_token reason=client_id")
    assert await flow_ids(db) <= before
    assert "Traceback" not in window.text()


async def test_an_identity_claim_of_255_characters_is_a_principal(
    mcp: McpHttp, token_for: Any, db: AsyncEngine
) -> None:
    """The boundary: a claim filling the column is accepted, and its flow stored whole."""
    subject = fresh("y").ljust(255, "y")

    response = await mcp.post(connect_body(), token=token_for(subject))

    assert response.status_code == 200, response.text
    assert response.json()["result"]["resultType"] == "input_required"
    async with db.connect() as connection:
        stored = await connection.scalar(
            text("SELECT count(*) FROM flows WHERE subject = :s"), {"s": subject}
        )
    assert stored == 1
