"""The broker as an OAuth resource server: bearer tokens on POST /mcp (SECURITY.md §3.1, A1-A12).

Edge-case tokens are signed with the real IdP's own key (`mint_token`), so each test changes one
thing and everything else is valid. Two dedicated setups: a broker that requires scopes (A10), and
brokers whose issuer is a small in-test OIDC server that counts discovery/JWKS fetches and can be
switched to failing (A11, A12), since the node IdP does not log requests.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import hmac
import json
import re
import secrets
import threading
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx2
import pytest
from joserfc import jws
from joserfc.jwk import RSAKey
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from app.db import create_engine

from ..conftest import DEMO_PROVIDER, count_rows
from ..support.broker import BrokerConfig, BrokerProcess, LogWindow, running_broker
from ..support.clients import McpHttp, request_body, request_headers
from ..support.idp import (
    IdpProcess,
    generate_rsa_jwk,
    mint_token,
    obtain_access_token,
    obtain_tokens,
    public_jwk,
    unverified_jwt,
)
from ..support.local_http import LocalServer, QuietHandler
from ..support.schema import validate_response

JWKS_COOLDOWN = 30.0  # identity.jwks_refresh_cooldown_seconds's default (panva/jose's too)
QUICK_COOLDOWN = 2.0  # what A12's broker sets, so the test need not wait out the default
REQUIRED_SCOPES = ["mcp:tools", "broker:connect"]
FLOOD_SIZE = 500
FLOOD_CONCURRENCY = 32


def fresh_user(label: str) -> str:
    """A subject no other test on the shared broker has used, so row counts are this test's."""
    return f"{label}-{secrets.token_hex(4)}"


def metadata_url(broker: BrokerProcess) -> str:
    return f"{broker.url}/.well-known/oauth-protected-resource/mcp"


def connect_body() -> dict[str, Any]:
    """Round 1 of connect_account: if it ran, a flow row would exist for the caller."""
    return request_body(
        "tools/call", {"name": "connect_account", "arguments": {"provider": "demo"}}
    )


async def flow_ids(db: AsyncEngine) -> set[str]:
    """Every flow id in the broker's DB (the purger may remove rows, never add them)."""
    async with db.connect() as connection:
        return set((await connection.execute(text("SELECT id FROM flows"))).scalars())


def challenge_params(response: httpx2.Response) -> dict[str, str]:
    """The auth-params of a `WWW-Authenticate: Bearer k="v", …` header."""
    scheme, _, params = response.headers["www-authenticate"].partition(" ")
    assert scheme == "Bearer", response.headers["www-authenticate"]
    return dict(re.findall(r'([a-z_]+)="([^"]*)"', params))


def assert_invalid_token(response: httpx2.Response, broker: BrokerProcess, token: str) -> None:
    """401 with an `invalid_token` challenge pointing at our metadata, token not echoed."""
    assert response.status_code == 401, response.text
    params = challenge_params(response)
    assert params["error"] == "invalid_token"
    assert params["resource_metadata"] == metadata_url(broker)
    assert token not in response.text


async def discover(mcp: McpHttp, token: str) -> httpx2.Response:
    return await mcp.post(request_body("server/discover"), token=token)


def hs256_with_public_key(jwk: dict[str, Any], claims: dict[str, Any]) -> str:
    """Algorithm confusion (CVE-2024-37568): HMAC keyed with the IdP's public key PEM."""
    pem = RSAKey.import_key(public_jwk(jwk)).as_pem(private=False)

    def b64(data: bytes) -> str:
        return base64.urlsafe_b64encode(data).rstrip(b"=").decode()

    header = {"alg": "HS256", "typ": "at+jwt", "kid": jwk["kid"]}
    signing_input = f"{b64(json.dumps(header).encode())}.{b64(json.dumps(claims).encode())}"
    signature = hmac.new(pem, signing_input.encode(), hashlib.sha256).digest()
    return f"{signing_input}.{b64(signature)}"


