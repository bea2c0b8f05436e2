"""The API-key form, `POST /connect/{flow_id}/api-key` (SECURITY.md G1-G9, T16, T20).

Two brokers: the session broker's `demo` provider has no validation probe; a dedicated broker's
`probe` provider checks each key against a fake provider (a small HTTP server in this process, the
third-party boundary) that accepts one key, refuses the others and can be made to hang.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any

import httpx2
import pytest
from sqlalchemy import inspect, text
from sqlalchemy.ext.asyncio import AsyncEngine

from app.db import create_engine

from ..support.broker import BrokerProcess, LogWindow
from ..support.clients import Browser, McpHttp
from ..support.stack import Stack, running_stack
from . import (
    connections_of,
    flow_snapshot,
    html_forms,
    open_flow,
    submit_key,
    unique,
)

pytestmark = pytest.mark.both_databases

KEY = "sk_CANARYKEY_form_0001"
GOOD_KEY = "pk_CANARYKEY_good_0001"
BAD_KEY = "pk_CANARYKEY_refused_0001"
SLOW_KEY = "pk_CANARYKEY_slow_0001"
HUGE_KEY = "pk_CANARYKEY_huge_0001"
INJECTION = "\r\nX-Injected: 1"
HUGE_BODY_BYTES = 256 * 1024 * 1024  # what the provider offers with its refusal of HUGE_KEY
CHUNK = b"x" * (1024 * 1024)


class LocalHttp:
    """A loopback HTTP/1.1 server that records each request's Authorization header.

    Answers 200 for GOOD_KEY and 401 otherwise; a request for SLOW_KEY is held until `release`
    is set (bounded); HUGE_KEY's 401 comes with a body of HUGE_BODY_BYTES, sent as long as the
    client reads (`huge_sent`: what the client took before it hung up). Used as the fake provider
    behind the validation probe, and as a canary that must never be contacted.
    """

    def __init__(self) -> None:
        self.connections = 0
        self.authorizations: list[str] = []
        self.huge_sent: list[int] = []
        self.release = asyncio.Event()
        self._handlers: set[asyncio.Task[None]] = set()
        self._server: asyncio.Server | None = None
        self.port = 0

    async def __aenter__(self) -> LocalHttp:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.release.set()
        assert self._server is not None
        self._server.close()
        await self._server.wait_closed()
        if self._handlers:
            await asyncio.wait(self._handlers, timeout=5)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._handlers.add(task)
        self.connections += 1
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
            headers = dict(
                line.split(":", 1) for line in head.decode("latin-1").split("\r\n")[1:] if line
            )
            authorization = {k.lower(): v.strip() for k, v in headers.items()}.get(
                "authorization", ""
            )
            self.authorizations.append(authorization)
            if authorization == f"Bearer {SLOW_KEY}":
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self.release.wait(), 10)
            if authorization == f"Bearer {HUGE_KEY}":
                await self._huge_refusal(writer)
                return
            status = "200 OK" if authorization == f"Bearer {GOOD_KEY}" else "401 Unauthorized"
            writer.write(f"HTTP/1.1 {status}\r\nContent-Length: 0\r\n\r\n".encode())
            await writer.drain()
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError):
            pass
        finally:
            writer.close()
            with contextlib.suppress(ConnectionError):
                await writer.wait_closed()
            self._handlers.discard(task)

    async def _huge_refusal(self, writer: asyncio.StreamWriter) -> None:
        writer.write(
            f"HTTP/1.1 401 Unauthorized\r\nContent-Length: {HUGE_BODY_BYTES}\r\n\r\n".encode()
        )
        sent = 0
        try:
            while sent < HUGE_BODY_BYTES:
                writer.write(CHUNK)
                await asyncio.wait_for(writer.drain(), 5)
                sent += len(CHUNK)
        except (ConnectionError, TimeoutError):
            pass
        finally:
            self.huge_sent.append(sent)


async def database_dump(db: AsyncEngine) -> str:
    """Every column of every row of every table, as text (a poor man's pg_dump)."""
    async with db.connect() as connection:
        tables = await connection.run_sync(lambda sync: inspect(sync).get_table_names())
        lines = []
        for table in tables:
            rows = await connection.execute(text(f'SELECT * FROM "{table}"'))
            lines += [repr(tuple(row)) for row in rows]
    return "\n".join(lines)


@pytest.fixture
async def signed_in(mcp: McpHttp, token_for: Any, browser: Browser) -> tuple[str, str]:
    """(user, flow id): a fresh user with an open `demo` flow, signed in in `browser`."""
    user = unique("alice-g")
    flow_id = await open_flow(mcp, token_for(user))
    await browser.login_as(user)
    return user, flow_id


# --- G1-G3: who may post ------------------------------------------------------------------------


async def test_g1_submission_without_csrf_token_is_refused_and_stores_nothing(
    signed_in: tuple[str, str], browser: Browser, db: AsyncEngine
) -> None:
    """G1/T20. A valid session cookie alone is not enough to store a key."""
    user, flow_id = signed_in
    before = await flow_snapshot(db, flow_id)

    response = await browser.post(f"/connect/{flow_id}/api-key", data={"api_key": KEY})

    assert response.status_code == 403
    assert "could not be verified" in response.text
    assert await connections_of(db, user) == []
    assert await flow_snapshot(db, flow_id) == before


CROSS_SITE = {
    "foreign-origin": {"Origin": "https://evil.example"},
    "null-origin": {"Origin": "null"},
    "sec-fetch-site": {"Sec-Fetch-Site": "cross-site"},
    "both": {"Origin": "https://evil.example", "Sec-Fetch-Site": "cross-site"},
}


@pytest.mark.parametrize("headers", CROSS_SITE.values(), ids=CROSS_SITE.keys())
async def test_g2_cross_site_submission_is_refused_even_with_a_valid_token(
    headers: dict[str, str], signed_in: tuple[str, str], browser: Browser, db: AsyncEngine
) -> None:
    """G2/T20. A cross-site auto-submitting form cannot plant a key (Origin, Sec-Fetch-Site)."""
    user, flow_id = signed_in
    csrf = await browser.csrf_token(f"/connect/{flow_id}")
    before = await flow_snapshot(db, flow_id)

    response = await browser.post(
        f"/connect/{flow_id}/api-key", data={"csrf": csrf, "api_key": KEY}, headers=headers
    )

    assert response.status_code == 403
    assert await connections_of(db, user) == []
    assert await flow_snapshot(db, flow_id) == before


async def test_g3_token_of_another_session_is_refused(
    signed_in: tuple[str, str], browser: Browser, second_browser: Browser, db: AsyncEngine
) -> None:
    """G3. CSRF tokens are bound to one session: B's token does not work in A's request."""
    user, flow_id = signed_in
    other = unique("bob-g3")
    await second_browser.login_as(other)
    foreign = await second_browser.csrf_token("/connections")
    before = await flow_snapshot(db, flow_id)

    response = await browser.post(
        f"/connect/{flow_id}/api-key", data={"csrf": foreign, "api_key": KEY}
    )

    assert response.status_code == 403
    assert await connections_of(db, user, other) == []
    assert await flow_snapshot(db, flow_id) == before


# --- G4-G7: what is posted ----------------------------------------------------------------------


async def test_g4_valid_key_is_stored_sealed_and_never_shown_or_logged(
    signed_in: tuple[str, str], browser: Browser, broker: BrokerProcess, db: AsyncEngine
) -> None:
    """G4. The key goes in once and comes back nowhere: not in the DB in clear, not in a page,
    not in the log. The form asks for it in a password field without autocomplete."""
    user, flow_id = signed_in
    key = f"sk_CANARYKEY_{unique('g4').replace('-', '_')}"
    form = await browser.get(f"/connect/{flow_id}")

    response = await submit_key(browser, flow_id, key)
    outcome = await browser.get(response.headers["location"])

    (key_form,) = [f for f in html_forms(form.text) if f["action"].endswith("/api-key")]
    field_attributes = key_form["inputs"]["api_key"]
    assert field_attributes["type"] == "password"
    assert field_attributes["autocomplete"] == "off"
    assert response.status_code == 303
    assert response.headers["location"] == f"/connect/{flow_id}"
    assert outcome.status_code == 200
    assert "Demo is connected" in outcome.text
    (row,) = await connections_of(db, user)
    assert row["provider"] == "demo"
    assert key not in row["sealed_credential"]
    assert (await flow_snapshot(db, flow_id))["status"] == "completed"
    assert key not in await database_dump(db)
    for page in (response, outcome):
        assert key not in page.text
        assert key not in str(page.headers)
    assert key not in broker.log()
    assert await broker.log_shows(f"credential.stored flow_id={flow_id}")


async def test_g5_oversized_key_is_refused_before_parsing(
    signed_in: tuple[str, str], browser: Browser, db: AsyncEngine
) -> None:
    """G5. A 100 KB key is refused by the declared size, and nothing is stored."""
    user, flow_id = signed_in
    csrf = await browser.csrf_token(f"/connect/{flow_id}")

    response = await browser.post(
        f"/connect/{flow_id}/api-key", data={"csrf": csrf, "api_key": "sk_" + "k" * 100_000}
    )

    assert response.status_code == 413
    assert "too large" in response.text
    assert await connections_of(db, user) == []


async def test_g5_oversized_key_without_content_length_is_refused(
    signed_in: tuple[str, str], browser: Browser, db: AsyncEngine
) -> None:
    """G5/T21. Chunked, with no Content-Length to check first, the form limits still apply."""
    user, flow_id = signed_in
    csrf = await browser.csrf_token(f"/connect/{flow_id}")

    async def chunks() -> AsyncIterator[bytes]:
        yield f"csrf={csrf}&api_key=sk_".encode()
        for _ in range(100):
            yield b"k" * 1024

    response = await browser.post(
        f"/connect/{flow_id}/api-key",
        content=chunks(),
        headers={"Content-Type": "application/x-www-form-urlencoded"},
    )

    assert response.status_code == 413
    assert "too large" in response.text
    assert await connections_of(db, user) == []


async def test_g6_key_with_control_characters_is_refused_with_a_clear_message(
    signed_in: tuple[str, str], browser: Browser, db: AsyncEngine
) -> None:
    """G6. CR/LF inside a key would become header injection wherever it is later sent."""
    user, flow_id = signed_in

    response = await submit_key(browser, flow_id, f"sk_CANARYKEY_g6{INJECTION}")

    assert response.status_code == 400
    assert "contains control characters" in response.text
    assert "X-Injected" not in response.text
    assert 'name="api_key"' in response.text  # the form again, to correct the entry
    assert await connections_of(db, user) == []
    assert (await flow_snapshot(db, flow_id))["status"] == "pending"


SSRF_TARGETS = {
    "loopback": "http://127.0.0.1:{port}/",
    "localhost": "http://localhost:{port}/",
    "hex": "http://0x7f000001:{port}/",
    "decimal": "http://2130706433:{port}/",
    "ipv6-loopback": "http://[::1]:{port}/",
    "link-local": "http://169.254.169.254/latest/meta-data/",
}


@pytest.mark.parametrize("target", SSRF_TARGETS.values(), ids=SSRF_TARGETS.keys())
async def test_g7_base_url_field_is_refused_and_never_contacted(
    target: str, signed_in: tuple[str, str], browser: Browser, db: AsyncEngine
) -> None:
    """G7/T16. Provider URLs are configuration; a form field naming one is refused outright."""
    user, flow_id = signed_in
    async with LocalHttp() as canary:
        base_url = target.format(port=canary.port)

        response = await submit_key(browser, flow_id, KEY, base_url=base_url)

        assert canary.connections == 0
    assert response.status_code == 400
    assert "does not accept" in response.text
    assert await connections_of(db, user) == []


# --- G7 with a validation probe: the provider's answer decides --------------------------------


@dataclass
class Probe:
    stack: Stack
    provider: LocalHttp
    mcp: McpHttp
    browser: Browser
    db: AsyncEngine
    user: str = field(default_factory=lambda: unique("alice-probe"))

    async def open(self, provider: str = "probe") -> str:
        flow_id = await open_flow(self.mcp, self.stack.token(self.user), provider=provider)
        await self.browser.login_as(self.user)
        return flow_id


def probe_provider(provider: LocalHttp, timeout_seconds: float) -> dict[str, Any]:
    """The `probe` API-key provider, whose validation request goes to `provider`."""
    return {
        "kind": "api_key",
        "display_name": "Probe",
        "pattern": r"^pk_[A-Za-z0-9_]{8,200}$",
        "validation": {
            "url": f"http://127.0.0.1:{provider.port}/v1/whoami",
            "header": "Authorization: Bearer {api_key}",
            "timeout_seconds": timeout_seconds,
        },
    }


@pytest.fixture(scope="module")
async def probe_stack(workdir: Path) -> AsyncIterator[tuple[Stack, LocalHttp]]:
    """`probe`, and `loose`: the same probe behind the default pattern (any 8-512 characters
    but spaces, non-ASCII letters included)."""
    async with LocalHttp() as provider:
        probe = probe_provider(provider, timeout_seconds=1)
        loose = {k: v for k, v in probe.items() if k != "pattern"} | {"display_name": "Loose"}
        providers = {"probe": probe, "loose": loose}
        with running_stack(workdir, "probe", providers=providers) as stack:
            yield stack, provider


@pytest.fixture
async def probe(probe_stack: tuple[Stack, LocalHttp]) -> AsyncIterator[Probe]:
    stack, provider = probe_stack
    engine = create_engine(stack.broker.database_url, pool_size=1)
    state = Probe(stack, provider, McpHttp(stack.broker.mcp_url), Browser(stack.broker.url), engine)
    yield state
    await state.mcp.aclose()
    await state.browser.aclose()
    await engine.dispose()


async def test_g7_key_the_provider_accepts_is_stored(probe: Probe) -> None:
    """G7. The configured probe is asked with the key in its header template; 2xx → stored."""
    flow_id = await probe.open()

    response = await submit_key(probe.browser, flow_id, GOOD_KEY)

    assert response.status_code == 303
    assert f"Bearer {GOOD_KEY}" in probe.provider.authorizations
    (row,) = await connections_of(probe.db, probe.user)
    assert row["provider"] == "probe"
    assert (await flow_snapshot(probe.db, flow_id))["status"] == "completed"


async def test_g7_key_the_provider_refuses_is_not_stored(probe: Probe) -> None:
    """G7. A 401 from the provider is shown as "did not accept", and the form stays usable."""
    flow_id = await probe.open()

    response = await submit_key(probe.browser, flow_id, BAD_KEY)

    assert response.status_code == 400
    assert "Probe did not accept this API key" in response.text
    assert BAD_KEY not in response.text
    assert f"Bearer {BAD_KEY}" in probe.provider.authorizations
    assert await connections_of(probe.db, probe.user) == []
    assert (await flow_snapshot(probe.db, flow_id))["status"] == "pending"


async def test_g7_provider_that_does_not_answer_in_time_gets_a_502_and_nothing_is_stored(
    probe: Probe,
) -> None:
    """G7/§5.7. The probe has a total deadline (timeout_seconds = 1): a hanging provider costs
    the user about a second, leaves the flow open, and says to try again."""
    flow_id = await probe.open()
    csrf = await probe.browser.csrf_token(f"/connect/{flow_id}")

    started = time.monotonic()
    response = await probe.browser.post(
        f"/connect/{flow_id}/api-key", data={"csrf": csrf, "api_key": SLOW_KEY}
    )
    elapsed = time.monotonic() - started

    assert response.status_code == 502
    assert elapsed < 2.5
    assert "could not be reached" in response.text
    assert f"Bearer {SLOW_KEY}" in probe.provider.authorizations
    assert await connections_of(probe.db, probe.user) == []
    assert (await flow_snapshot(probe.db, flow_id))["status"] == "pending"


async def test_g7_probe_reads_no_body_of_the_providers_answer(probe: Probe) -> None:
    """G7/T21. The status is the answer: a refusal that comes with 256 MB is closed unread (a
    buffered read held it all in the broker's memory, or ran into the deadline: a 502)."""
    flow_id = await probe.open()
    probe.provider.huge_sent.clear()

    response = await submit_key(probe.browser, flow_id, HUGE_KEY)
    async with asyncio.timeout(10):  # the fake notices the hang-up on its next write
        while not probe.provider.huge_sent:
            await asyncio.sleep(0.02)

    assert response.status_code == 400
    assert "Probe did not accept this API key" in response.text
    (sent,) = probe.provider.huge_sent
    assert sent < 32 * 1024 * 1024  # what socket buffers hold, not what the provider offered
    assert await connections_of(probe.db, probe.user) == []
    assert (await flow_snapshot(probe.db, flow_id))["status"] == "pending"


async def test_g6_non_ascii_key_is_refused_with_a_clear_message_before_the_probe(
    probe: Probe,
) -> None:
    """G6. A key goes out in HTTP headers, which are ASCII: a printable non-ASCII key the
    provider's pattern lets through is refused with a message saying why (it was a 500 when
    the probe tried to send it), the provider is not asked, and the form stays usable."""
    flow_id = await probe.open("loose")
    calls = len(probe.provider.authorizations)
    key = "sk_\u00e9\u00e9\u00e9\u00e9\u00e9\u00e9\u00e9\u00e9"

    response = await submit_key(probe.browser, flow_id, key)

    assert response.status_code == 400
    assert "contains characters other than plain ASCII" in response.text
    assert "Copy it again from Loose" in response.text
    assert 'name="api_key"' in response.text
    assert key not in response.text
    assert len(probe.provider.authorizations) == calls
    assert await connections_of(probe.db, probe.user) == []
    assert (await flow_snapshot(probe.db, flow_id))["status"] == "pending"


@pytest.fixture(scope="module")
async def small_pool_stack(workdir: Path) -> AsyncIterator[tuple[Stack, LocalHttp]]:
    """A broker with 2 database connections (pool_size 1 + 1 overflow) and a slow probe."""
    async with LocalHttp() as provider:
        probe = probe_provider(provider, timeout_seconds=8)
        with running_stack(
            workdir, "small-pool", providers={"probe": probe}, extra={"database": {"pool_size": 1}}
        ) as stack:
            yield stack, provider


async def test_t21_keys_waiting_for_the_provider_hold_no_database_connection(
    small_pool_stack: tuple[Stack, LocalHttp],
) -> None:
    """T21 (slow provider responses). While a provider takes its time to check keys, the
    submissions waiting for it hold none of the broker's database connections: with as many
    waiting as the pool has connections, another user's page still loads."""
    stack, provider = small_pool_stack
    provider.release.clear()
    mcp = McpHttp(stack.broker.mcp_url)
    browsers = [Browser(stack.broker.url) for _ in range(3)]
    users = [unique(f"pool-{n}") for n in range(3)]
    try:
        flows = [await open_flow(mcp, stack.token(user), provider="probe") for user in users[:2]]
        for browser, user in zip(browsers, users, strict=True):
            await browser.login_as(user)
        csrfs = [
            await browser.csrf_token(f"/connect/{flow_id}")
            for browser, flow_id in zip(browsers, flows, strict=False)
        ]
        waiting = [
            asyncio.create_task(
                browser.post(
                    f"/connect/{flow_id}/api-key", data={"csrf": csrf, "api_key": SLOW_KEY}
                )
            )
            for browser, flow_id, csrf in zip(browsers, flows, csrfs, strict=False)
        ]
        async with asyncio.timeout(5):
            while provider.authorizations.count(f"Bearer {SLOW_KEY}") < 2:
                await asyncio.sleep(0.02)

        page = await browsers[2].get("/connections")  # needs the database (the login session)

        provider.release.set()
        answers = await asyncio.gather(*waiting)
    finally:
        provider.release.set()
        await mcp.aclose()
        for browser in browsers:
            await browser.aclose()

    assert page.status_code == 200, page.text
    assert [answer.status_code for answer in answers] == [400, 400]  # the provider said 401


async def test_g6_key_with_control_characters_never_reaches_the_provider(probe: Probe) -> None:
    """G6. The shape check runs before the probe, so CR/LF never lands in an outbound header."""
    flow_id = await probe.open()
    calls = len(probe.provider.authorizations)

    response = await submit_key(probe.browser, flow_id, f"{GOOD_KEY}{INJECTION}")

    assert response.status_code == 400
    assert "contains control characters" in response.text
    assert len(probe.provider.authorizations) == calls
    assert await connections_of(probe.db, probe.user) == []


async def test_g7_base_url_field_does_not_redirect_the_probe(probe: Probe) -> None:
    """G7/T16. Even where the broker does make outbound calls, a posted URL is not one of them."""
    flow_id = await probe.open()
    calls = len(probe.provider.authorizations)
    async with LocalHttp() as canary:
        response = await submit_key(
            probe.browser, flow_id, GOOD_KEY, base_url=f"http://127.0.0.1:{canary.port}/"
        )

        assert canary.connections == 0
    assert response.status_code == 400
    assert len(probe.provider.authorizations) == calls
    assert await connections_of(probe.db, probe.user) == []


# --- G8-G9: whose flow, and how many times ------------------------------------------------------


async def test_g8_own_session_cannot_fill_in_another_users_flow(
    mcp: McpHttp, token_for: Any, browser: Browser, broker: BrokerProcess, db: AsyncEngine
) -> None:
    """G8/T1. A's valid cookie and CSRF token on B's flow id: refused, stored under no one."""
    alice, bob = unique("alice-g8"), unique("bob-g8")
    bobs_flow = await open_flow(mcp, token_for(bob))
    alices_flow = await open_flow(mcp, token_for(alice))
    await browser.login_as(alice)
    csrf = await browser.csrf_token(f"/connect/{alices_flow}")
    before = await flow_snapshot(db, bobs_flow)

    response = await browser.post(
        f"/connect/{bobs_flow}/api-key", data={"csrf": csrf, "api_key": KEY}
    )

    assert response.status_code == 403
    assert "different account" in response.text
    assert await connections_of(db, alice, bob) == []
    assert await flow_snapshot(db, bobs_flow) == before
    assert await broker.log_shows(f"connect.identity_mismatch flow_id={bobs_flow}")


async def test_g9_double_submit_stores_one_connection_and_completes_once(
    signed_in: tuple[str, str], browser: Browser, broker: BrokerProcess, db: AsyncEngine
) -> None:
    """G9/T25. Two simultaneous submissions: one conditional UPDATE wins, one row, one event."""
    user, flow_id = signed_in
    csrf = await browser.csrf_token(f"/connect/{flow_id}")

    def post() -> Any:
        return browser.post(f"/connect/{flow_id}/api-key", data={"csrf": csrf, "api_key": KEY})

    responses: list[httpx2.Response] = await asyncio.gather(post(), post())

    assert [r.status_code for r in responses] == [303, 303]
    assert {r.headers["location"] for r in responses} == {f"/connect/{flow_id}"}
    assert len(await connections_of(db, user)) == 1
    assert (await flow_snapshot(db, flow_id))["status"] == "completed"
    stored = f"credential.stored flow_id={flow_id}"
    assert (await broker.wait_for_log(stored)).count(stored) == 1


async def test_a_client_gone_before_its_form_arrived_is_logged_quietly_and_stores_nothing(
    signed_in: tuple[str, str], browser: Browser, broker: BrokerProcess, db: AsyncEngine
) -> None:
    """A browser that closes the connection halfway through its form body (a closed tab): one
    info line, no traceback, no error, and the flow is untouched."""
    user, flow_id = signed_in
    csrf = await browser.csrf_token(f"/connect/{flow_id}")
    before = await flow_snapshot(db, flow_id)
    log = LogWindow(broker)
    body = f"csrf={csrf}&api_key={KEY}".encode()
    host = broker.url.removeprefix("http://")
    cookies = "; ".join(f"{name}={value}" for name, value in browser.cookies.items())
    head = (
        f"POST /connect/{flow_id}/api-key HTTP/1.1\r\nHost: {host}\r\n"
        f"Origin: {broker.url}\r\nCookie: {cookies}\r\n"
        "Content-Type: application/x-www-form-urlencoded\r\n"
        f"Content-Length: {len(body) + 100}\r\n\r\n"
    ).encode()

    _, writer = await asyncio.open_connection("127.0.0.1", broker.config.port)
    writer.write(head + body)  # 100 bytes short of what it announced, then gone
    await writer.drain()
    await asyncio.sleep(0.2)
    writer.close()
    await writer.wait_closed()
    logged = await log.wait_for("request.client_disconnected")

    (line,) = [line for line in logged.splitlines() if "request.client_disconnected" in line]
    assert " INFO broker.errors request.client_disconnected rid=" in line
    assert "Traceback" not in log.text()
    assert "unexpected error" not in log.text()
    assert "ERROR" not in log.text()
    assert await connections_of(db, user) == []
    assert await flow_snapshot(db, flow_id) == before
