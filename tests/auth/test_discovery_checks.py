"""The identity provider's discovery document is checked before anything it names is used
(app/auth/jwks.py `check_metadata`, `_get_json`).

OpenID Connect Discovery 1.0 §4.3: the document's `issuer` must be exactly the configured
issuer. Its `jwks_uri`, `authorization_endpoint` and `token_endpoint` must pass the rule the
configured URLs pass (https, or http to a loopback host; no user info, query or fragment): a
document that fails either is refused whole, logged by member and rule, and nothing it names is
fetched. A document is read only up to its size cap, and one nested too deeply to parse is a
failed refresh, not a 500.

The issuer is a small server in the test (tests/auth/hostile_issuer.py) whose document each test
writes, in front of a broker that retries discovery after one second (so the cases can share it:
no case gets the broker to cache keys, and each starts after the previous one's cooldown).
"""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import httpx2
import pytest

from app.auth.jwks import MetadataRefused, check_metadata

from ..support.broker import BrokerConfig, BrokerProcess, LogWindow, running_broker
from ..support.clients import McpHttp, request_body
from ..support.idp import generate_rsa_jwk, mint_token
from .hostile_issuer import DISCOVERY, HostileIssuer, via_any_address

QUICK_COOLDOWN = 1.0  # identity.jwks_refresh_cooldown_seconds of this module's brokers
MAX_DOCUMENT_BYTES = 256 * 1024  # app/auth/jwks.py

Document = Callable[[str], dict[str, Any]]


def valid(url: str, **changes: Any) -> dict[str, Any]:
    document = {
        "issuer": url,
        "jwks_uri": f"{url}/jwks",
        "authorization_endpoint": f"{url}/auth",
        "token_endpoint": f"{url}/token",
    }
    document.update(changes)
    return {name: value for name, value in document.items() if value is not None}


# (document, the rule the log line names, a value of the document the log must not repeat)
REFUSED: dict[str, tuple[Document, str, str]] = {
    "issuer-of-another-idp": (
        lambda url: valid(url, issuer="https://evil.example"),
        "issuer: not exactly the configured issuer",
        "evil.example",
    ),
    "issuer-with-a-trailing-slash": (
        lambda url: valid(url, issuer=f"{url}/"),
        "issuer: not exactly the configured issuer",
        "",
    ),
    "issuer-missing": (
        lambda url: valid(url, issuer=None),
        "issuer: not exactly the configured issuer",
        "",
    ),
    "jwks-uri-at-the-metadata-service": (
        lambda url: valid(url, jwks_uri="http://169.254.169.254/latest/keys"),
        "jwks_uri: must use https (http is allowed only for loopback hosts)",
        "169.254.169.254",
    ),
    "jwks-uri-plain-http-that-answers": (
        lambda url: valid(url, jwks_uri=f"{via_any_address(url)}/stolen-keys"),
        "jwks_uri: must use https (http is allowed only for loopback hosts)",
        "stolen-keys",
    ),
    "jwks-uri-with-user-info": (
        lambda url: valid(url, jwks_uri=url.replace("//", "//spy:pw-canary@") + "/jwks"),
        "jwks_uri: must not contain user info",
        "pw-canary",
    ),
    "jwks-uri-not-a-string": (
        lambda url: valid(url, jwks_uri=[f"{url}/jwks"]),
        "jwks_uri: missing or not a string",
        "",
    ),
    "token-endpoint-on-a-private-host": (
        lambda url: valid(url, token_endpoint="http://10.0.0.5/token"),
        "token_endpoint: must use https (http is allowed only for loopback hosts)",
        "10.0.0.5",
    ),
    "authorization-endpoint-not-http": (
        lambda url: valid(url, authorization_endpoint="javascript:alert(1)"),
        "authorization_endpoint: must be an absolute http(s) URL",
        "javascript",
    ),
}


@pytest.fixture(scope="module")
def hostile() -> Iterator[HostileIssuer]:
    with HostileIssuer(generate_rsa_jwk(f"hostile-{secrets.token_hex(3)}")) as issuer:
        yield issuer