def signer(jwk: dict[str, Any], *, issuer: str, audience: str) -> Callable[..., str]:
    """A fast minting function for floods: the private key is imported (and validated) once."""
    key = RSAKey.import_key(jwk)

    def sign(*, subject: str, kid: str = jwk["kid"]) -> str:
        now = int(time.time())
        claims = {
            "iss": issuer,
            "aud": audience,
            "sub": subject,
            "exp": now + 300,
            "iat": now,
            "jti": secrets.token_urlsafe(16),
            "scope": "mcp:tools",
        }
        header = {"alg": "RS256", "typ": "at+jwt", "kid": kid}
        return jws.serialize_compact(header, json.dumps(claims).encode(), key)

    return sign


class _CountingServer(ThreadingHTTPServer):
    def __init__(self, address: tuple[str, int], handler: type[BaseHTTPRequestHandler]) -> None:
        super().__init__(address, handler)
        self.connections = 0

    def verify_request(self, request: Any, client_address: Any) -> bool:
        self.connections += 1  # every accepted TCP connection, before any HTTP parsing
        return True


class LocalIssuer:
    """A minimal OIDC issuer on loopback: discovery + JWKS for one key, hits counted per path.

    `failing = True` makes every endpoint answer 500 (a JWKS outage); `jwks_document` may be
    replaced by a broken one. Also plays the attacker's site for jku/x5u headers, where the only
    interesting figure is `connections`.
    """

    def __init__(self, jwk: dict[str, Any]) -> None:
        self.jwk = jwk
        self.jwks_document: dict[str, Any] = {"keys": [public_jwk(jwk)]}
        self.failing = False
        self.hits: Counter[str] = Counter()
        self.failed_hits = 0
        self._lock = threading.Lock()
        self._local = LocalServer(
            self._handler(), server_class=_CountingServer, name="local-issuer"
        )
        self._server: _CountingServer | None = None  # the one started last, still counted

    @property
    def url(self) -> str:
        return self._local.url

    @property
    def connections(self) -> int:
        return self._server.connections if self._server is not None else 0

    def _documents(self) -> dict[str, dict[str, Any]]:
        return {
            "/.well-known/openid-configuration": {
                "issuer": self.url,
                "jwks_uri": f"{self.url}/jwks",
            },
            "/jwks": self.jwks_document,
        }

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        issuer = self

        class Handler(QuietHandler):
            def do_GET(self) -> None:
                with issuer._lock:
                    issuer.hits[self.path] += 1
                    if issuer.failing:
                        issuer.failed_hits += 1
                document = issuer._documents().get(self.path)
                if issuer.failing or document is None:
                    self.send_error(500 if issuer.failing else 404)
                    return
                payload = json.dumps(document).encode()
                self.answer(200, payload, content_type="application/json")

        return Handler

    def __enter__(self) -> LocalIssuer:
        server = self._local.start()
        assert isinstance(server, _CountingServer)
        self._server = server
        return self

    def __exit__(self, *exc: object) -> None:
        self._local.stop()


@pytest.fixture
def attacker_site() -> Iterator[LocalIssuer]:
    """Where a forged jku/x5u header points: serves the attacker's key, counts connections."""
    with LocalIssuer(generate_rsa_jwk("attacker")) as site:
        yield site


@pytest.fixture
def local_issuer() -> Iterator[LocalIssuer]:
    with LocalIssuer(generate_rsa_jwk(f"local-{secrets.token_hex(3)}")) as issuer:
        yield issuer


@pytest.fixture
def issuer_broker(local_issuer: LocalIssuer, workdir: Path) -> Iterator[BrokerProcess]:
    """A broker that trusts `local_issuer` (fresh, so its JWKS cache starts empty)."""
    config = BrokerConfig(issuer=local_issuer.url)
    with running_broker(config, workdir, name="local-issuer") as process:
        yield process


@pytest.fixture
def at_jwt_broker(local_issuer: LocalIssuer, workdir: Path) -> Iterator[BrokerProcess]:
    """`issuer_broker` with `identity.require_at_jwt` on."""
    config = BrokerConfig(issuer=local_issuer.url, extra={"identity": {"require_at_jwt": True}})
    with running_broker(config, workdir, name="at-jwt") as process:
        yield process


