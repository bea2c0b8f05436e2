"""What a provider answers is input: answers no real provider should give (SECURITY.md F4, F5).

A scripted provider (a small HTTP server in this process, the third-party boundary) approves at
once and answers the token and revocation endpoints with whatever a test sets. Whatever it says,
the broker answers the browser with a page that says what happened, leaves no flow stuck
mid-exchange, and keeps only its own short codes of what the provider said: in the log, the
flow's failure, a revocation's last error.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import secrets
import threading
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from urllib.parse import parse_qsl, urlencode, urlsplit

import httpx2
import pytest
from sqlalchemy import select, text
from sqlalchemy.ext.asyncio import AsyncEngine

from app.clock import utcnow
from app.db import create_engine
from app.models import PendingRevocation

from ..conftest import count_rows, flow_row
from ..support.broker import LogWindow, database_kind
from ..support.clients import Browser, McpHttp
from ..support.local_http import LocalServer, QuietHandler
from ..support.stack import Stack, running_stack
from .helpers import approve_at_provider, connection_row, deliver, open_flow, start_at_broker
from .helpers import unique as fresh_user

pytestmark = pytest.mark.both_databases

PROVIDER = "scripted"
HOLD_SECONDS = 10.0  # a held token answer waits at most this long
TRY_AGAIN = "Scripted had a problem completing the connection. Nothing was stored; try again."
CONTINUE_BUTTON = 'data-action="continue"'
FORGED = "\n2099-01-01 00:00:00,000 WARNING broker.security FORGED"


@dataclass(frozen=True)
class Answer:
    status: int
    content_type: str
    body: bytes


def json_answer(document: object, status: int = 200) -> Answer:
    return Answer(status, "application/json", json.dumps(document).encode())


def token_answer() -> Answer:
    """What a working provider answers a code exchange with."""
    return json_answer({"access_token": f"tok_{secrets.token_hex(16)}", "token_type": "bearer"})


@dataclass
class ScriptedProvider:
    """An OAuth provider whose authorize endpoint approves at once and whose token and
    revocation endpoints answer `token` and `revocation` (None: as a working provider). The
    token endpoint answers only once `hold` is set; `revoked` lists the form bodies posted to the
    revocation endpoint."""

    url: str = ""
    token: Answer | None = None
    revocation: Answer | None = None
    token_calls: int = 0
    revocations: int = 0
    hold: threading.Event = field(default_factory=threading.Event)
    revoked: list[dict[str, str]] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def reset(self) -> None:
        with self._lock:
            self.token = self.revocation = None
            self.token_calls = self.revocations = 0
            self.revoked.clear()
            self.hold.set()

    def answer(self, path: str, body: bytes) -> Answer:
        if path == "/token":
            with self._lock:
                self.token_calls += 1
            self.hold.wait(HOLD_SECONDS)
            return self.token or token_answer()
        with self._lock:
            self.revocations += 1
            self.revoked.append(dict(parse_qsl(body.decode())))
            return self.revocation or Answer(200, "application/json", b"{}")


@contextlib.contextmanager
def scripted_provider() -> Iterator[ScriptedProvider]:
    provider = ScriptedProvider()

    class Handler(QuietHandler):
        def do_GET(self) -> None:
            query = dict(parse_qsl(urlsplit(self.path).query))
            back = {"code": f"code_{secrets.token_hex(8)}", "state": query.get("state", "")}
            location = f"{query.get('redirect_uri', '')}?{urlencode(back)}"
            self.answer(302, headers={"Location": location})

        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            answer = provider.answer(urlsplit(self.path).path, body)
            self.answer(answer.status, answer.body, content_type=answer.content_type)

    with LocalServer(Handler, name="scripted-provider") as server:
        provider.url = server.url
        yield provider


@dataclass(frozen=True)
class Scripted:
    stack: Stack
    provider: ScriptedProvider


@pytest.fixture(scope="module")
def scripted(workdir: Path) -> Iterator[Scripted]:
    """A broker whose `scripted` OAuth provider (revocation included) is a ScriptedProvider."""
    with scripted_provider() as provider:
        settings = {
            "kind": "oauth2",
            "display_name": "Scripted",
            "client_id": "broker-scripted",
            "client_secret": "scripted-client-secret",
            "authorize_url": f"{provider.url}/authorize",
            "token_url": f"{provider.url}/token",
            "revocation_url": f"{provider.url}/revoke",
        }
        with running_stack(workdir, "scripted", providers={PROVIDER: settings}) as stack:
            yield Scripted(stack, provider)


@dataclass(frozen=True)
class Clients:
    scripted: Scripted
    mcp: McpHttp
    browser: Browser
    db: AsyncEngine

    @property
    def provider(self) -> ScriptedProvider:
        return self.scripted.provider

    def log(self) -> LogWindow:
        return LogWindow(self.scripted.stack.broker)

    async def at_callback(self, user: str) -> tuple[str, str]:
        """A flow `user` approved at the provider: (flow id, callback URL not yet delivered)."""
        opened = await open_flow(self.mcp, self.scripted.stack.token(user), PROVIDER)
        await self.browser.login_as(user, next_path=f"/connect/{opened.flow_id}")
        authorize_url = await start_at_broker(self.browser, opened.flow_id)
        return opened.flow_id, await approve_at_provider(self.browser.http, authorize_url)


@pytest.fixture
async def clients(scripted: Scripted) -> AsyncIterator[Clients]:
    scripted.provider.reset()
    broker = scripted.stack.broker
    engine = create_engine(broker.database_url, pool_size=1)
    state = Clients(scripted, McpHttp(broker.mcp_url), Browser(broker.url), engine)
    yield state
    scripted.provider.reset()
    await state.mcp.aclose()
    await state.browser.aclose()
    await engine.dispose()


async def assert_pending(db: AsyncEngine, flow_id: str, user: str, *, reason: str) -> None:
    """The exchange failed: the flow is `pending` again with `reason`, nothing is stored."""
    row = await flow_row(db, flow_id) or {}
    assert row["status"] == "pending", row
    assert row["failure"] == reason
    assert row["sealed_pkce_verifier"] is None
    assert await count_rows(db, "connections", subject=user) == 0


async def test_token_answer_nested_too_deep_to_parse_fails_the_exchange_as_malformed(
    clients: Clients,
) -> None:
    """F4. JSON nested 20,000 deep is as malformed as any body that is not JSON: the parser's
    RecursionError was a 500 that left the flow `exchanging` until its lease ran out."""
    user = fresh_user("deep")
    flow_id, callback_url = await clients.at_callback(user)
    clients.provider.token = Answer(200, "application/json", b"[" * 20_000)
    log = clients.log()

    callback = await deliver(clients.browser, callback_url)
    page = await clients.browser.get(f"/connect/{flow_id}")

    assert callback.status_code == 303, callback.text
    assert callback.headers["location"] == f"/connect/{flow_id}"
    await assert_pending(clients.db, flow_id, user, reason="malformed_response")
    assert TRY_AGAIN in page.text and CONTINUE_BUTTON in page.text
    assert await log.shows(f"token_exchange.failed flow_id={flow_id} reason=malformed_response")


@pytest.mark.parametrize(
    "token",
    ["tok_\u00e9t\u00e9", "tok with space", "tok\nline"],
    ids=["non-ascii", "space", "newline"],
)
async def test_an_access_token_that_cannot_be_sent_fails_the_exchange(
    token: str, clients: Clients
) -> None:
    """An access token no `Authorization` header can carry is refused before it is stored: used
    later (the userinfo call, a tool), it could only fail."""
    user = fresh_user("token-shape")
    flow_id, callback_url = await clients.at_callback(user)
    clients.provider.token = json_answer({"access_token": token, "token_type": "bearer"})

    callback = await deliver(clients.browser, callback_url)

    assert callback.status_code == 303, callback.text
    await assert_pending(clients.db, flow_id, user, reason="malformed_access_token")


@pytest.mark.parametrize("sealed", [None, "v1.unknown-key.AAAA"], ids=["missing", "unreadable"])
async def test_a_verifier_no_key_opens_puts_the_flow_back_to_pending(
    sealed: str | None, clients: Clients
) -> None:
    """A flow whose PKCE verifier is gone or sealed with a key no longer configured cannot be
    exchanged: the callback fails it at once (the page says to try again), instead of leaving
    it `exchanging` until its lease runs out; the provider is not called."""
    user = fresh_user("verifier")
    flow_id, callback_url = await clients.at_callback(user)
    async with clients.db.begin() as connection:
        await connection.execute(
            text("UPDATE flows SET sealed_pkce_verifier = :sealed WHERE id = :id"),
            {"sealed": sealed, "id": flow_id},
        )

    callback = await deliver(clients.browser, callback_url)

    assert callback.status_code == 303, callback.text
    await assert_pending(clients.db, flow_id, user, reason="verifier_unreadable")
    assert clients.provider.token_calls == 0


UNUSABLE_LIFETIMES = {
    "past-the-calendar": "999999999999",
    "past-the-calendar-number": 999_999_999_999,
    "zero": 0,
    "negative": -5,
    "fraction": 3600.5,
    "superscript-digit": "\u00b2",
    "5000-digits": "9" * 5000,
}


@pytest.mark.parametrize("expires_in", UNUSABLE_LIFETIMES.values(), ids=UNUSABLE_LIFETIMES.keys())
async def test_expires_in_the_broker_cannot_use_stores_the_token_without_an_expiry(
    expires_in: object, clients: Clients
) -> None:
    """F6. `expires_in` outside 1..10**8 seconds, or not a whole number, is read as no expiry
    (as when a provider sends none) and logged; the token itself is good and is stored. A
    lifetime past the year 9999 was an OverflowError, a digit int() refuses a ValueError: a 500
    and a flow left `exchanging`."""
    user = fresh_user("lifetime")
    flow_id, callback_url = await clients.at_callback(user)
    answer = {"access_token": "tok_lifetime", "token_type": "bearer", "expires_in": expires_in}
    clients.provider.token = json_answer(answer)
    log = clients.log()

    callback = await deliver(clients.browser, callback_url)
    page = await clients.browser.get(f"/connect/{flow_id}")

    assert callback.status_code == 303, callback.text
    assert "Scripted is connected" in page.text
    assert (await flow_row(clients.db, flow_id) or {})["status"] == "completed"
    assert (await connection_row(clients.db, user, PROVIDER))["expires_at"] is None
    assert await log.shows("oauth.expires_in_unusable provider=Scripted")


@pytest.mark.parametrize("expires_in", [3600, "3600"], ids=["number", "string"])
async def test_expires_in_within_bounds_sets_the_expiry(
    expires_in: object, clients: Clients
) -> None:
    """F6. A usable lifetime, as a number or a quoted one, is when the token stops working."""
    user = fresh_user("lifetime-ok")
    _, callback_url = await clients.at_callback(user)
    answer = {"access_token": "tok_lifetime", "token_type": "bearer", "expires_in": expires_in}
    clients.provider.token = json_answer(answer)

    callback = await deliver(clients.browser, callback_url)

    assert callback.status_code == 303, callback.text
    expires_at = (await connection_row(clients.db, user, PROVIDER))["expires_at"]
    assert expires_at is not None
    assert abs(expires_at - (utcnow() + timedelta(hours=1))) < timedelta(minutes=1)


PROVIDER_ERRORS = {
    "forged-log-line": (f"x{FORGED}", "unrecognised"),
    "nul": ("bad\x00code", "unrecognised"),
    "too-long": ("e" * 41, "unrecognised"),
    "not-a-string": (["invalid_grant"], "unrecognised"),
    "rfc6749-code": ("invalid_scope", "invalid_scope"),
}


@pytest.mark.parametrize(("error", "code"), PROVIDER_ERRORS.values(), ids=PROVIDER_ERRORS.keys())
async def test_token_endpoint_error_is_kept_only_as_a_safe_code(
    error: object, code: str, clients: Clients
) -> None:
    """F5. The provider's `error` is its text: only a short word of [A-Za-z0-9_.-] is kept (in
    the log line, the flow's failure), anything else is `unrecognised`. A line break forged a
    log line; a NUL made PostgreSQL refuse the failure, a 503 with the flow left `exchanging`."""
    user = fresh_user("error")
    flow_id, callback_url = await clients.at_callback(user)
    clients.provider.token = json_answer({"error": error}, status=400)
    log = clients.log()

    callback = await deliver(clients.browser, callback_url)
    page = await clients.browser.get(f"/connect/{flow_id}")

    assert callback.status_code == 303, callback.text
    await assert_pending(clients.db, flow_id, user, reason=f"provider_error:{code}")
    assert TRY_AGAIN in page.text and CONTINUE_BUTTON in page.text
    assert await log.shows(f"token_exchange.failed flow_id={flow_id} reason=provider_error:{code}")
    assert "FORGED" not in log.text() and "\x00" not in log.text()


REVOCATION_ERRORS = {"forged-log-line": f"x{FORGED}", "nul": "bad\x00code"}


@pytest.mark.parametrize("error", REVOCATION_ERRORS.values(), ids=REVOCATION_ERRORS.keys())
async def test_revocation_refusal_is_kept_only_as_a_safe_code(error: str, clients: Clients) -> None:
    """A revocation refused in a 200 body (Slack's way) keeps the same safe code as the token
    endpoint's errors: in the log and the queued revocation's last error (later in the audit
    `detail` and webhook bodies of an abandoned revocation, which hold broker-made codes only).
    The page says the provider has not confirmed yet."""
    user = fresh_user("revoke")
    _, callback_url = await clients.at_callback(user)
    assert (await deliver(clients.browser, callback_url)).status_code == 303
    clients.provider.revocation = json_answer({"error": error})
    csrf = await clients.browser.csrf_token("/connections")
    log = clients.log()

    response = await clients.browser.post(
        f"/connections/{PROVIDER}/disconnect", data={"csrf": csrf}
    )

    assert response.status_code == 200, response.text
    assert "the provider has not confirmed yet" in response.text
    assert clients.provider.revocations == 1
    assert await count_rows(clients.db, "connections", subject=user) == 0
    statement = select(PendingRevocation.last_error).where(PendingRevocation.subject == user)
    async with clients.db.connect() as connection:
        assert list((await connection.scalars(statement)).all()) == [
            "revocation_error:unrecognised"
        ]
    assert await log.shows(f"provider={PROVIDER} reason=revocation_error:unrecognised")
    assert "FORGED" not in log.text() and "\x00" not in log.text()


@pytest.mark.skipif(
    database_kind() != "postgresql",
    reason="an SQLite write lock stops the release too: there, the lease frees the flow",
)
async def test_a_failure_after_the_claim_puts_the_flow_back_to_pending(clients: Clients) -> None:
    """Whatever fails once the flow is claimed (here the credential's insert, waiting on a lock
    until the statement timeout), the flow goes back to `pending` at once, with nothing stored,
    instead of staying `exchanging` until its lease runs out; the failure still answers as such
    (503, the database's page), and the tokens the provider issued are revoked."""
    user = fresh_user("claimed")
    flow_id, callback_url = await clients.at_callback(user)
    issued = f"tok_{secrets.token_hex(16)}"
    clients.provider.token = json_answer({"access_token": issued, "token_type": "bearer"})
    log = clients.log()

    async with clients.db.connect() as locker:
        await locker.execute(text("LOCK TABLE connections IN EXCLUSIVE MODE"))
        callback = await deliver(clients.browser, callback_url)
        await locker.rollback()
    page = await clients.browser.get(f"/connect/{flow_id}")

    assert callback.status_code == 503, callback.text
    assert clients.provider.token_calls == 1
    await assert_pending(clients.db, flow_id, user, reason="internal_error")
    assert TRY_AGAIN in page.text and CONTINUE_BUTTON in page.text
    assert [form["token"] for form in clients.provider.revoked] == [issued]  # discarded
    assert await log.shows(f"token.discarded flow_id={flow_id} why=not_stored revoked=yes")


async def exchanged_after_the_flow_moved_on(
    clients: Clients, user: str
) -> tuple[str, str, httpx2.Response]:
    """The provider answers the code exchange only after the flow's lease ran out and the flow
    moved on (here: back to `pending`, as the housekeeping does): the flow id, the access token
    the provider issued, and the callback's answer."""
    flow_id, callback_url = await clients.at_callback(user)
    issued = f"tok_{secrets.token_hex(16)}"
    clients.provider.token = json_answer({"access_token": issued, "token_type": "bearer"})
    clients.provider.hold.clear()
    delivering = asyncio.create_task(deliver(clients.browser, callback_url))
    async with asyncio.timeout(HOLD_SECONDS):
        while clients.provider.token_calls == 0:
            await asyncio.sleep(0.02)
    async with clients.db.begin() as connection:
        await connection.execute(
            text("UPDATE flows SET status = 'pending' WHERE id = :id"), {"id": flow_id}
        )
    clients.provider.hold.set()
    return flow_id, issued, await delivering


async def test_tokens_for_a_flow_that_moved_on_meanwhile_are_revoked(clients: Clients) -> None:
    """Nothing is stored, and the tokens the provider issued are revoked at once rather than
    left valid with nobody holding them."""
    user = fresh_user("moved-on")
    log = clients.log()

    flow_id, issued, callback = await exchanged_after_the_flow_moved_on(clients, user)

    assert callback.status_code == 303, callback.text
    assert await count_rows(clients.db, "connections", subject=user) == 0
    assert [form["token"] for form in clients.provider.revoked] == [issued]
    assert await log.shows(f"token.discarded flow_id={flow_id} why=flow_moved_on revoked=yes")


async def test_tokens_whose_revocation_failed_are_queued_for_the_sweep(clients: Clients) -> None:
    """The same, while the provider's revocation endpoint fails: the tokens are not left valid
    with nobody holding them but queued, sealed, for the housekeeping to revoke later. The
    callback has committed before it asks: on SQLite the queue's write would otherwise wait for
    the callback's own write turn until it timed out, and nothing would be queued."""
    user = fresh_user("moved-on-unrevoked")
    clients.provider.revocation = Answer(503, "application/json", b"{}")
    log = clients.log()

    flow_id, issued, callback = await exchanged_after_the_flow_moved_on(clients, user)

    assert callback.status_code == 303, callback.text
    assert [form["token"] for form in clients.provider.revoked] == [issued]
    assert await log.shows(
        f"token.discarded flow_id={flow_id} why=flow_moved_on revoked=no"
        " reason=revocation_status_503 queued=yes"
    )
    async with clients.db.connect() as connection:
        queued = (
            await connection.execute(
                text(
                    "SELECT attempts, last_error, sealed_credential FROM pending_revocations"
                    " WHERE subject = :user"
                ),
                {"user": user},
            )
        ).all()
    assert [(attempts, error) for attempts, error, _ in queued] == [(1, "revocation_status_503")]
    assert issued not in queued[0][2]


async def test_an_expired_token_whose_provider_is_down_asks_to_retry_shortly(
    clients: Clients,
) -> None:
    """The provider answers the refresh of an expired token with a 503: the tool call is told
    to retry shortly (503, Retry-After; the log says the provider, not the database), never
    sent into a new connect flow as if the user had no connection; the connection is untouched,
    and once the provider is back the same call refreshes and answers."""
    user = fresh_user("refresh-down")
    flow_id, callback_url = await clients.at_callback(user)
    issued = {"access_token": "tok_first", "token_type": "bearer", "expires_in": 3600}
    clients.provider.token = json_answer(issued | {"refresh_token": "ref_first"})
    assert (await deliver(clients.browser, callback_url)).status_code == 303
    async with clients.db.begin() as connection:
        await connection.execute(
            text("UPDATE connections SET expires_at = :past WHERE subject = :user"),
            {"past": utcnow() - timedelta(minutes=1), "user": user},
        )
    flows_before = await count_rows(clients.db, "flows", subject=user)
    clients.provider.token = json_answer({"error": "temporarily_unavailable"}, status=503)
    log = clients.log()
    token = clients.scripted.stack.token(user)
    arguments = {"provider": PROVIDER}

    down = await clients.mcp.call_tool(token, "connect_account", arguments)
    flows_after = await count_rows(clients.db, "flows", subject=user)
    clients.provider.token = json_answer(issued | {"refresh_token": "ref_second"})
    back = await clients.mcp.call_tool(token, "connect_account", arguments)

    assert down.status_code == 503, down.text
    assert down.headers["retry-after"] == "5"
    assert "retry shortly" in down.json()["error"]["message"]
    assert flows_after == flows_before, flow_id  # no new connect flow
    assert (await connection_row(clients.db, user, PROVIDER))["status"] == "active"
    assert back.status_code == 200, back.text
    assert back.json()["result"]["structuredContent"]["status"] == "connected"
    assert await log.shows(
        f"oauth.refresh_failed provider={PROVIDER} reason=provider_error:temporarily_unavailable"
    )
    assert await log.shows("WARNING broker.mcp provider.unavailable error=RefreshUnavailable")
    assert "mcp.unavailable" not in log.text()  # the provider's outage, not the broker's
