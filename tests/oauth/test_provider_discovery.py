"""An `oidc` provider's discovery document is checked before its endpoints are used
(app/connect/oauth_service.py `OAuthGrants.endpoints`, through app/auth/jwks.py
`check_metadata`).

The provider's issuer is a small server in the test (tests/auth/hostile_issuer.py). A document
naming another issuer (OpenID Connect Discovery 1.0 §4.3), or endpoints that fail the rule of
configured URLs (a token endpoint on plain http to another host would receive the code and the
client secret), is refused whole: the start answers that the provider could not be reached, the
flow stays `pending`, the log names the member and the rule, and nothing the document names is
contacted. The same server with a valid document is started as usual (a page sending the browser
on to its authorization endpoint).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
from sqlalchemy.ext.asyncio import AsyncEngine

from app.db import create_engine

from ..auth.hostile_issuer import ANY_ADDRESS, DISCOVERY, HostileIssuer, via_any_address
from ..conftest import flow_row
from ..support.broker import LogWindow
from ..support.clients import Browser, McpHttp, provider_url
from ..support.idp import generate_rsa_jwk
from ..support.stack import Stack, running_stack
from .flows import elicit, press_continue
from .helpers import unique

pytestmark = pytest.mark.both_databases

CLIENT_SECRET = "discovery-client-secret"
HTTPS_ONLY = "must use https (http is allowed only for loopback hosts)"


def provider(issuer: HostileIssuer, name: str) -> dict[str, Any]:
    return {
        "kind": "oidc",
        "display_name": name.title(),
        "issuer": issuer.url,
        "client_id": f"broker-{name}",
        "client_secret": CLIENT_SECRET,
        "scopes": ["openid"],
    }


@dataclass(frozen=True)
class Issuers:
    leaky: HostileIssuer  # its token endpoint: plain http to another address
    mixup: HostileIssuer  # names another issuer
    honest: HostileIssuer


@pytest.fixture(scope="module")
def issuers() -> Iterator[Issuers]:
    with (
        HostileIssuer(generate_rsa_jwk("leaky")) as leaky,
        HostileIssuer(generate_rsa_jwk("mixup")) as mixup,
        HostileIssuer(generate_rsa_jwk("honest")) as honest,
    ):
        leaky.serve(
            lambda url: {
                **leaky.valid_document(url),
                # plain http to another host, which still reaches this server: a POST is counted
                "token_endpoint": f"{via_any_address(url)}/token",
            }
        )
        mixup.serve(lambda url: {**mixup.valid_document(url), "issuer": "https://evil.example"})
        yield Issuers(leaky, mixup, honest)


@pytest.fixture(scope="module")
def stack(issuers: Issuers, workdir: Path) -> Iterator[Stack]:
    providers = {
        "leaky": provider(issuers.leaky, "leaky"),
        "mixup": provider(issuers.mixup, "mixup"),
        "honest": provider(issuers.honest, "honest"),
    }
    with running_stack(workdir, "provider-discovery", providers=providers) as running:
        yield running


@pytest.fixture(scope="module")
async def stack_db(stack: Stack) -> AsyncIterator[AsyncEngine]:
    engine = create_engine(stack.broker.database_url, pool_size=1)
    yield engine
    await engine.dispose()


@pytest.fixture
async def mcp(stack: Stack) -> AsyncIterator[McpHttp]:
    client = McpHttp(stack.broker.mcp_url)
    yield client
    await client.aclose()


@pytest.fixture
async def browser(stack: Stack) -> AsyncIterator[Browser]:
    client = Browser(stack.broker.url)
    yield client
    await client.aclose()


async def start(stack: Stack, mcp: McpHttp, browser: Browser, name: str) -> tuple[str, Any]:
    """A user's flow for provider `name`, and the answer to "Continue" on its consent page."""
    user = unique(name)
    round_one = await elicit(mcp, stack.token(user), {"provider": name})
    await browser.login_as(user, next_path=f"/connect/{round_one.flow_id}")
    return round_one.flow_id, await press_continue(browser, round_one.flow_id)


@pytest.mark.parametrize(
    ("name", "rule"),
    [
        ("leaky", f"token_endpoint: {HTTPS_ONLY}"),
        ("mixup", "issuer: not exactly the configured issuer"),
    ],
)
async def test_a_refused_discovery_document_starts_no_sign_in_and_is_never_followed(
    name: str,
    rule: str,
    issuers: Issuers,
    stack: Stack,
    stack_db: AsyncEngine,
    mcp: McpHttp,
    browser: Browser,
) -> None:
    issuer: HostileIssuer = getattr(issuers, name)
    window = LogWindow(stack.broker)

    flow_id, started = await start(stack, mcp, browser, name)

    assert started.status_code == 502, started.text
    assert "The provider could not be reached" in started.text
    assert issuer.url not in started.text and ANY_ADDRESS not in started.text
    row = await flow_row(stack_db, flow_id) or {}
    assert row["status"] == "pending", row
    assert row["state_digest"] is None
    assert await window.shows(f"jwks.metadata_refused issuer={issuer.url} reason={rule}")
    assert dict(issuer.hits) == {DISCOVERY: 1}  # no keys, no token endpoint
    assert "evil.example" not in window.text() and CLIENT_SECRET not in window.text()


async def test_a_valid_discovery_document_sends_the_browser_to_its_endpoint(
    issuers: Issuers, stack: Stack, stack_db: AsyncEngine, mcp: McpHttp, browser: Browser
) -> None:
    """The control: the same kind of server, with a document that passes, is started."""
    flow_id, started = await start(stack, mcp, browser, "honest")

    location = urlsplit(provider_url(started))
    assert f"{location.scheme}://{location.netloc}{location.path}" == f"{issuers.honest.url}/auth"
    row = await flow_row(stack_db, flow_id) or {}
    assert (row["provider"], row["status"]) == ("honest", "authorizing"), row
    assert issuers.honest.hits[DISCOVERY] == 1
