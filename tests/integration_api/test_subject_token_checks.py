"""A `subject_token` whose identity claim cannot be stored is an invalid token
(app/auth/bearer.py `TokenVerifier._verify`), on the integration API as on /mcp.

A service with `user_proof = "token"` sends the user's own access token; the broker takes the
user from its identity claim. A claim longer than the subject column (255) or holding a NUL or
an unpaired surrogate is refused before any statement: 400 `subject_token_invalid` at the token
exchange (RFC 8693, `invalid_request`) and at require, counted as a failed verification and
logged by reason. Let through, it failed a statement (500 on PostgreSQL, or 503 with a false
`database.unavailable`) or read a user no one can be. The /mcp side:
tests/auth/test_identity_claim_checks.py.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from app.db import create_engine

from ..support.broker import LogWindow
from .test_api import ServiceApi, fresh_user, problem, require_body
from .test_user_proof import (
    PROOFED,
    ProofStack,
    exchange,
    exchange_form,
    proof_stack,
    token_error,
)

pytestmark = pytest.mark.both_databases

UNSTORABLE = ["x" * 256, "x" * 300, "al\x00ice", "al\ud800ice"]
UNSTORABLE_IDS = ["256-characters", "300-characters", "nul", "unpaired-surrogate"]


@pytest.fixture(scope="module")
def checks(workdir: Path) -> Iterator[ProofStack]:
    with proof_stack(workdir, "subject-token-checks") as stack:
        yield stack


@pytest.fixture(scope="module")
async def checks_db(checks: ProofStack) -> AsyncIterator[AsyncEngine]:
    engine = create_engine(checks.broker.database_url, pool_size=1)
    yield engine
    await engine.dispose()


@pytest.fixture
async def proofed_api(checks: ProofStack) -> AsyncIterator[ServiceApi]:
    client = ServiceApi(checks.broker.url, checks.proofed)
    yield client
    await client.aclose()


async def flow_count(db: AsyncEngine) -> int:
    async with db.connect() as connection:
        return int(await connection.scalar(text("SELECT count(*) FROM flows")) or 0)


@pytest.mark.parametrize("subject", UNSTORABLE, ids=UNSTORABLE_IDS)
async def test_the_exchange_refuses_a_token_whose_subject_cannot_be_stored(
    subject: str, checks: ProofStack, proofed_api: ServiceApi
) -> None:
    window = LogWindow(checks.broker)

    answer = await exchange(proofed_api, exchange_form(checks.token(subject)))

    token_error(answer, 400, "invalid_request", "subject_token_invalid")
    line = f"service.user_proof_failed service={PROOFED} reason=subject_token_invalid"
    assert await window.shows(line)
    assert "detail=identity_claim" in window.text()
    assert "database.unavailable" not in window.text() and "Traceback" not in window.text()


@pytest.mark.parametrize("subject", UNSTORABLE, ids=UNSTORABLE_IDS)
async def test_require_refuses_a_token_whose_subject_cannot_be_stored_and_starts_no_flow(
    subject: str, checks: ProofStack, proofed_api: ServiceApi, checks_db: AsyncEngine
) -> None:
    before = await flow_count(checks_db)
    body = require_body(checks.user(fresh_user("named")), subject_token=checks.token(subject))
    del body["user"]
    window = LogWindow(checks.broker)

    answer = await proofed_api.http.post("/connections/demo/require", json=body)

    problem(answer, 400, "subject_token_invalid")
    assert await flow_count(checks_db) == before
    assert "database.unavailable" not in window.text() and "Traceback" not in window.text()


async def test_a_subject_of_255_characters_is_the_user(
    checks: ProofStack, proofed_api: ServiceApi
) -> None:
    """The boundary: the token is verified and its user read (not connected yet: 404)."""
    subject = fresh_user("y").ljust(255, "y")

    answer = await exchange(proofed_api, exchange_form(checks.token(subject)))

    token_error(answer, 404, "invalid_target", "not_connected")
