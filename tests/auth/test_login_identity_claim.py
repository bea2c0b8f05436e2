"""The browser login refuses an identity claim the database cannot store (app/pages/login.py
`_check_id_token`), by the same rule as an access token's (app/storable.py
`unstorable_subject_reason`, tests/auth/test_identity_claim_checks.py).

A principal's subject is stored as String(255) text: a longer claim, or one holding a NUL,
failed the login session's insert on PostgreSQL, answered as a false "database unavailable"
(503); SQLite stored it, making a session for an identity no MCP token could ever carry. The IdP
here signs the ID token with its own key: only the claim (`sub`, the login name) is wrong. An
unpaired surrogate cannot be typed into the IdP's login form, so that case is checked on the
rule itself.
"""

from __future__ import annotations

import secrets

import pytest
from sqlalchemy.ext.asyncio import AsyncEngine

from app.storable import MAX_SUBJECT_LENGTH, unstorable_subject_reason

from ..conftest import count_rows
from ..connect.test_pages import assert_security_headers
from ..support.broker import BrokerProcess, LogWindow
from ..support.clients import Browser
from .test_login import SESSION, complete_login

pytestmark = pytest.mark.both_databases


def claims(tag: str) -> list[str]:
    return [
        f"{tag}-" + "x" * (MAX_SUBJECT_LENGTH + 1 - len(tag) - 1),  # one past the column
        f"{tag}-" + "x" * 300,
        f"al\x00ice-{tag}",  # PostgreSQL stores no NUL
    ]


@pytest.mark.parametrize("case", [0, 1, 2], ids=["256-characters", "300-characters", "nul"])
async def test_a_login_whose_identity_claim_cannot_be_stored_is_refused_with_a_page(
    case: int, browser: Browser, broker: BrokerProcess, db: AsyncEngine
) -> None:
    tag = secrets.token_hex(4)
    user = claims(tag)[case]
    sessions_before = await count_rows(db, "login_sessions")
    window = LogWindow(broker)

    _, callback = await complete_login(browser, user)

    assert callback.status_code == 400, callback.text
    assert_security_headers("refused login", callback)
    assert "Sign-in did not complete" in callback.text
    assert "cannot store" in callback.text
    assert "tell your administrator" in callback.text
    assert SESSION not in browser.cookies
    assert await window.shows("login.identity_claim_unstorable claim=sub: it holds ")
    assert await count_rows(db, "login_sessions") <= sessions_before  # the purger may delete
    log = window.text()
    assert tag not in log  # the claim's value is not logged
    assert "database.unavailable" not in log and "Traceback" not in log


@pytest.mark.parametrize(
    ("subject", "storable"),
    [
        ("x" * MAX_SUBJECT_LENGTH, True),
        ("x" * (MAX_SUBJECT_LENGTH + 1), False),
        ("", False),
        ("al\x00ice", False),
        ("al\ud800ice", False),
    ],
    ids=["255-characters", "256-characters", "empty", "nul", "unpaired-surrogate"],
)
def test_the_subject_rule_shared_by_tokens_and_logins(subject: str, storable: bool) -> None:
    assert (unstorable_subject_reason(subject) is None) is storable