@pytest.fixture
async def issuer_mcp(issuer_broker: BrokerProcess) -> AsyncIterator[McpHttp]:
    client = McpHttp(issuer_broker.mcp_url)
    yield client
    await client.aclose()


@pytest.fixture
def quick_refetch_broker(local_issuer: LocalIssuer, workdir: Path) -> Iterator[BrokerProcess]:
    """`issuer_broker` with `identity.jwks_refresh_cooldown_seconds` at QUICK_COOLDOWN."""
    config = BrokerConfig(
        issuer=local_issuer.url,
        extra={"identity": {"jwks_refresh_cooldown_seconds": QUICK_COOLDOWN}},
    )
    with running_broker(config, workdir, name="quick-refetch") as process:
        yield process


def local_token(issuer: LocalIssuer, broker: BrokerProcess, **overrides: Any) -> str:
    options: dict[str, Any] = {
        "issuer": issuer.url,
        "audience": broker.mcp_url,
        "subject": fresh_user("local"),
    }
    options.update(overrides)
    return mint_token(issuer.jwk, **options)


@pytest.fixture(scope="module")
def scoped_broker(idp: IdpProcess, workdir: Path) -> Iterator[BrokerProcess]:
    """A broker requiring REQUIRED_SCOPES; tokens for it are minted with the IdP's key."""
    config = BrokerConfig(
        issuer=idp.issuer, required_scopes=REQUIRED_SCOPES, providers={"demo": DEMO_PROVIDER}
    )
    with running_broker(config, workdir, name="scoped") as process:
        yield process


@pytest.fixture(scope="module")
async def scoped_db(scoped_broker: BrokerProcess) -> AsyncIterator[AsyncEngine]:
    engine = create_engine(scoped_broker.database_url, pool_size=2)
    yield engine
    await engine.dispose()


@pytest.fixture
async def scoped_mcp(scoped_broker: BrokerProcess) -> AsyncIterator[McpHttp]:
    client = McpHttp(scoped_broker.mcp_url)
    yield client
    await client.aclose()


def scoped_token(idp: IdpProcess, broker: BrokerProcess, user: str, scope: str) -> str:
    return mint_token(
        idp.signing_jwk, issuer=idp.issuer, audience=broker.mcp_url, subject=user, scope=scope
    )


# ---------------------------------------------------------------------------------------------
# Baseline and RFC 9728 metadata
# ---------------------------------------------------------------------------------------------


async def test_access_token_issued_by_the_idp_is_accepted(
    mcp: McpHttp, idp: IdpProcess, broker: BrokerProcess
) -> None:
    """A real RFC 9068 token from the IdP (resource indicator = our /mcp URL) is served."""
    token = await obtain_access_token(
        idp.issuer,
        user=fresh_user("real"),
        client_id="mcp-client",
        client_secret=None,
        redirect_uri="http://127.0.0.1:9/callback",
        resource=broker.mcp_url,
    )

    response = await discover(mcp, token)

    assert response.status_code == 200, response.text
    validate_response(response.json(), "DiscoverResult")
    assert unverified_jwt(token)[0]["typ"] == "at+jwt"  # what identity.require_at_jwt asks


@pytest.mark.parametrize(
    "path",
    ["/.well-known/oauth-protected-resource", "/.well-known/oauth-protected-resource/mcp"],
)
async def test_protected_resource_metadata_names_our_resource_and_issuer(
    mcp: McpHttp, broker: BrokerProcess, idp: IdpProcess, path: str
) -> None:
    """RFC 9728 §3: the document (same at both paths) says where clients get tokens for /mcp."""
    response = await mcp.http.get(f"{broker.url}{path}")

    assert response.status_code == 200
    assert response.headers["content-type"].startswith("application/json")
    document = response.json()
    assert document["resource"] == broker.mcp_url
    assert document["authorization_servers"] == [idp.issuer]
    assert document["bearer_methods_supported"] == ["header"]


async def test_protected_resource_metadata_is_the_same_at_both_paths(
    mcp: McpHttp, broker: BrokerProcess
) -> None:
    """RFC 9728 §3.1 path-inserted form and the bare form serve one document."""
    bare = await mcp.http.get(f"{broker.url}/.well-known/oauth-protected-resource")
    inserted = await mcp.http.get(metadata_url(broker))

    assert bare.json() == inserted.json()