def quick_broker(issuer: HostileIssuer, workdir: Path, name: str) -> Any:
    config = BrokerConfig(
        issuer=issuer.url,
        extra={"identity": {"jwks_refresh_cooldown_seconds": QUICK_COOLDOWN}},
    )
    return running_broker(config, workdir, name=name)


@pytest.fixture(scope="module")
def hostile_broker(hostile: HostileIssuer, workdir: Path) -> Iterator[BrokerProcess]:
    """Trusts `hostile`; no case below lets it cache keys."""
    with quick_broker(hostile, workdir, "hostile-discovery") as process:
        yield process


@pytest.fixture
async def hostile_mcp(hostile_broker: BrokerProcess) -> AsyncIterator[McpHttp]:
    client = McpHttp(hostile_broker.mcp_url)
    yield client
    await client.aclose()


async def discover(mcp: McpHttp, issuer: HostileIssuer, broker: BrokerProcess) -> httpx2.Response:
    """A request with a token the issuer's own key signed: valid, once keys are fetched."""
    token = mint_token(
        issuer.jwk,
        issuer=issuer.url,
        audience=broker.mcp_url,
        subject=f"user-{secrets.token_hex(4)}",
    )
    return await mcp.post(request_body("server/discover"), token=token)


async def after_cooldown() -> None:
    """Past the previous case's refresh attempt: this request refreshes again."""
    await asyncio.sleep(QUICK_COOLDOWN + 0.2)


def assert_idp_unavailable(response: httpx2.Response) -> None:
    """No keys could be had: 503, not a 500 and not an accepted token."""
    assert response.status_code == 503, response.text
    assert response.json()["error"] == "temporarily_unavailable"


@pytest.mark.parametrize("case", list(REFUSED))
async def test_a_discovery_document_failing_the_checks_is_refused_and_nothing_it_names_fetched(
    case: str, hostile: HostileIssuer, hostile_broker: BrokerProcess, hostile_mcp: McpHttp
) -> None:
    """A token signed by the issuer's real key is not accepted on keys a refused document
    points at: only the discovery document was fetched, and the log names the member and the
    rule (never the document's value)."""
    document, rule, value = REFUSED[case]
    await after_cooldown()
    hostile.serve(document)
    window = LogWindow(hostile_broker)

    response = await discover(hostile_mcp, hostile, hostile_broker)

    assert_idp_unavailable(response)
    assert dict(hostile.hits) == {DISCOVERY: 1}
    line = f"jwks.metadata_refused issuer={hostile.url} reason={rule}"
    assert await window.shows(line), window.text()
    if value:
        assert value not in window.text()


async def test_a_document_is_read_no_further_than_its_cap(
    hostile: HostileIssuer, hostile_broker: BrokerProcess, hostile_mcp: McpHttp
) -> None:
    """A discovery answer of 64 MiB without a length: the broker stops reading past the cap
    (the rest is refused by the closed connection), instead of taking it all in first."""
    await after_cooldown()
    hostile.serve_raw(b" " * 65536, 64 * 1024 * 1024)
    window = LogWindow(hostile_broker)

    response = await discover(hostile_mcp, hostile, hostile_broker)
    await asyncio.sleep(0.3)  # the server notices the closed connection

    assert_idp_unavailable(response)
    assert await window.shows("jwks.refresh_failed reason=ValueError")
    assert hostile.sent < 16 * 1024 * 1024, hostile.sent  # the cap, plus the sockets' buffers
    assert dict(hostile.hits) == {DISCOVERY: 1}


async def test_a_document_nested_too_deeply_to_parse_is_a_failed_refresh(
    hostile: HostileIssuer, hostile_broker: BrokerProcess, hostile_mcp: McpHttp
) -> None:
    """100,000 nested arrays fit under the cap but exceed the parser's recursion limit: an
    unusable document (503 and a warning), not a RecursionError escaping as a 500."""
    nested = b"[" * 100_000 + b"]" * 100_000
    assert len(nested) < MAX_DOCUMENT_BYTES
    await after_cooldown()
    hostile.serve_raw(nested, len(nested))
    window = LogWindow(hostile_broker)

    response = await discover(hostile_mcp, hostile, hostile_broker)

    assert_idp_unavailable(response)
    assert await window.shows("jwks.refresh_failed reason=ValueError")
    assert "Traceback" not in window.text()


