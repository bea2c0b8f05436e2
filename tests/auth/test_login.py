"""The broker's own browser login: login CSRF (D9), session fixation (D10), the return target
(H1), cookie attributes (H3) and logout (T27).

tests/data/openredirects.txt is a corpus written for this project in the style of oauth2-proxy's
`testdata/openredirects.txt` (not a copy): scheme-relative and backslash forms, whitespace and
control characters (literal and percent-encoded), double encoding, userinfo and fragment tricks,
traversal out of the allowed paths, look-alike separators and other schemes. One payload a line;
lines keep their leading and trailing whitespace.
"""

from __future__ import annotations

import secrets
from http.cookies import SimpleCookie
from pathlib import Path
from urllib.parse import parse_qs, unquote, unquote_plus, urlsplit

import httpx2
import pytest
from sqlalchemy.ext.asyncio import AsyncEngine

from app.pages.login import safe_next

from ..conftest import count_rows
from ..connect import local, unique
from ..support.broker import BrokerProcess, LogWindow
from ..support.clients import Browser
from ..support.idp import IdpProcess, discover, idp_login

pytestmark = pytest.mark.both_databases

SESSION = "__Host-broker_session"
PRE_LOGIN = "__Host-broker_login"
CORPUS = Path(__file__).resolve().parents[1] / "data" / "openredirects.txt"


def payloads() -> list[str]:
    lines = CORPUS.read_text(encoding="utf-8").split("\n")
    return [line for line in lines if line]


def decodings(payload: str) -> set[str]:
    """The payload as it may reach safe_next after one or two rounds of URL decoding."""
    return {payload, unquote(payload), unquote(unquote(payload)), unquote_plus(payload)}


def set_cookies(response: httpx2.Response, name: str) -> list[str]:
    return [h for h in response.headers.get_list("set-cookie") if h.startswith(f"{name}=")]


def cookie_attributes(header: str) -> dict[str, str]:
    """Lower-cased attribute names of one Set-Cookie header (flags map to "")."""
    _, *attributes = header.split(";")
    parsed = {}
    for attribute in attributes:
        key, _, value = attribute.strip().partition("=")
        parsed[key.lower()] = value
    return parsed


async def complete_login(
    browser: Browser, user: str, next_path: str | None = None
) -> tuple[httpx2.Response, httpx2.Response]:
    """(GET /login, GET /login/callback) of a real login at the IdP, step by step."""
    start = await browser.get("/login", params={"next": next_path} if next_path else None)
    back = await idp_login(browser.http, start.headers["location"], user=user)
    callback = await browser.get(local(back.headers["location"]))
    return start, callback


# --- D9: login CSRF --------------------------------------------------------------------------


async def test_d9_login_response_planted_in_another_browser_is_refused(
    browser: Browser, second_browser: Browser, broker: BrokerProcess
) -> None:
    """D9/T4. A genuine code+state of the attacker's login, loaded in the victim's browser, does
    not log the victim in as the attacker: it needs the pre-login cookie of the browser that
    started that login."""
    attacker, victim = second_browser, browser
    start = await attacker.get("/login")
    back = await idp_login(attacker.http, start.headers["location"], user=unique("mallory-d9"))
    planted = local(back.headers["location"])
    log = LogWindow(broker)

    without_cookie = await victim.get(planted)
    await victim.get("/login")  # the victim's own pending login: another state
    with_other_cookie = await victim.get(planted)
    victim_after = await victim.get("/connections")
    control = await attacker.get(planted)

    for response in (without_cookie, with_other_cookie):
        assert response.status_code == 400
        assert "Sign-in did not complete" in response.text
        assert set_cookies(response, SESSION) == []
    assert SESSION not in victim.cookies
    assert victim_after.status_code == 303
    assert victim_after.headers["location"] == "/login?next=/connections"
    assert (await log.wait_for("login.state_invalid", 2)).count("login.state_invalid") == 2
    assert control.status_code == 303  # the planted code was real and is still unspent
    assert SESSION in attacker.cookies


# --- D10: session fixation ---------------------------------------------------------------------


async def test_d10_preset_session_cookie_neither_authenticates_nor_survives_login(
    browser: Browser, second_browser: Browser
) -> None:
    """D10. An attacker-chosen session id is not a session, and login replaces it."""
    user = unique("alice-d10")
    fixed = secrets.token_urlsafe(32)
    browser.cookies[SESSION] = fixed

    before_login = await browser.get("/connections")
    await browser.login_as(user)
    issued = browser.cookies[SESSION]
    second_browser.cookies[SESSION] = fixed
    replayed = await second_browser.get("/connections")
    own = await browser.get("/connections")

    assert before_login.status_code == 303
    assert before_login.headers["location"] == "/login?next=/connections"
    assert issued != fixed
    assert replayed.status_code == 303
    assert own.status_code == 200
    assert f"Signed in as <strong>{user}</strong>" in own.text


async def test_d10_signing_in_again_issues_a_new_id_and_ends_the_old_session(
    browser: Browser, second_browser: Browser
) -> None:
    """D10/ASVS 7.2.4. Every authentication gets a fresh id; the previous one stops working."""
    user = unique("alice-d10r")
    await browser.login_as(user)
    first = browser.cookies[SESSION]

    await browser.login_as(user)
    second = browser.cookies[SESSION]
    second_browser.cookies[SESSION] = first
    old = await second_browser.get("/connections")
    current = await browser.get("/connections")

    assert second != first
    assert old.status_code == 303
    assert current.status_code == 200


# --- H1: the return target -----------------------------------------------------------------------