async def test_L14_challenge_names_the_default_scope_when_none_is_required(
    mcp: McpHttp, broker: BrokerProcess
) -> None:
    """With `identity.required_scopes` empty, the 401 still says what to ask for (`openid`)."""
    response = await mcp.post(request_body("server/discover"), token=None)

    assert response.status_code == 401
    params = challenge_params(response)
    assert params["scope"] == "openid"
    assert "error" not in params


async def test_L14_protected_resource_metadata_lists_the_default_scope_when_none_is_required(
    mcp: McpHttp, broker: BrokerProcess
) -> None:
    """RFC 9728 §2 `scopes_supported` is listed on a broker that requires no scope."""
    response = await mcp.http.get(metadata_url(broker))

    assert response.status_code == 200
    assert response.json()["scopes_supported"] == ["openid"]


# ---------------------------------------------------------------------------------------------
# A1-A9: tokens that must be refused
# ---------------------------------------------------------------------------------------------


async def test_a1_missing_token_gets_a_bare_challenge_with_resource_metadata(
    mcp: McpHttp, broker: BrokerProcess, db: AsyncEngine
) -> None:
    """A1. RFC 6750 §3.1 / RFC 9728 §5.1: no `error=` without a token; nothing is processed."""
    flows_before = await flow_ids(db)

    response = await mcp.post(connect_body(), token=None)

    assert response.status_code == 401
    assert response.headers["www-authenticate"] == (
        f'Bearer resource_metadata="{metadata_url(broker)}", scope="openid"'
    )
    assert await flow_ids(db) <= flows_before


async def test_a2_token_signed_by_another_key_with_the_idps_kid_is_refused(
    mcp: McpHttp, idp: IdpProcess, broker: BrokerProcess
) -> None:
    """A2. The kid is known, the signature is not the IdP's: invalid_token."""
    other = generate_rsa_jwk(idp.signing_jwk["kid"])
    token = mint_token(other, issuer=idp.issuer, audience=broker.mcp_url, subject="a2")

    response = await discover(mcp, token)

    assert_invalid_token(response, broker, token)


async def test_a3_expired_token_is_refused(
    mcp: McpHttp, token_for: Any, broker: BrokerProcess
) -> None:
    """A3. exp two minutes ago is beyond the 60 s leeway."""
    token = token_for(fresh_user("a3"), lifetime=-120)

    response = await discover(mcp, token)

    assert_invalid_token(response, broker, token)


async def test_a3_token_expired_within_the_leeway_is_accepted(mcp: McpHttp, token_for: Any) -> None:
    """A3 (control). exp 30 s ago is inside the 60 s clock-skew leeway."""
    token = token_for(fresh_user("a3ok"), lifetime=-30)

    response = await discover(mcp, token)

    assert response.status_code == 200, response.text


async def test_a4_token_not_yet_valid_is_refused(
    mcp: McpHttp, token_for: Any, broker: BrokerProcess
) -> None:
    """A4. nbf five minutes ahead is beyond the leeway."""
    token = token_for(fresh_user("a4"), extra={"nbf": int(time.time()) + 300})

    response = await discover(mcp, token)

    assert_invalid_token(response, broker, token)


@pytest.mark.parametrize(
    "audience",
    ["https://other.example/mcp", ["https://x.example/mcp", "https://y.example/mcp"]],
    ids=["other-resource", "list-without-ours"],
)
async def test_a5_token_for_another_audience_is_refused(
    mcp: McpHttp, token_for: Any, broker: BrokerProcess, audience: str | list[str]
) -> None:
    """A5. RFC 8707 audience binding: a token for another resource is not ours to accept."""
    token = token_for(fresh_user("a5"), audience=audience)

    response = await discover(mcp, token)

    assert_invalid_token(response, broker, token)


