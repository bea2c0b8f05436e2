"""What people see (L4-L7, L11): text from outside is neutralised, not only escaped; the page
names the signed-in user by the identity the broker checks and a client by the name it gives
itself, as its own claim; scopes are single tokens; a generic OpenID provider names the account
from its ID token; a cross-site form post without Origin is refused by its Referer.

The stack here is a broker of its own with a login IdP whose users carry chosen claims and a
second oidc-provider ("plain") whose accounts do, with no `account_label_claim` configured.
"""

from __future__ import annotations

import re
import secrets
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx2
import pytest
from sqlalchemy.ext.asyncio import AsyncEngine

from app.db import create_engine

from ..conftest import DEMO_PROVIDER, count_rows
from ..support.clients import Browser, McpHttp, flow_id_from, provider_url, request_body
from ..support.idp import (
    IdpConfig,
    IdpProcess,
    client_metadata,
    free_port,
    idp_login,
    running_idp,
)
from ..support.schema import validate_response
from ..support.stack import Stack, running_stack
from . import connections_of, flow_snapshot, local

pytestmark = pytest.mark.both_databases

RUN = secrets.token_hex(3)
SPOOF = f"spoof-{RUN}"  # `sub`; its preferred_username claims to be "alice"
BIDI_USER = f"bidi-{RUN}"  # a preferred_username that reverses the text after it
PLAIN_USER = f"plain-{RUN}"
LOGIN_CLAIMS = {
    SPOOF: {"preferred_username": "alice"},
    BIDI_USER: {"preferred_username": "bob\u202eevil"},
}
NAMED, MAILED, BARE, TRICKY = (f"{kind}-{RUN}" for kind in ("named", "mailed", "bare", "tricky"))
ACCOUNT_CLAIMS: dict[str, dict[str, Any]] = {
    NAMED: {"preferred_username": "Named One", "email": "one@example.com"},
    MAILED: {"email": "two@example.com"},
    BARE: {},
    TRICKY: {"preferred_username": "acct\u202e\u200dname"},
}
PLAIN_NAME = "Plain\u2067 ID"  # a provider display name with a bidi isolate in it


@dataclass(frozen=True)
class DisplayStack(Stack):
    provider: IdpProcess


@pytest.fixture(scope="module")
def stack(workdir: Path) -> Iterator[DisplayStack]:
    port = free_port()
    provider_config = IdpConfig(
        cookie_prefix=f"plain{RUN}",
        clients=[
            client_metadata(
                "broker-plain",
                [f"http://127.0.0.1:{port}/oauth/plain/callback"],
                client_secret="plain-client-secret",
            )
        ],
        extra_claims=ACCOUNT_CLAIMS,
    )
    plain = {
        "kind": "oidc",
        "display_name": PLAIN_NAME,
        "client_id": "broker-plain",
        "client_secret": "plain-client-secret",
        "client_auth_method": "client_secret_basic",
        "scopes": ["openid", "profile"],
    }
    with running_idp(provider_config, workdir) as provider:
        plain["issuer"] = provider.issuer
        with running_stack(
            workdir,
            "display",
            port=port,
            idp={"extra_claims": LOGIN_CLAIMS},
            providers={"demo": DEMO_PROVIDER, "plain": plain},
        ) as stack:
            yield DisplayStack(stack.idp, stack.broker, provider)


@pytest.fixture
async def mcp(stack: DisplayStack) -> Any:
    client = McpHttp(stack.broker.mcp_url)
    yield client
    await client.aclose()


@pytest.fixture
async def browser(stack: DisplayStack) -> Any:
    client = Browser(stack.broker.url)
    yield client
    await client.aclose()


@pytest.fixture
async def db(stack: DisplayStack) -> Any:
    engine = create_engine(stack.broker.database_url, pool_size=1)
    yield engine
    await engine.dispose()


def user(label: str) -> str:
    return f"{label}-{secrets.token_hex(4)}"


async def call_connect(
    mcp: McpHttp,
    token: str,
    arguments: dict[str, Any],
    *,
    client_name: str = "test-client",
) -> dict[str, Any]:
    """`tools/call connect_account` from a client that calls itself `client_name`."""
    body = request_body("tools/call", {"name": "connect_account", "arguments": arguments})
    body["params"]["_meta"]["io.modelcontextprotocol/clientInfo"]["name"] = client_name
    response = await mcp.post(body, token=token)
    assert response.status_code == 200, response.text
    answer: dict[str, Any] = response.json()
    validate_response(answer)
    return answer


async def open_flow(mcp: McpHttp, token: str, provider: str = "demo", **kwargs: Any) -> str:
    answer = await call_connect(mcp, token, {"provider": provider}, **kwargs)
    return flow_id_from(answer["result"])[1]