async def test_once_the_issuer_serves_a_valid_document_its_keys_are_used(
    workdir: Path,
) -> None:
    """A refusal does not stick: after the cooldown, the corrected document is fetched, its keys
    with it, and the same kind of token is accepted."""
    with (
        HostileIssuer(generate_rsa_jwk(f"mending-{secrets.token_hex(3)}")) as issuer,
        quick_broker(issuer, workdir, "mending-discovery") as broker,
    ):
        mcp = McpHttp(broker.mcp_url)
        try:
            issuer.serve(lambda url: valid(url, issuer="https://evil.example"))
            refused = await discover(mcp, issuer, broker)
            await after_cooldown()
            issuer.serve(valid)
            accepted = await discover(mcp, issuer, broker)
        finally:
            await mcp.aclose()

    assert_idp_unavailable(refused)
    assert accepted.status_code == 200, accepted.text
    assert dict(issuer.hits) == {DISCOVERY: 1, "/jwks": 1}


# ------------------------------------------------------------------------------------------------
# The rule itself (`check_metadata`), without a broker
# ------------------------------------------------------------------------------------------------

ISSUER = "https://idp.example.com/realms/main"


@pytest.mark.parametrize(
    "document",
    [
        valid(ISSUER),
        {"issuer": ISSUER, "jwks_uri": "https://keys.example.net/certs"},  # endpoints optional
        valid(ISSUER, jwks_uri="http://127.0.0.1:8080/jwks"),  # loopback http
        valid(ISSUER, token_endpoint="http://localhost/token"),
        valid(ISSUER, authorization_endpoint="http://[::1]:9000/auth"),
        valid(ISSUER, jwks_uri=f"{ISSUER}/"),  # checked, never rewritten
    ],
)
def test_documents_naming_the_issuer_and_safe_urls_pass(document: dict[str, Any]) -> None:
    check_metadata(document, ISSUER)


@pytest.mark.parametrize(
    ("document", "reason"),
    [
        (valid(ISSUER, issuer=ISSUER.upper()), "issuer: not exactly"),
        (valid(ISSUER, issuer=["https://idp.example.com/realms/main"]), "issuer: not exactly"),
        (valid(ISSUER, jwks_uri=None), "jwks_uri: missing"),
        (valid(ISSUER, jwks_uri="https://keys.example.net/certs?tenant=a"), "jwks_uri: must not"),
        (valid(ISSUER, jwks_uri="https://keys.example.net/certs#x"), "jwks_uri: must not"),
        (valid(ISSUER, jwks_uri="file:///etc/passwd"), "jwks_uri: must be an absolute"),
        (valid(ISSUER, jwks_uri="//keys.example.net/certs"), "jwks_uri: must be an absolute"),
        (valid(ISSUER, jwks_uri="https://xn--80ak6aa92e.com/k"), "jwks_uri: punycode"),
        (valid(ISSUER, jwks_uri="https://ké.example/k"), "jwks_uri: must be ASCII"),
        (valid(ISSUER, token_endpoint="http://192.168.1.1/token"), "token_endpoint: must use"),
        (valid(ISSUER, token_endpoint=7), "token_endpoint: missing or not a string"),
        (valid(ISSUER, authorization_endpoint="http://0.0.0.0/a"), "authorization_endpoint:"),
    ],
)
def test_documents_failing_the_rule_are_refused_naming_member_and_rule(
    document: dict[str, Any], reason: str
) -> None:
    with pytest.raises(MetadataRefused) as refused:
        check_metadata(document, ISSUER)
    assert refused.value.reason.startswith(reason), refused.value.reason