async def test_a5_list_audience_including_ours_is_accepted(
    mcp: McpHttp, token_for: Any, broker: BrokerProcess
) -> None:
    """A5 (control). An audience list that contains our /mcp URL is valid (RFC 7519 §4.1.3)."""
    token = token_for(fresh_user("a5ok"), audience=["https://x.example/mcp", broker.mcp_url])

    response = await discover(mcp, token)

    assert response.status_code == 200, response.text


async def test_a6_token_from_another_issuer_is_refused(
    mcp: McpHttp, token_for: Any, broker: BrokerProcess
) -> None:
    """A6. Same key, other `iss`: identity is (iss, sub), so the issuer must be ours."""
    token = token_for(fresh_user("a6"), issuer="https://other-idp.example")

    response = await discover(mcp, token)

    assert_invalid_token(response, broker, token)


async def test_a6_id_token_is_refused_as_an_access_token(
    mcp: McpHttp, idp: IdpProcess, broker: BrokerProcess
) -> None:
    """A6. A real ID token of the IdP (aud = the login client id) is not an access token."""
    tokens = await obtain_tokens(
        idp.issuer,
        user=fresh_user("a6id"),
        client_id="broker-login",
        client_secret="broker-login-secret",
        redirect_uri=f"{broker.url}/login/callback",
        resource=None,
        scope="openid",
    )
    id_token = tokens["id_token"]
    assert unverified_jwt(id_token)[1]["aud"] == "broker-login"

    response = await discover(mcp, id_token)

    assert_invalid_token(response, broker, id_token)


@pytest.mark.parametrize("trick", ["alg-none", "hs256-public-key", "jku", "x5u", "embedded-jwk"])
async def test_a7_algorithm_and_key_header_tricks_are_refused(
    mcp: McpHttp,
    idp: IdpProcess,
    broker: BrokerProcess,
    attacker_site: LocalIssuer,
    trick: str,
) -> None:
    """A7. Fixed algorithm allow-list; keys only from the issuer's JWKS, never from the token."""
    claims: dict[str, Any] = {
        "issuer": idp.issuer,
        "audience": broker.mcp_url,
        "subject": fresh_user("a7"),
    }
    attacker = attacker_site.jwk
    idp_kid = idp.signing_jwk["kid"]
    if trick == "alg-none":
        token = mint_token(idp.signing_jwk, header={"alg": "none"}, **claims)
    elif trick == "hs256-public-key":
        _, payload = unverified_jwt(mint_token(idp.signing_jwk, **claims))
        token = hs256_with_public_key(idp.signing_jwk, payload)
    elif trick == "jku":
        token = mint_token(attacker, header={"jku": f"{attacker_site.url}/jwks"}, **claims)
    elif trick == "x5u":
        token = mint_token(attacker, header={"x5u": f"{attacker_site.url}/cert.pem"}, **claims)
    else:
        token = mint_token(attacker, header={"kid": idp_kid, "jwk": public_jwk(attacker)}, **claims)

    response = await discover(mcp, token)

    assert_invalid_token(response, broker, token)
    assert attacker_site.connections == 0


async def test_a8_token_without_exp_is_refused(
    mcp: McpHttp, token_for: Any, broker: BrokerProcess
) -> None:
    """A8. exp is essential in the claims registry; joserfc alone would let this pass."""
    token = token_for(fresh_user("a8"), omit=("exp",))

    response = await discover(mcp, token)

    assert_invalid_token(response, broker, token)


async def test_a9_token_in_the_query_string_is_refused_and_not_logged(
    mcp: McpHttp, token_for: Any, broker: BrokerProcess
) -> None:
    """A9. MCP auth: tokens MUST NOT travel in the URI; the access log drops query strings."""
    token = token_for(fresh_user("a9"))
    body = request_body("server/discover")
    window = LogWindow(broker)

    response = await mcp.http.post(
        f"{broker.mcp_url}?access_token={token}",
        content=json.dumps(body).encode(),
        headers=request_headers(body, None),
    )

    assert response.status_code == 401
    assert "error" not in challenge_params(response)
    assert token not in response.text
    log = await window.wait_for("POST /mcp 401")
    assert "POST /mcp 401" in log
    assert token not in log