async def connect_plain(
    stack: DisplayStack, mcp: McpHttp, browser: Browser, owner: str, account: str
) -> str:
    """The whole OAuth round for `owner`, signing in at the plain provider as `account`."""
    flow_id = await open_flow(mcp, stack.token(owner), "plain")
    await browser.login_as(owner, next_path=f"/connect/{flow_id}")
    csrf = await browser.csrf_token(f"/connect/{flow_id}")
    started = await browser.post(f"/connect/{flow_id}/start", data={"csrf": csrf})
    back = await idp_login(browser.http, provider_url(started), user=account)
    callback = await browser.get(local(back.headers["location"]))
    assert callback.headers.get("location") == f"/connect/{flow_id}", callback.text
    return flow_id


async def listed_connections(mcp: McpHttp, token: str) -> dict[str, Any]:
    response = await mcp.call_tool(token, "list_connections", {})
    assert response.status_code == 200, response.text
    result: dict[str, Any] = response.json()["result"]
    return result


def strong_texts(page: str) -> list[str]:
    return re.findall(r"<strong>(.*?)</strong>", page)


# --- L4: display strings are neutralised ---------------------------------------------------------


async def test_L4_bidi_controls_in_client_name_are_neutralised(
    stack: DisplayStack, mcp: McpHttp, browser: Browser, db: AsyncEngine
) -> None:
    """L4. A client name ending in U+202E would reverse the broker's own sentence after it; zero
    widths hide characters; a name of any length would push the page's own text away."""
    owner = user("l4-client")
    declared = "Trusted\u200b App\u202e" + "x" * 500
    flow_id = await open_flow(mcp, stack.token(owner), client_name=declared)
    await browser.login_as(owner, next_path=f"/connect/{flow_id}")

    page = await browser.get(f"/connect/{flow_id}")
    stored = (await flow_snapshot(db, flow_id))["client_name"]

    assert page.status_code == 200
    assert "\u202e" not in page.text and "\u200b" not in page.text
    assert "“Trusted[U+200B] App[U+202E]xxx" in page.text
    assert stored.startswith("Trusted[U+200B] App[U+202E]x")
    assert len(stored) == 100 and stored.endswith("…")
    assert "x" * 100 not in page.text


async def test_L4_idp_provider_and_account_names_are_neutralised_on_pages_and_in_tool_results(
    stack: DisplayStack, mcp: McpHttp, browser: Browser
) -> None:
    """L4. The IdP's name for the user, the provider's configured name and the account label a
    provider returns reach pages and tool results with their invisible characters shown."""
    flow_id = await connect_plain(stack, mcp, browser, BIDI_USER, TRICKY)

    outcome = await browser.get(f"/connect/{flow_id}")
    listing = await browser.get("/connections")
    tool = await listed_connections(mcp, stack.token(BIDI_USER))

    label = "acct[U+202E][U+200D]name"
    for page in (outcome, listing):
        assert page.status_code == 200
        assert not re.search("[\u200b-\u200f\u202a-\u202e\u2066-\u2069]", page.text)
        assert "Plain[U+2067] ID" in page.text
        assert label in page.text
    assert "named “bob[U+202E]evil” by your identity provider" in listing.text
    (item,) = tool["structuredContent"]["connections"]
    assert item["account"] == label
    assert "\u202e" not in tool["content"][0]["text"]


# --- L5: the signed-in user is named by the identity the broker checks ---------------------------


async def test_L5_page_names_the_identity_claim_not_only_the_display_name(
    stack: DisplayStack, browser: Browser
) -> None:
    """L5. `preferred_username` says "alice" while `sub`, the identity the broker checks, is
    someone else: the page names the `sub` and shows "alice" only as the IdP's name."""
    await browser.login_as(SPOOF)

    page = await browser.get("/connections")

    assert page.status_code == 200
    assert f"Signed in as <strong>{SPOOF}</strong>" in page.text
    assert "alice" not in strong_texts(page.text)
    assert "(named “alice” by your identity provider)" in page.text


async def test_L5_a_display_name_equal_to_the_identity_is_shown_once(
    stack: DisplayStack, browser: Browser
) -> None:
    owner = user("l5-plain")  # the test IdP's `name` is the account id: the same as `sub`
    await browser.login_as(owner)

    page = await browser.get("/connections")

    assert f"Signed in as <strong>{owner}</strong></span>" in page.text
    assert "by your identity provider" not in page.text


# --- L6: the client's name is its own claim; scopes are single tokens ----------------------------


async def test_L6_client_name_is_labelled_as_self_declared(
    stack: DisplayStack, mcp: McpHttp, browser: Browser
) -> None:
    """L6. Any client can claim any name: the page says the name is the client's own."""
    owner = user("l6-label")
    flow_id = await open_flow(mcp, stack.token(owner), client_name="Claude")
    await browser.login_as(owner, next_path=f"/connect/{flow_id}")

    page = await browser.get(f"/connect/{flow_id}")

    assert "A client that calls itself <strong>“Claude”</strong> asks to use your Demo" in (
        page.text
    )
    assert "not even to a client that calls itself <strong>“Claude”</strong>" in page.text