def test_h1_safe_next_refuses_every_open_redirect_payload() -> None:
    """H1/T11. Only the broker's own pages are return targets; every corpus payload, raw or
    decoded once or twice, falls back to /connections."""
    corpus = payloads()

    accepted = [
        (payload, decoded)
        for payload in corpus
        for decoded in decodings(payload)
        if safe_next(decoded) != "/connections"
    ]

    assert len(corpus) >= 60
    assert accepted == []


def test_h1_safe_next_keeps_the_brokers_own_pages() -> None:
    """H1. Control case: the two legitimate targets pass unchanged."""
    flow_path = f"/connect/{secrets.token_urlsafe(32)}"

    assert safe_next(flow_path) == flow_path
    assert safe_next("/connections") == "/connections"
    assert safe_next(None) == "/connections"
    assert safe_next("") == "/connections"


async def test_h1_login_sends_every_payload_to_the_idp_only(
    browser: Browser, broker: BrokerProcess, idp: IdpProcess
) -> None:
    """H1. Whatever `next` says, /login answers 303 to the IdP's authorize endpoint with the
    broker's own callback; the target itself travels sealed in the pre-login cookie."""
    endpoint = (await discover(idp.issuer))["authorization_endpoint"]
    off_course = []

    for payload in payloads():
        response = await browser.get("/login", params={"next": payload})
        location = response.headers.get("location", "")
        query = parse_qs(urlsplit(location).query)
        if (
            response.status_code != 303
            or not location.startswith(f"{endpoint}?")
            or query.get("redirect_uri") != [f"{broker.url}/login/callback"]
            or "evil" in location
            or not set_cookies(response, PRE_LOGIN)
        ):
            off_course.append((payload, response.status_code, location))

    assert off_course == []


HOSTILE_NEXT = ["//evil.tld", "/\\evil.tld", "/\t/evil.tld", "https:evil.tld", "/connections\n"]


@pytest.mark.parametrize("payload", HOSTILE_NEXT)
async def test_h1_finished_login_with_a_hostile_next_lands_on_connections(
    payload: str, browser: Browser
) -> None:
    """H1. End to end: the redirect after a real login stays on the broker's default page."""
    callback = await browser.login_as(unique("alice-h1"), next_path=payload)

    assert callback.status_code == 303
    assert callback.headers["location"] == "/connections"


# --- H3: cookie attributes -----------------------------------------------------------------------


def assert_host_cookie(header: str, *, max_age_at_most: int) -> None:
    name = header.split("=", 1)[0]
    attributes = cookie_attributes(header)
    assert name.startswith("__Host-"), header
    assert "secure" in attributes, header
    assert "httponly" in attributes, header
    assert attributes.get("samesite", "").lower() == "lax", header
    assert attributes.get("path") == "/", header
    assert "domain" not in attributes, header
    assert 0 <= int(attributes["max-age"]) <= max_age_at_most, header


async def test_h3_pre_login_and_session_cookies_are_host_only_secure_httponly_lax(
    browser: Browser,
) -> None:
    """H3/T27. `__Host-`, Secure, HttpOnly, SameSite=Lax (Strict would drop the cookie on a
    provider's redirect back), Path=/, no Domain, short lifetimes; deletions keep the same
    attributes, or a browser ignores them for a `__Host-` cookie."""
    start, callback = await complete_login(browser, unique("alice-h3"))
    csrf = await browser.csrf_token("/connections")
    logout = await browser.post("/logout", data={"csrf": csrf})

    (pre_login,) = set_cookies(start, PRE_LOGIN)
    (session,) = set_cookies(callback, SESSION)
    (pre_login_deleted,) = set_cookies(callback, PRE_LOGIN)
    (session_deleted,) = set_cookies(logout, SESSION)
    assert_host_cookie(pre_login, max_age_at_most=600)
    assert_host_cookie(session, max_age_at_most=3600)
    for deletion in (pre_login_deleted, session_deleted):
        assert_host_cookie(deletion, max_age_at_most=0)
    parsed: SimpleCookie = SimpleCookie()
    parsed.load(session)
    assert len(parsed[SESSION].value) >= 43


# --- T27: logout ---------------------------------------------------------------------------------


async def test_t27_logout_ends_the_session_on_the_server(
    browser: Browser, second_browser: Browser, db: AsyncEngine
) -> None:
    """T27/ASVS 7.4.1. After logout a copy of the old cookie is worth nothing: the row is gone."""
    user = unique("alice-t27")
    await browser.login_as(user)
    old = browser.cookies[SESSION]
    csrf = await browser.csrf_token("/connections")

    response = await browser.post("/logout", data={"csrf": csrf})
    second_browser.cookies[SESSION] = old
    replayed = await second_browser.get("/connections")

    assert response.status_code == 200
    assert "You are signed out" in response.text
    assert SESSION not in browser.cookies
    assert replayed.status_code == 303
    assert replayed.headers["location"] == "/login?next=/connections"
    assert await count_rows(db, "login_sessions", subject=user) == 0


@pytest.mark.parametrize("form", [{}, {"csrf": "\u00e9" * 43}], ids=["missing", "non-ascii"])
async def test_t27_logout_without_the_csrf_token_keeps_the_session(
    form: dict[str, str], browser: Browser
) -> None:
    """T27/T20. A cross-site form cannot sign the user out (logout CSRF); a token that is not
    even ASCII is refused the same way, not with a 500."""
    await browser.login_as(unique("alice-t27c"))

    response = await browser.post("/logout", data=form)
    still = await browser.get("/connections")

    assert response.status_code == 403
    assert still.status_code == 200