# ---------------------------------------------------------------------------------------------
# A10: scopes (dedicated broker)
# ---------------------------------------------------------------------------------------------


async def test_a10_token_lacking_a_required_scope_is_forbidden(
    scoped_mcp: McpHttp, scoped_broker: BrokerProcess, scoped_db: AsyncEngine, idp: IdpProcess
) -> None:
    """A10. RFC 6750 §3.1: 403 insufficient_scope naming the scopes; the tool does not run."""
    user = fresh_user("a10")
    token = scoped_token(idp, scoped_broker, user, scope="openid mcp:tools")

    response = await scoped_mcp.post(connect_body(), token=token)

    assert response.status_code == 403, response.text
    params = challenge_params(response)
    assert params["error"] == "insufficient_scope"
    assert params["scope"] == " ".join(REQUIRED_SCOPES)
    assert params["resource_metadata"] == metadata_url(scoped_broker)
    assert await count_rows(scoped_db, "flows", subject=user) == 0


async def test_a10_token_with_the_required_scopes_is_served(
    scoped_mcp: McpHttp, scoped_broker: BrokerProcess, scoped_db: AsyncEngine, idp: IdpProcess
) -> None:
    """A10 (control). The same call with every required scope runs the tool."""
    user = fresh_user("a10ok")
    token = scoped_token(idp, scoped_broker, user, scope="openid mcp:tools broker:connect")

    response = await scoped_mcp.post(connect_body(), token=token)

    assert response.status_code == 200, response.text
    validate_response(response.json(), "InputRequiredResult")
    assert await count_rows(scoped_db, "flows", subject=user) == 1


async def test_a10_missing_token_challenge_names_the_required_scopes(
    scoped_mcp: McpHttp, scoped_broker: BrokerProcess
) -> None:
    """A1 on a scoped broker: the bare challenge also says which scopes to ask for."""
    response = await scoped_mcp.post(request_body("server/discover"), token=None)

    assert response.status_code == 401
    params = challenge_params(response)
    assert "error" not in params
    assert params["scope"] == " ".join(REQUIRED_SCOPES)
    assert params["resource_metadata"] == metadata_url(scoped_broker)


async def test_protected_resource_metadata_lists_the_required_scopes(
    scoped_mcp: McpHttp, scoped_broker: BrokerProcess
) -> None:
    """RFC 9728 §2: scopes_supported tells clients what to request."""
    response = await scoped_mcp.http.get(metadata_url(scoped_broker))

    assert response.json()["scopes_supported"] == REQUIRED_SCOPES


# ---------------------------------------------------------------------------------------------
# A11-A12: the JWKS cache under attack and during an outage (dedicated issuer and broker)
# ---------------------------------------------------------------------------------------------