async def test_L6_scopes_are_shown_one_per_line(
    stack: DisplayStack, mcp: McpHttp, browser: Browser
) -> None:
    owner = user("l6-scopes")
    answer = await call_connect(
        mcp, stack.token(owner), {"provider": "plain", "scopes": ["email", "offline_access"]}
    )
    flow_id = flow_id_from(answer["result"])[1]
    await browser.login_as(owner, next_path=f"/connect/{flow_id}")

    page = await browser.get(f"/connect/{flow_id}")

    items = re.findall(r"<li><code>([^<]*)</code></li>", page.text)
    assert items == ["openid", "profile", "email", "offline_access"]


@pytest.mark.parametrize("scope", ["email profile", "email,profile", "email\nprofile", ""])
async def test_L6_a_scope_argument_holding_a_separator_is_refused(
    stack: DisplayStack, mcp: McpHttp, db: AsyncEngine, scope: str
) -> None:
    """L6. One scope per entry: "email profile" would be shown as one item and ask for two."""
    owner = user("l6-refused")

    answer = await call_connect(
        mcp, stack.token(owner), {"provider": "plain", "scopes": ["openid", scope]}
    )

    result = answer["result"]
    assert result["resultType"] == "complete"
    assert result["isError"] is True
    assert result["content"][0]["text"] == (
        "scopes: each entry must be one scope, without spaces, commas or control characters"
    )
    assert await connections_of(db, owner) == []
    assert await count_rows(db, "flows", subject=owner) == 0


# --- L7: a generic OpenID provider names the account from its ID token ---------------------------


@pytest.mark.parametrize(
    ("account", "label"),
    [(NAMED, "Named One"), (MAILED, "two@example.com"), (BARE, BARE)],
    ids=["named", "mailed", "bare"],  # the same on every pytest-xdist worker
)
async def test_L7_generic_oidc_account_is_named_from_the_id_token(
    stack: DisplayStack, mcp: McpHttp, browser: Browser, account: str, label: str
) -> None:
    """L7. Without `account_label_claim`: `preferred_username`, else `email`, else `sub` of the
    verified ID token names the account on the pages and in the tools."""
    owner = user("l7")
    flow_id = await connect_plain(stack, mcp, browser, owner, account)

    outcome = await browser.get(f"/connect/{flow_id}")
    listing = await browser.get("/connections")
    tool = await listed_connections(mcp, stack.token(owner))

    assert f"Connected as <strong>{label}</strong>" in outcome.text
    assert f"<td>{label}</td>" in listing.text
    (item,) = tool["structuredContent"]["connections"]
    assert item["account"] == label


# --- L11: a cross-site POST without Origin is refused by its Referer -----------------------------


async def post_without_origin(
    browser: Browser, path: str, data: dict[str, str], referer: str | None
) -> httpx2.Response:
    """A form post from a browser that sends neither Origin nor Fetch Metadata."""
    headers = {"Cookie": "; ".join(f"{k}={v}" for k, v in browser.cookies.items())}
    if referer is not None:
        headers["Referer"] = referer
    return await browser.http.post(f"{browser.broker_url}{path}", data=data, headers=headers)


@pytest.mark.parametrize(
    "referer", ["https://evil.example/connect", "http://127.0.0.1:1/x", "null-ish"]
)
async def test_L11_a_post_with_a_foreign_referer_and_no_origin_is_refused(
    stack: DisplayStack, mcp: McpHttp, browser: Browser, db: AsyncEngine, referer: str
) -> None:
    """L11. SECURITY.md §5.5: without Origin (and Sec-Fetch-Site), a Referer that is not the
    broker's means another site sent the form; the CSRF refusal page, nothing changed."""
    owner = user("l11")
    flow_id = await open_flow(mcp, stack.token(owner))
    await browser.login_as(owner, next_path=f"/connect/{flow_id}")
    csrf = await browser.csrf_token(f"/connect/{flow_id}")
    before = await flow_snapshot(db, flow_id)

    refused = await post_without_origin(
        browser, f"/connect/{flow_id}/decline", {"csrf": csrf}, referer
    )

    assert refused.status_code == 403
    assert "The form expired" in refused.text
    assert "from another site" in refused.text
    assert await flow_snapshot(db, flow_id) == before


@pytest.mark.parametrize("own", [True, False])
async def test_L11_a_post_with_our_own_referer_or_none_is_accepted(
    stack: DisplayStack, mcp: McpHttp, browser: Browser, db: AsyncEngine, own: bool
) -> None:
    owner = user("l11-own")
    flow_id = await open_flow(mcp, stack.token(owner))
    await browser.login_as(owner, next_path=f"/connect/{flow_id}")
    csrf = await browser.csrf_token(f"/connect/{flow_id}")
    referer = f"{stack.broker.url}/connect/{flow_id}" if own else None

    declined = await post_without_origin(
        browser, f"/connect/{flow_id}/decline", {"csrf": csrf}, referer
    )

    assert declined.status_code == 303, declined.text
    assert (await flow_snapshot(db, flow_id))["status"] == "declined"
