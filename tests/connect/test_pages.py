"""The connect page and the identity check behind it (SECURITY.md D1-D8, D11, D12), the security
headers of every page (H2), where elicitation URLs come from (H4, H5), and /connections."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import httpx2
import pytest
from sqlalchemy import func, select, update
from sqlalchemy.ext.asyncio import AsyncEngine

from app import credentials
from app.auth.principal import Principal
from app.clock import utcnow
from app.crypto import Keyring
from app.db import create_engine, create_sessionmaker
from app.models import Flow, LoginSession

from ..conftest import DEMO_PROVIDER
from ..support.broker import BrokerConfig, BrokerProcess, LogWindow, cli
from ..support.clients import Browser, McpHttp, flow_id_from, request_body
from ..support.idp import (
    IdpProcess,
    discover,
    free_port,
    idp_login,
    obtain_access_token,
    unverified_jwt,
)
from ..support.schema import validate_response
from ..support.stack import running_stack
from . import (
    connections_of,
    expire_flow,
    flow_snapshot,
    html_forms,
    local,
    open_flow,
    start_connect,
    submit_key,
    unique,
)

pytestmark = pytest.mark.both_databases

KEY = "sk_CANARYKEY_pages_0001"
_DEMO = {"demo": DEMO_PROVIDER}


# --- D: the connect page ------------------------------------------------------------------------


async def test_d1_anonymous_visit_signs_in_at_the_idp_and_comes_back_to_the_link(
    mcp: McpHttp, token_for: Any, browser: Browser, broker: BrokerProcess, idp: IdpProcess
) -> None:
    """D1. The link proves nothing: an anonymous visitor goes through the broker's own OIDC
    login (state, nonce, PKCE S256) and lands back on the same link, never at a provider."""
    user = unique("alice-d1")
    flow_id = await open_flow(mcp, token_for(user))

    first = await browser.get(f"/connect/{flow_id}")
    login = await browser.get(first.headers["location"])
    back = await idp_login(browser.http, login.headers["location"], user=user)
    callback = await browser.get(local(back.headers["location"]))
    page = await browser.get(callback.headers["location"])

    assert first.status_code == 303
    assert first.headers["location"] == f"/login?next=/connect/{flow_id}"
    assert login.status_code == 303
    metadata = await discover(idp.issuer)
    assert login.headers["location"].startswith(f"{metadata['authorization_endpoint']}?")
    query = parse_qs(urlsplit(login.headers["location"]).query)
    assert query["response_type"] == ["code"]
    assert query["client_id"] == ["broker-login"]
    assert query["redirect_uri"] == [f"{broker.url}/login/callback"]
    assert "openid" in query["scope"][0].split()
    assert len(query["state"][0]) >= 43
    assert len(query["nonce"][0]) >= 43
    assert query["code_challenge_method"] == ["S256"]
    assert len(query["code_challenge"][0]) == 43
    assert "code_verifier" not in query
    assert callback.status_code == 303
    assert callback.headers["location"] == f"/connect/{flow_id}"
    assert page.status_code == 200
    assert 'name="api_key"' in page.text


async def test_d2_link_opened_by_another_account_is_refused_and_changes_nothing(
    mcp: McpHttp, token_for: Any, second_browser: Browser, broker: BrokerProcess, db: AsyncEngine
) -> None:
    """D2. MCP elicitation §Phishing: only the account that started the flow may use it; the
    refusal names no one, offers a sign-out and leaves the flow as it was."""
    owner, visitor = unique("alice-d2"), unique("mallory-d2")
    flow_id = await open_flow(mcp, token_for(owner))
    await second_browser.login_as(visitor)
    before = await flow_snapshot(db, flow_id)

    page = await second_browser.get(f"/connect/{flow_id}")

    assert page.status_code == 403
    assert "different account" in page.text
    assert owner not in page.text
    assert 'name="api_key"' not in page.text
    (sign_out,) = [form for form in html_forms(page.text) if form["action"] == "/logout"]
    assert sign_out["method"] == "post"
    assert sign_out["inputs"]["csrf"]["value"]
    assert await flow_snapshot(db, flow_id) == before
    assert await connections_of(db, owner, visitor) == []
    assert await broker.log_shows(f"connect.identity_mismatch flow_id={flow_id}")


async def test_d2_sign_out_form_on_the_refusal_page_ends_the_wrong_session(
    mcp: McpHttp, token_for: Any, second_browser: Browser
) -> None:
    """D2. "Switch account" must work from the refusal page itself."""
    flow_id = await open_flow(mcp, token_for(unique("alice-d2s")))
    await second_browser.login_as(unique("mallory-d2s"))
    refusal = await second_browser.get(f"/connect/{flow_id}")
    (sign_out,) = [form for form in html_forms(refusal.text) if form["action"] == "/logout"]

    signed_out = await second_browser.post(
        "/logout", data={"csrf": sign_out["inputs"]["csrf"]["value"]}
    )
    again = await second_browser.get(f"/connect/{flow_id}")

    assert signed_out.status_code == 200
    assert "signed out" in signed_out.text
    assert again.status_code == 303
    assert again.headers["location"] == f"/login?next=/connect/{flow_id}"


async def test_d3_owner_sees_the_api_key_form_naming_the_account_and_the_client(
    mcp: McpHttp, token_for: Any, browser: Browser
) -> None:
    """D3. The form says who is signed in and which client asks (T4, T9), carries a CSRF token
    and cannot be framed; a GET never moves the flow."""
    user = unique("alice-d3")
    flow_id = await open_flow(mcp, token_for(user))
    await browser.login_as(user)

    page = await browser.get(f"/connect/{flow_id}")

    assert page.status_code == 200
    (form,) = [f for f in html_forms(page.text) if f["action"] == f"/connect/{flow_id}/api-key"]
    assert form["method"] == "post"
    assert len(form["inputs"]["csrf"]["value"]) >= 32
    assert f"Signed in as <strong>{user}</strong>" in page.text
    assert (
        "A client that calls itself <strong>“test-client”</strong> asks to use your Demo API key"
        in page.text
    )
    assert "frame-ancestors 'none'" in page.headers["content-security-policy"]


MALFORMED_FLOW_IDS = {
    "short": "xyz",
    "5000-chars": "A" * 5000,
    "nul-byte": "%00",
    "trailing-newline": "A" * 43 + "%0A",
    "non-ascii": "%C3%A9" * 43,
}


@pytest.mark.parametrize("signed_in", [False, True], ids=["anonymous", "signed-in"])
@pytest.mark.parametrize("flow_id", MALFORMED_FLOW_IDS.values(), ids=MALFORMED_FLOW_IDS.keys())
async def test_d4_malformed_flow_ids_are_not_found(
    flow_id: str, signed_in: bool, browser: Browser
) -> None:
    """D4. Garbage in the path is a clear 404 page, before any login and without a DB error."""
    if signed_in:
        await browser.login_as(unique("alice-d4"))

    page = await browser.get(f"/connect/{flow_id}")

    assert page.status_code == 404
    assert "Link not found" in page.text


async def test_d4_well_formed_but_unknown_flow_id_is_not_found(browser: Browser) -> None:
    """D4. A signed-in visitor with a made-up id learns only that the link does not exist."""
    await browser.login_as(unique("alice-d4u"))

    page = await browser.get(f"/connect/{'Q' * 43}")

    assert page.status_code == 404
    assert "Link not found" in page.text


async def test_a_method_a_page_does_not_take_is_a_405_page_naming_the_allowed_ones(
    browser: Browser,
) -> None:
    page = await browser.http.put(f"{browser.broker_url}/connections")

    assert page.status_code == 405
    assert "Not available this way" in page.text
    assert page.headers["content-type"].startswith("text/html")
    assert sorted(page.headers["allow"].split(", ")) == ["GET"]


async def test_d5_expired_flow_shows_a_gone_page_without_the_form(
    mcp: McpHttp, token_for: Any, browser: Browser, db: AsyncEngine
) -> None:
    """D5. Past expires_at the link is dead (410) and says what to do next."""
    user = unique("alice-d5")
    flow_id = await open_flow(mcp, token_for(user))
    await browser.login_as(user)
    await expire_flow(db, flow_id)

    page = await browser.get(f"/connect/{flow_id}")

    assert page.status_code == 410
    assert "This link has expired" in page.text
    assert 'name="api_key"' not in page.text


async def test_d6_completed_flow_revisited_shows_connected_not_the_form(
    mcp: McpHttp, token_for: Any, browser: Browser
) -> None:
    """D6. After success (and after the client's retry consumed it) the link shows the outcome."""
    user = unique("alice-d6")
    token = token_for(user)
    result = await start_connect(mcp, token)
    key, flow_id = flow_id_from(result)
    await browser.login_as(user)
    await submit_key(browser, flow_id, KEY)

    completed = await browser.get(f"/connect/{flow_id}")
    retry = await mcp.call_tool(
        token,
        "connect_account",
        {"provider": "demo"},
        input_responses={key: {"action": "accept"}},
        request_state=result["requestState"],
    )
    consumed = await browser.get(f"/connect/{flow_id}")

    assert retry.json()["result"]["structuredContent"]["status"] == "connected"
    for page in (completed, consumed):
        assert page.status_code == 200
        assert "Demo is connected" in page.text
        assert 'name="api_key"' not in page.text


@pytest.mark.parametrize("csrf", ["missing", "other-session", "non-ascii"])
@pytest.mark.parametrize("action", ["api-key", "decline"])
async def test_d7_posts_without_this_sessions_csrf_token_are_refused(
    action: str,
    csrf: str,
    mcp: McpHttp,
    token_for: Any,
    browser: Browser,
    second_browser: Browser,
    db: AsyncEngine,
) -> None:
    """D7/T20. Both flow-moving POSTs need the token of the session that sends them; a token
    that is not even ASCII is just as wrong (403, not a 500)."""
    owner, other = unique("alice-d7"), unique("bob-d7")
    flow_id = await open_flow(mcp, token_for(owner))
    await browser.login_as(owner)
    await second_browser.login_as(other)
    data = {"api_key": KEY} if action == "api-key" else {}
    if csrf == "other-session":
        data["csrf"] = await second_browser.csrf_token("/connections")
    if csrf == "non-ascii":
        data["csrf"] = "\u00e9" * 43
    before = await flow_snapshot(db, flow_id)

    response = await browser.post(f"/connect/{flow_id}/{action}", data=data)

    assert response.status_code == 403
    assert "could not be verified" in response.text
    assert await flow_snapshot(db, flow_id) == before
    assert await connections_of(db, owner, other) == []


async def test_d8_query_parameters_on_the_link_are_ignored(
    mcp: McpHttp, token_for: Any, browser: Browser, second_browser: Browser, db: AsyncEngine
) -> None:
    """D8. The flow row decides provider and destination; `next`/`provider` in the URL do not."""
    user = unique("alice-d8")
    flow_id = await open_flow(mcp, token_for(user))
    tampered = {"next": "https://evil.tld/", "provider": "gitlab"}
    await browser.login_as(user)

    anonymous = await second_browser.get(f"/connect/{flow_id}", params=tampered)
    page = await browser.get(f"/connect/{flow_id}", params=tampered)
    csrf = await browser.csrf_token(f"/connect/{flow_id}")
    posted = await browser.post(
        f"/connect/{flow_id}/api-key", params=tampered, data={"csrf": csrf, "api_key": KEY}
    )

    assert anonymous.status_code == 303
    assert anonymous.headers["location"] == f"/login?next=/connect/{flow_id}"
    assert page.status_code == 200
    assert "Connect Demo" in page.text
    assert "evil.tld" not in page.text
    assert "gitlab" not in page.text.lower()
    assert posted.status_code == 303
    assert posted.headers["location"] == f"/connect/{flow_id}"
    assert [row["provider"] for row in await connections_of(db, user)] == ["demo"]


async def _real_access_token(stack_idp: IdpProcess, broker: BrokerProcess, user: str) -> str:
    return await obtain_access_token(
        stack_idp.issuer,
        user=user,
        client_id="mcp-client",
        client_secret=None,
        redirect_uri="http://127.0.0.1:9/callback",
        resource=broker.mcp_url,
    )


async def test_d11_pairwise_subjects_are_a_mismatch_with_the_default_identity_claim(
    workdir: Path,
) -> None:
    """D11. An IdP that gives access tokens and ID tokens different `sub`s for the same person
    (Entra-style pairwise) fails safe: refused, never matched some other way (e.g. by email)."""
    user = unique("dana-d11")
    extra = {user: {"oid": f"oid-{user}", "email": f"{user}@example.com"}}
    pairwise = {"pairwise_access_sub": True, "extra_claims": extra}
    with running_stack(workdir, "d11-sub", idp=pairwise, providers=_DEMO) as stack:
        token = await _real_access_token(stack.idp, stack.broker, user)
        mcp, browser = McpHttp(stack.broker.mcp_url), Browser(stack.broker.url)
        try:
            flow_id = await open_flow(mcp, token)
            await browser.login_as(user)

            page = await browser.get(f"/connect/{flow_id}")
        finally:
            await mcp.aclose()
            await browser.aclose()

        assert unverified_jwt(token)[1]["sub"] == f"at-{user}"  # the pairwise premise
        assert page.status_code == 403
        assert "different account" in page.text
        assert await stack.broker.log_shows(f"connect.identity_mismatch flow_id={flow_id}")


async def test_d11_a_stable_identity_claim_matches_despite_pairwise_subjects(
    workdir: Path,
) -> None:
    """D11. With identity_claim = "oid" the same person is recognised on both sides."""
    user = unique("dana-d11o")
    oid = f"oid-{user}"
    extra = {user: {"oid": oid}}
    pairwise = {"pairwise_access_sub": True, "extra_claims": extra}
    with running_stack(
        workdir, "d11-oid", idp=pairwise, identity_claim="oid", providers=_DEMO
    ) as stack:
        token = await _real_access_token(stack.idp, stack.broker, user)
        mcp, browser = McpHttp(stack.broker.mcp_url), Browser(stack.broker.url)
        engine = create_engine(stack.broker.database_url, pool_size=1)
        try:
            flow_id = await open_flow(mcp, token)
            await browser.login_as(user)

            page = await browser.get(f"/connect/{flow_id}")
            owner = (await flow_snapshot(engine, flow_id))["subject"]
        finally:
            await mcp.aclose()
            await browser.aclose()
            await engine.dispose()

        assert unverified_jwt(token)[1]["sub"] == f"at-{user}"
        assert owner == oid
        assert page.status_code == 200
        assert 'name="api_key"' in page.text


async def test_d12_a_login_older_than_the_maximum_age_must_sign_in_again(
    workdir: Path,
) -> None:
    """D12/T27. A browser login older than login_max_age_seconds no longer counts, and the new
    login asks the IdP for a fresh authentication (max_age), so SSO cannot launder it."""
    user = unique("alice-d12")
    with running_stack(
        workdir, "d12", providers=_DEMO, extra={"server": {"login_max_age_seconds": 60}}
    ) as stack:
        mcp, browser = McpHttp(stack.broker.mcp_url), Browser(stack.broker.url)
        engine = create_engine(stack.broker.database_url, pool_size=1)
        try:
            flow_id = await open_flow(mcp, stack.token(user))
            await browser.login_as(user)
            fresh = await browser.get(f"/connect/{flow_id}")
            async with engine.begin() as connection:
                await connection.execute(
                    update(LoginSession)
                    .where(LoginSession.subject == user)
                    .values(auth_time=utcnow() - timedelta(seconds=120))
                )

            stale = await browser.get(f"/connect/{flow_id}")
            login = await browser.get(stale.headers["location"])
        finally:
            await mcp.aclose()
            await browser.aclose()
            await engine.dispose()

        assert fresh.status_code == 200
        assert stale.status_code == 303
        assert stale.headers["location"] == f"/login?next=/connect/{flow_id}"
        assert parse_qs(urlsplit(login.headers["location"]).query)["max_age"] == ["60"]


# --- H: headers on every page, and the URLs the broker hands out -----------------------------


def csp_directives(header: str) -> dict[str, list[str]]:
    directives: dict[str, list[str]] = {}
    for part in header.split(";"):
        name, *values = part.split()
        directives[name] = values
    return directives


def assert_security_headers(label: str, response: httpx2.Response) -> None:
    headers = response.headers
    assert headers["content-type"].startswith("text/html"), label
    csp = csp_directives(headers.get("content-security-policy", ""))
    for directive in ("default-src", "frame-ancestors", "base-uri", "object-src"):
        assert csp.get(directive) == ["'none'"], (label, directive, csp)
    assert csp.get("form-action", [""])[0] == "'self'", (label, csp)
    assert headers.get("x-frame-options") == "DENY", label
    assert headers.get("referrer-policy") == "no-referrer", label
    assert headers.get("x-content-type-options") == "nosniff", label
    assert headers.get("cross-origin-opener-policy") == "same-origin", label
    assert headers.get("cache-control") == "no-store", label
    hsts = headers.get("strict-transport-security", "")
    assert hsts.startswith("max-age="), label
    assert int(hsts.split(";")[0].removeprefix("max-age=")) >= 365 * 24 * 3600, label


async def test_h2_every_html_response_carries_the_security_headers(
    mcp: McpHttp, token_for: Any, browser: Browser, second_browser: Browser, db: AsyncEngine
) -> None:
    """H2. CSP, anti-framing, no referrer, no caching, HSTS: on success and error pages alike."""
    user = unique("alice-h2")
    open_id, done_id, expired_id = [
        await open_flow(mcp, token_for(user), call=call) for call in ("open", "done", "expired")
    ]
    await browser.login_as(user)
    await second_browser.login_as(unique("bob-h2"))
    await submit_key(browser, done_id, KEY)
    await expire_flow(db, expired_id)
    csrf = await browser.csrf_token(f"/connect/{open_id}")

    pages = {
        "form": await browser.get(f"/connect/{open_id}"),
        "form with error 400": await browser.post(
            f"/connect/{open_id}/api-key", data={"csrf": csrf, "api_key": "not-a-key"}
        ),
        "outcome": await browser.get(f"/connect/{done_id}"),
        "wrong account 403": await second_browser.get(f"/connect/{open_id}"),
        "not found 404": await browser.get("/connect/xyz"),
        "expired 410": await browser.get(f"/connect/{expired_id}"),
        "csrf 403": await browser.post(f"/connect/{open_id}/api-key", data={"api_key": KEY}),
        "too large 413": await browser.post(
            f"/connect/{open_id}/api-key", data={"csrf": csrf, "api_key": "k" * 20_000}
        ),
        "login error 400": await second_browser.get("/login/callback?code=x&state=y"),
        "connections": await browser.get("/connections"),
        "signed out": await browser.post("/logout", data={"csrf": csrf}),
    }

    statuses = [response.status_code for response in pages.values()]
    assert statuses == [200, 400, 200, 403, 404, 410, 403, 413, 400, 200, 200]
    for label, response in pages.items():
        assert_security_headers(label, response)


async def test_h4_elicitation_url_is_built_from_public_url_not_forwarded_headers(
    mcp: McpHttp, token_for: Any, broker: BrokerProcess
) -> None:
    """H4/T24. Forwarding headers from a client cannot poison the URL the user is sent to."""
    body = request_body(
        "tools/call", {"name": "connect_account", "arguments": {"provider": "demo"}}
    )
    forged = {
        "X-Forwarded-Host": "evil.example",
        "X-Forwarded-Proto": "https",
        "X-Forwarded-Port": "443",
        "Forwarded": "host=evil.example;proto=https",
    }

    response = await mcp.post(body, token=token_for(unique("alice-h4")), headers=forged)

    assert response.status_code == 200
    payload = response.json()
    validate_response(payload, "InputRequiredResult")
    _, flow_id = flow_id_from(payload["result"])
    (request,) = payload["result"]["inputRequests"].values()
    assert request["params"]["url"] == f"{broker.url}/connect/{flow_id}"
    assert "evil.example" not in response.text


@pytest.mark.parametrize("host", ["evil.example", "evil.example:443", "127.0.0.1.evil.example"])
async def test_h4_request_for_a_foreign_host_is_refused_before_any_flow(
    host: str, mcp: McpHttp, token_for: Any, db: AsyncEngine
) -> None:
    """H4/B19. A poisoned Host never reaches the tool, so no URL can be built from it."""
    user = unique("alice-h4h")
    body = request_body(
        "tools/call", {"name": "connect_account", "arguments": {"provider": "demo"}}
    )

    response = await mcp.post(
        body, token=token_for(user), headers={"Host": host, "X-Forwarded-Host": host}
    )

    assert 400 <= response.status_code < 500
    assert "evil.example" not in response.text
    async with db.connect() as connection:
        flows = await connection.scalar(
            select(func.count()).select_from(Flow).where(Flow.subject == user)
        )
    assert flows == 0


UNSAFE_PUBLIC_URLS = {
    "non-ascii-host": "https://g\u0456thub-connect.example",
    "punycode-host": "https://xn--gthub-connect-9jb.example",
    "http-non-loopback": "http://broker.example",
    "userinfo": "https://operator:secret@broker.example",
    "fragment": "https://broker.example/#top",
}


def _config_file(tmp_path: Path, public_url: str) -> Path:
    config = BrokerConfig(
        issuer="https://idp.example", port=8443, extra={"server": {"public_url": public_url}}
    )
    path = tmp_path / "broker.toml"
    path.write_text(config.render(f"sqlite:///{tmp_path / 'broker.db'}"), encoding="utf-8")
    return path


@pytest.mark.parametrize("public_url", UNSAFE_PUBLIC_URLS.values(), ids=UNSAFE_PUBLIC_URLS.keys())
def test_h5_check_config_refuses_an_unsafe_public_url(public_url: str, tmp_path: Path) -> None:
    """H5/T24. Elicitation URLs are built from public_url, so a look-alike, plain-http, userinfo
    or fragment URL is refused at start-up with a message naming the key."""
    result = cli("check-config", config_path=_config_file(tmp_path, public_url), timeout=30)

    assert result.returncode == 2
    assert "server.public_url" in result.stderr
    assert "configuration OK" not in result.stdout


def test_h5_check_config_accepts_a_plain_https_public_url(tmp_path: Path, idp: IdpProcess) -> None:
    """H5. Control case: the same file with an ordinary https URL is fine (check-config also
    asks the IdP and the database: the suite's IdP, a migrated database)."""
    path = _config_file(tmp_path, "https://connect.example.com")
    path.write_text(path.read_text().replace('"https://idp.example"', f'"{idp.issuer}"'))
    assert cli("migrate", config_path=path).returncode == 0

    result = cli("check-config", config_path=path, timeout=30)

    assert result.returncode == 0, result.stderr
    assert "configuration OK" in result.stdout


def test_h5_serve_refuses_to_start_with_a_look_alike_host(tmp_path: Path) -> None:
    """H5/T24. `serve` exits instead of serving (a hang here would hit the timeout)."""
    path = _config_file(tmp_path, UNSAFE_PUBLIC_URLS["non-ascii-host"])

    result = cli("serve", "--port", str(free_port()), config_path=path, timeout=30)

    assert result.returncode == 2
    assert "server.public_url" in result.stderr


# --- /connections --------------------------------------------------------------------------------


async def test_connections_page_lists_the_users_connections_with_a_disconnect_button(
    mcp: McpHttp, token_for: Any, browser: Browser, second_browser: Browser
) -> None:
    """DESIGN §4: the signed-in user sees their own connections, and only theirs."""
    user = unique("alice-cx")
    flow_id = await open_flow(mcp, token_for(user))
    await browser.login_as(user, next_path=f"/connect/{flow_id}")
    await submit_key(browser, flow_id, KEY)
    await second_browser.login_as(unique("bob-cx"))

    mine = await browser.get("/connections")
    theirs = await second_browser.get("/connections")

    assert mine.status_code == 200
    assert "<td>Demo</td>" in mine.text
    (disconnect,) = [f for f in html_forms(mine.text) if f["action"].endswith("/disconnect")]
    assert disconnect["action"] == "/connections/demo/disconnect"
    assert disconnect["method"] == "post"
    assert disconnect["inputs"]["csrf"]["value"]
    assert KEY not in mine.text
    assert theirs.status_code == 200
    assert "No accounts are connected yet" in theirs.text


async def test_disconnect_button_removes_the_connection(
    mcp: McpHttp, token_for: Any, browser: Browser, db: AsyncEngine
) -> None:
    """DESIGN §4: disconnect deletes the sealed credential (POST with CSRF, 303 back)."""
    user = unique("alice-dx")
    flow_id = await open_flow(mcp, token_for(user))
    await browser.login_as(user)
    await submit_key(browser, flow_id, KEY)
    csrf = await browser.csrf_token("/connections")

    response = await browser.post("/connections/demo/disconnect", data={"csrf": csrf})
    page = await browser.get("/connections")

    assert response.status_code == 303
    assert response.headers["location"] == "/connections"
    assert await connections_of(db, user) == []
    assert "No accounts are connected yet" in page.text


async def test_connections_made_by_sibling_servers_are_listed_and_removed_one_by_one(
    mcp: McpHttp,
    token_for: Any,
    browser: Browser,
    db: AsyncEngine,
    broker_config: BrokerConfig,
) -> None:
    """DESIGN §4: the user sees every connection of theirs, whichever server made it, and
    disconnecting one made by a sibling leaves the broker's own connection to the same provider."""
    user = unique("alice-sib")
    flow_id = await open_flow(mcp, token_for(user))
    await browser.login_as(user, next_path=f"/connect/{flow_id}")
    await submit_key(browser, flow_id, KEY)
    issuer = (await connections_of(db, user))[0]["issuer"]
    async with create_sessionmaker(db).begin() as session:
        await credentials.store(
            session,
            keys=Keyring.parse(tuple(broker_config.encryption)),
            principal=Principal(issuer, user),
            provider="demo",
            audience="notes-svc",
            secret={"api_key": "sk_sibling_key_1"},
            scopes=frozenset(),
            account_label=None,
            expires_at=None,
        )

    page = await browser.get("/connections")
    forms = [f for f in html_forms(page.text) if f["action"] == "/connections/demo/disconnect"]
    csrf = forms[0]["inputs"]["csrf"]["value"]
    removed = await browser.post(
        "/connections/demo/disconnect", data={"csrf": csrf, "audience": "notes-svc"}
    )

    assert "<td>Connect Broker tools</td>" in page.text and "<td>notes-svc</td>" in page.text
    assert sorted(f["inputs"]["audience"]["value"] for f in forms) == ["mcp", "notes-svc"]
    assert "sk_sibling_key_1" not in page.text and KEY not in page.text
    assert removed.status_code == 303
    assert [row["audience"] for row in await connections_of(db, user)] == ["mcp"]


BAD_AUDIENCES = {"nul": "a\x00b", "upper-case": "Notes-Svc", "too-long": "n" * 65, "line": "mcp\n"}


@pytest.mark.parametrize("audience", BAD_AUDIENCES.values(), ids=BAD_AUDIENCES.keys())
async def test_disconnect_naming_an_audience_no_connection_has_is_refused_with_a_page(
    audience: str,
    mcp: McpHttp,
    token_for: Any,
    browser: Browser,
    broker: BrokerProcess,
    db: AsyncEngine,
) -> None:
    """The form's `audience` is request input: a value that is neither the broker's nor a
    service name gets a page saying so before any query (a NUL made PostgreSQL refuse the
    statement: a 503 and a false `database.unavailable` alarm). Nothing is removed."""
    user = unique("alice-dxa")
    flow_id = await open_flow(mcp, token_for(user))
    await browser.login_as(user)
    await submit_key(browser, flow_id, KEY)
    csrf = await browser.csrf_token("/connections")
    log = LogWindow(broker)

    response = await browser.post(
        "/connections/demo/disconnect", data={"csrf": csrf, "audience": audience}
    )

    assert response.status_code == 400
    assert "This connection cannot be one of yours." in response.text
    assert "Go back to your connections" in response.text
    assert len(await connections_of(db, user)) == 1
    assert "database.unavailable" not in log.text()


async def test_disconnect_without_the_csrf_token_keeps_the_connection(
    mcp: McpHttp, token_for: Any, browser: Browser, db: AsyncEngine
) -> None:
    """T20. A cross-site form cannot remove a user's connection."""
    user = unique("alice-dxc")
    flow_id = await open_flow(mcp, token_for(user))
    await browser.login_as(user)
    await submit_key(browser, flow_id, KEY)

    response = await browser.post("/connections/demo/disconnect", data={})

    assert response.status_code == 403
    assert len(await connections_of(db, user)) == 1