async def test_a11_random_kid_flood_fetches_jwks_at_most_once_per_cooldown(
    issuer_mcp: McpHttp, issuer_broker: BrokerProcess, local_issuer: LocalIssuer
) -> None:
    """A11. Unknown kids may force a refetch only once per cooldown; valid callers keep working."""
    started = time.monotonic()
    warm_up = await discover(issuer_mcp, local_token(local_issuer, issuer_broker))
    assert warm_up.status_code == 200, warm_up.text
    assert local_issuer.hits["/jwks"] == 1
    audience = {"issuer": local_issuer.url, "audience": issuer_broker.mcp_url}
    forge = signer(generate_rsa_jwk("attacker"), **audience)
    genuine = signer(local_issuer.jwk, **audience)
    forged = [
        forge(subject="flood", kid=f"random-{secrets.token_hex(8)}") for _ in range(FLOOD_SIZE)
    ]
    valid = [genuine(subject=fresh_user("a11")) for _ in range(FLOOD_SIZE // 20)]
    gate = asyncio.Semaphore(FLOOD_CONCURRENCY)

    async def send(token: str) -> int:
        async with gate:
            return (await discover(issuer_mcp, token)).status_code

    statuses = await asyncio.gather(*(send(token) for token in forged + valid))
    elapsed = time.monotonic() - started

    assert Counter(statuses[:FLOOD_SIZE]) == {401: FLOOD_SIZE}
    assert Counter(statuses[FLOOD_SIZE:]) == {200: len(valid)}
    assert local_issuer.hits["/jwks"] <= 1 + int(elapsed // JWKS_COOLDOWN)


async def test_a12_jwks_outage_keeps_the_last_known_good_keys(
    quick_refetch_broker: BrokerProcess, local_issuer: LocalIssuer
) -> None:
    """A12. A failed refresh must not wipe the cached keys (pyjwt #1162): valid tokens still pass.

    A refresh is only attempted for an unknown kid once the cooldown has passed, so the test
    keeps sending unknown kids (bounded by the broker's cooldown, set short, plus a margin
    shorter than the default cooldown) until the failing issuer has actually been asked, then
    checks fresh valid tokens (fresh: the verified-token cache must not hide the behaviour).
    """
    broker = quick_refetch_broker
    async with contextlib.aclosing(McpHttp(broker.mcp_url)) as mcp:
        first = await discover(mcp, local_token(local_issuer, broker))
        assert first.status_code == 200, first.text
        local_issuer.failing = True
        deadline = time.monotonic() + QUICK_COOLDOWN + 15
        while local_issuer.failed_hits == 0:
            assert time.monotonic() < deadline, "the broker never retried the JWKS"
            unknown_kid = local_token(local_issuer, broker, header={"kid": "rotated-away"})
            assert (await discover(mcp, unknown_kid)).status_code == 401
            await asyncio.sleep(0.5)

        statuses = [
            (await discover(mcp, local_token(local_issuer, broker))).status_code for _ in range(3)
        ]

    assert statuses == [200, 200, 200]
    assert await broker.log_shows("jwks.refresh_failed")


async def test_a12_unusable_jwks_document_is_an_idp_outage_not_a_crash(
    issuer_mcp: McpHttp, issuer_broker: BrokerProcess, local_issuer: LocalIssuer
) -> None:
    """A12. A JWKS the key library rejects is a failed refresh like any other: 503, never 500.

    The broker fetches keys on first use, and has no last-known-good set yet, so the honest
    answer is "IdP unavailable".
    """
    truncated_key = {k: v for k, v in public_jwk(local_issuer.jwk).items() if k != "n"}
    local_issuer.jwks_document = {"keys": [truncated_key]}

    response = await discover(issuer_mcp, local_token(local_issuer, issuer_broker))

    assert local_issuer.hits["/jwks"] == 1
    assert response.status_code == 503, response.text
    assert response.headers["retry-after"]
    assert response.json()["error"] == "temporarily_unavailable"
    assert await issuer_broker.log_shows("jwks.refresh_failed")


TYPES = {"at+jwt": "at+jwt", "media-type": "application/AT+JWT", "jwt": "JWT", "none": None}


@pytest.mark.parametrize("typ", TYPES.values(), ids=TYPES.keys())
async def test_t8_with_require_at_jwt_only_an_access_token_typ_is_served(
    local_issuer: LocalIssuer, at_jwt_broker: BrokerProcess, typ: str | None
) -> None:
    """T8 (RFC 9068 §4): with `identity.require_at_jwt`, a JWT the IdP signed for the broker's
    audience is served only if its header calls it an access token; the media type's full form
    and case do not matter."""
    token = local_token(local_issuer, at_jwt_broker, header={"typ": typ})
    mcp = McpHttp(at_jwt_broker.mcp_url)
    try:
        response = await discover(mcp, token)
    finally:
        await mcp.aclose()

    if typ is not None and typ.lower().endswith("at+jwt"):
        assert response.status_code == 200, response.text
    else:
        assert_invalid_token(response, at_jwt_broker, token)


async def test_t8_without_require_at_jwt_another_typ_is_served(
    local_issuer: LocalIssuer, issuer_broker: BrokerProcess, issuer_mcp: McpHttp
) -> None:
    """The default: an IdP that does not issue RFC 9068 tokens still works (its `typ` is `JWT`
    or none); issuer, audience, expiry and signature are checked as ever."""
    token = local_token(local_issuer, issuer_broker, header={"typ": "JWT"})

    assert (await discover(issuer_mcp, token)).status_code == 200
