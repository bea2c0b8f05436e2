"""Rate limits (SECURITY.md T21; MCP servers must rate-limit tool invocations): a budget of MCP
requests per user, and a budget of failed authentications per client address, after which that
address's new tokens and service secrets are refused unchecked (app/limits.py).

The token buckets are tested alone with a hand-driven clock; the limits themselves on a broker of
their own (small budgets: 3 at once, then one every 3 s, so a stalled machine does not refill a
bucket mid-test), on the wire, through the official MCP client, and for the integration API on
both kinds of route (the credential fetch's plain route and a FastAPI route).
"""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any, cast

import httpx2
import pytest
from joserfc import jwt
from joserfc.jwk import KeySet, RSAKey
from mcp import Client
from mcp.client.streamable_http import streamable_http_client
from mcp.shared.exceptions import MCPError

from app.auth.bearer import InvalidToken, TokenVerifier
from app.auth.jwks import JwksCache
from app.config import LimitSettings
from app.db import create_engine
from app.limits import TokenBuckets, client_key, retry_after
from app.mcp.protocol import RATE_LIMITED

from .conftest import DEMO_PROVIDER, count_rows
from .integration_api.test_helper import Sibling, result_of
from .support.broker import BrokerConfig, BrokerProcess, LogWindow, cli, running_broker
from .support.clients import McpHttp, request_body
from .support.http import local_client
from .support.idp import IdpProcess, mint_token
from .support.schema import validate_response
from .test_metrics import SCRAPE_TOKEN, scrape

BURST = 3
SMALL_LIMITS = {
    "user_requests_per_minute": 20,
    "user_burst": BURST,
    "failed_auths_per_minute": 20,
    "failed_auth_burst": BURST,
}


async def refusals(broker: BrokerProcess) -> dict[str, float]:
    """`broker_rate_limited_total` by limit, scraped from /metrics."""
    async with local_client() as http:
        _, samples = await scrape(http, broker)
    return {
        dict(labels)["limit"]: count
        for (name, labels), count in samples.items()
        if name == "broker_rate_limited_total"
    }


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


# ------------------------------------------------------------------------------------------------
# The buckets
# ------------------------------------------------------------------------------------------------


def test_a_bucket_gives_its_burst_then_one_token_per_interval() -> None:
    clock = Clock()
    buckets = TokenBuckets(per_minute=30, burst=3, clock=clock)  # one token every 2 s
    assert [buckets.take("alice") for _ in range(3)] == [0.0, 0.0, 0.0]
    assert buckets.take("alice") == pytest.approx(2.0)
    assert buckets.wait("alice") == pytest.approx(2.0)
    assert buckets.take("bob") == 0.0  # each key has its own bucket
    clock.now += 1.5
    assert buckets.take("alice") == pytest.approx(0.5)
    clock.now += 0.5
    assert buckets.wait("alice") == 0.0
    assert buckets.take("alice") == 0.0
    assert buckets.take("alice") == pytest.approx(2.0)
    clock.now += 3600  # a long pause refills to the burst, never beyond
    assert [buckets.take("alice") for _ in range(4)][-1] == pytest.approx(2.0)


def test_wait_spends_nothing_and_a_zero_budget_is_off() -> None:
    clock = Clock()
    buckets = TokenBuckets(per_minute=60, burst=1, clock=clock)
    assert buckets.wait("alice") == 0.0
    assert buckets.wait("alice") == 0.0
    assert buckets.take("alice") == 0.0
    assert buckets.take("alice") == pytest.approx(1.0)
    off = TokenBuckets(per_minute=0, burst=1, clock=clock)
    assert {off.take("alice") for _ in range(1000)} == {0.0}
    assert off.wait("alice") == 0.0
    assert len(off) == 0


def test_memory_is_bounded_refilled_buckets_go_first() -> None:
    clock = Clock()
    buckets = TokenBuckets(per_minute=60, burst=2, clock=clock, max_keys=10)
    for n in range(9):
        buckets.take(f"idle-{n}")
    clock.now += 5  # every bucket so far has refilled: dropping them changes nothing
    buckets.take("busy")
    buckets.take("busy")
    buckets.take("new")  # the 11th key: the refilled ones make room
    assert len(buckets) == 2
    assert buckets.take("busy") == pytest.approx(1.0)  # its spent bucket was kept
    for n in range(50):  # a flood of new keys, none refilled: the oldest half goes each time
        buckets.take(f"flood-{n}")
        assert len(buckets) <= 10


@pytest.mark.parametrize(
    ("client", "key"),
    [
        (("203.0.113.7", 5000), "203.0.113.7"),
        (("2001:db8:1:2:aaaa::1", 5000), "2001:db8:1:2::/64"),
        (("2001:db8:1:2:bbbb::9", 5000), "2001:db8:1:2::/64"),  # the same /64: one client
        (("2001:db8:1:3::1", 5000), "2001:db8:1:3::/64"),
        (("::ffff:198.51.100.4", 5000), "198.51.100.4"),
        (("unix-socket-peer", 0), "unix-socket-peer"),
        (None, "unknown"),
    ],
)
def test_a_client_is_its_ip_address_and_an_ipv6_client_its_64(
    client: tuple[str, int] | None, key: str
) -> None:
    assert client_key(client) == key


def test_retry_after_is_whole_seconds_rounded_up_and_at_least_one() -> None:
    assert [retry_after(s) for s in (0.01, 1.0, 1.2, 59.5)] == ["1", "1", "2", "60"]


def test_the_default_budgets() -> None:
    defaults = LimitSettings()
    assert (defaults.user_requests_per_minute, defaults.user_burst) == (600, 120)
    assert (defaults.failed_auths_per_minute, defaults.failed_auth_burst) == (60, 30)


# ------------------------------------------------------------------------------------------------
# On a broker with small budgets
# ------------------------------------------------------------------------------------------------


@pytest.fixture
def limited_broker(idp: IdpProcess, workdir: Path) -> Iterator[BrokerProcess]:
    """A broker of this test's own (its buckets start full) with SMALL_LIMITS."""
    config = BrokerConfig(
        issuer=idp.issuer,
        providers={"demo": DEMO_PROVIDER},
        extra={"limits": SMALL_LIMITS, "server": {"metrics_token": SCRAPE_TOKEN}},
    )
    with running_broker(config, workdir, name="limited") as process:
        yield process


@pytest.fixture
async def limited_mcp(limited_broker: BrokerProcess) -> AsyncIterator[McpHttp]:
    client = McpHttp(limited_broker.mcp_url)
    yield client
    await client.aclose()


def token(idp: IdpProcess, broker: BrokerProcess, user: str, **overrides: Any) -> str:
    options: dict[str, Any] = {"issuer": idp.issuer, "audience": broker.mcp_url, "subject": user}
    options.update(overrides)
    return mint_token(idp.signing_jwk, **options)


async def list_tools(mcp: McpHttp, bearer: str | None) -> httpx2.Response:
    return await mcp.post(request_body("tools/list"), token=bearer)


def assert_rate_limited(response: httpx2.Response, text: str) -> dict[str, Any]:
    """A 429 JSON-RPC error: Retry-After, our code, the seconds in `data`; schema-valid."""
    assert response.status_code == 429, response.text
    body: dict[str, Any] = response.json()
    validate_response(body)
    error = body["error"]
    assert error["code"] == RATE_LIMITED
    assert text in error["message"]
    wait = response.headers["retry-after"]
    assert wait.isdigit() and 1 <= int(wait) <= 60
    assert error["data"] == {"retryAfterSeconds": int(wait)}
    assert f"retry after {wait} s" in error["message"]
    return body


async def test_a_user_past_the_budget_gets_429_and_other_users_are_served(
    limited_mcp: McpHttp, limited_broker: BrokerProcess, idp: IdpProcess
) -> None:
    alice = token(idp, limited_broker, "alice-" + secrets.token_hex(3))
    bob = token(idp, limited_broker, "bob-" + secrets.token_hex(3))
    for _ in range(BURST):
        assert (await list_tools(limited_mcp, alice)).status_code == 200
    body = request_body("tools/call", {"name": "connect_account", "arguments": {}})
    refused = await limited_mcp.post(body, token=alice)
    assert assert_rate_limited(refused, "Too many requests for this user")["id"] == body["id"]
    assert (await list_tools(limited_mcp, bob)).status_code == 200
    assert await refusals(limited_broker) == {"user": 1}
    await asyncio.sleep(int(refused.headers["retry-after"]) + 0.2)
    assert (await list_tools(limited_mcp, alice)).status_code == 200


async def test_a_refused_tool_call_creates_no_flow(
    limited_mcp: McpHttp, limited_broker: BrokerProcess, idp: IdpProcess
) -> None:
    user = "carol-" + secrets.token_hex(3)
    carol = token(idp, limited_broker, user)
    for _ in range(BURST):
        assert (await list_tools(limited_mcp, carol)).status_code == 200
    refused = await limited_mcp.call_tool(carol, "connect_account", {"provider": "demo"})
    assert_rate_limited(refused, "Too many requests for this user")
    engine = create_engine(limited_broker.database_url, pool_size=1)
    try:
        assert await count_rows(engine, "flows", subject=user) == 0
    finally:
        await engine.dispose()


async def test_the_official_client_sees_the_refusal_as_an_error_with_our_code(
    limited_broker: BrokerProcess, idp: IdpProcess
) -> None:
    bearer = token(idp, limited_broker, "dave-" + secrets.token_hex(3))
    http = local_client(headers={"Authorization": f"Bearer {bearer}"})
    async with http, Client(streamable_http_client(limited_broker.mcp_url, http_client=http)) as c:
        outcomes: list[Any] = []
        for _ in range(BURST + 1):
            try:
                outcomes.append(await c.call_tool("list_providers", {}))
            except MCPError as exc:
                outcomes.append(exc)
    # the client spends some of the budget on requests of its own (e.g. tools/list)
    assert not isinstance(outcomes[0], MCPError)
    refusals = [o for o in outcomes if isinstance(o, MCPError)]
    assert refusals and isinstance(outcomes[-1], MCPError), outcomes
    for refusal in refusals:
        assert refusal.error.code == RATE_LIMITED
        assert "Too many requests for this user; retry after" in refusal.error.message


async def test_an_address_past_its_failed_authentications_is_refused_before_any_check(
    limited_mcp: McpHttp, limited_broker: BrokerProcess, idp: IdpProcess
) -> None:
    known = token(idp, limited_broker, "erin-" + secrets.token_hex(3))
    assert (await list_tools(limited_mcp, known)).status_code == 200  # verified once
    window = LogWindow(limited_broker)
    forged = token(idp, limited_broker, "mallory", audience="https://elsewhere.example/mcp")
    for _ in range(BURST):
        refused = await list_tools(limited_mcp, forged)
        assert refused.status_code == 401
        assert refused.json()["error"] == "invalid_token"
    assert await window.shows("auth.failed_auth_limit_reached address=127.0.0.1")
    blocked = await list_tools(limited_mcp, forged)
    assert_rate_limited(blocked, "Too many failed authentications from this address")
    # a valid token never seen before waits too: no signature is checked for this address
    fresh = token(idp, limited_broker, "frank-" + secrets.token_hex(3))
    assert_rate_limited(await list_tools(limited_mcp, fresh), "failed authentications")
    # a token this broker verified before is served: users behind the same address keep working
    assert (await list_tools(limited_mcp, known)).status_code == 200
    assert window.text().count("auth.invalid_token") == BURST  # the refused ones were not checked
    await asyncio.sleep(int(blocked.headers["retry-after"]) + 0.2)
    assert (await list_tools(limited_mcp, fresh)).status_code == 200
    assert window.text().count("auth.failed_auth_limit_reached") == 1
    assert await refusals(limited_broker) == {"failed_auths": 2}


async def test_behind_a_trusted_proxy_each_forwarded_client_has_its_own_budget(
    limited_mcp: McpHttp, limited_broker: BrokerProcess, idp: IdpProcess
) -> None:
    """127.0.0.1 is a proxy uvicorn trusts (its default): X-Forwarded-For names the client."""
    forged = token(idp, limited_broker, "mallory", audience="https://elsewhere.example/mcp")

    async def from_client(address: str, bearer: str) -> httpx2.Response:
        body = request_body("tools/list")
        return await limited_mcp.post(body, token=bearer, headers={"X-Forwarded-For": address})

    window = LogWindow(limited_broker)
    for _ in range(BURST):
        assert (await from_client("203.0.113.9", forged)).status_code == 401
    assert (await from_client("203.0.113.9", forged)).status_code == 429
    assert await window.shows("auth.failed_auth_limit_reached address=203.0.113.9")
    assert (await from_client("203.0.113.10", forged)).status_code == 401  # still checked
    fresh = token(idp, limited_broker, "ivan-" + secrets.token_hex(3))
    assert (await list_tools(limited_mcp, fresh)).status_code == 200  # the proxy's own budget


async def test_an_expired_token_of_ours_is_not_a_failed_authentication(
    limited_mcp: McpHttp, limited_broker: BrokerProcess, idp: IdpProcess
) -> None:
    """Clients refresh when told their token expired (many users behind one NAT do it all day);
    an expired token that is wrong in any other way still counts."""
    expired = token(idp, limited_broker, "kim-" + secrets.token_hex(3), lifetime=-120)
    for _ in range(BURST * 2):
        refused = await list_tools(limited_mcp, expired)
        assert refused.status_code == 401
        assert refused.json()["error"] == "invalid_token"
    fresh = token(idp, limited_broker, "lee-" + secrets.token_hex(3))
    assert (await list_tools(limited_mcp, fresh)).status_code == 200
    elsewhere = "https://elsewhere.example/mcp"
    for _ in range(BURST):
        forged = token(idp, limited_broker, "mallory", audience=elsewhere, lifetime=-120)
        assert (await list_tools(limited_mcp, forged)).status_code == 401
    assert (await list_tools(limited_mcp, expired)).status_code == 429


class CountingKeys:
    """A JWKS cache stand-in that counts the signature checks it serves keys for."""

    def __init__(self, key: RSAKey) -> None:
        self.key_set = KeySet([key])
        self.requests = 0

    async def keys_for(self, kid: str | None) -> KeySet:
        self.requests += 1
        return self.key_set


async def test_a_replayed_expired_token_is_refused_without_a_signature_check() -> None:
    key = RSAKey.generate_key(2048, parameters={"kid": "k1"})
    keys = CountingKeys(key)
    verifier = TokenVerifier(
        issuer="https://idp.test",
        audience="https://broker.test/mcp",
        identity_claim="sub",
        algorithms=("RS256",),
        jwks=cast(JwksCache, keys),
    )
    now = int(time.time())
    claims = {"iss": "https://idp.test", "aud": "https://broker.test/mcp", "sub": "ann"}
    expired = jwt.encode({"alg": "RS256", "kid": "k1"}, {**claims, "exp": now - 600}, key)
    wrong_audience = jwt.encode(
        {"alg": "RS256", "kid": "k1"}, {**claims, "aud": "https://x.test", "exp": now - 600}, key
    )
    for _ in range(3):
        with pytest.raises(InvalidToken) as refused:
            await verifier.verify(expired)
        assert refused.value.expired
    assert keys.requests == 1
    with pytest.raises(InvalidToken) as refused:
        await verifier.verify(wrong_audience)
    assert not refused.value.expired
    valid = jwt.encode({"alg": "RS256", "kid": "k1"}, {**claims, "exp": now + 600}, key)
    assert (await verifier.verify(valid)).principal.subject == "ann"


async def test_a_request_without_a_token_is_not_a_failed_authentication(
    limited_mcp: McpHttp, limited_broker: BrokerProcess, idp: IdpProcess
) -> None:
    """A client's first request has no token (it learns where to get one from the 401)."""
    for _ in range(BURST * 3):
        assert (await list_tools(limited_mcp, None)).status_code == 401
    fresh = token(idp, limited_broker, "gina-" + secrets.token_hex(3))
    assert (await list_tools(limited_mcp, fresh)).status_code == 200


async def test_an_address_past_its_failed_service_secrets_gets_429_problem_json(
    limited_broker: BrokerProcess, idp: IdpProcess
) -> None:
    created = cli("service", "create", "sibling", config_path=limited_broker.config_path)
    assert created.returncode == 0, created.stderr
    secret = created.stdout.strip()
    wrong = "cbs_" + secrets.token_urlsafe(32)
    query = {"issuer": idp.issuer, "subject": "hana"}
    credential_route = "/api/v1/credentials/demo"  # a plain route of its own
    fastapi_route = "/api/v1/connections"
    async with local_client(base_url=limited_broker.url) as http:

        def get(path: str, bearer: str) -> Any:
            return http.get(path, params=query, headers={"Authorization": f"Bearer {bearer}"})

        for path in (credential_route, fastapi_route, credential_route):
            failed = await get(path, wrong)
            assert failed.status_code == 401
            assert failed.json()["type"] == "urn:connect-broker:error:invalid_service_credentials"
        for path in (credential_route, fastapi_route):
            for bearer in (wrong, secret):  # a secret never verified here is not looked up either
                refused = await get(path, bearer)
                assert refused.status_code == 429, (path, refused.text)
                assert refused.headers["content-type"] == "application/problem+json"
                problem = refused.json()
                assert problem["type"] == (
                    "urn:connect-broker:error:too_many_failed_authentications"
                )
                assert problem["status"] == 429
                assert refused.headers["retry-after"].isdigit()
                assert secret not in refused.text and wrong not in refused.text
        assert await refusals(limited_broker) == {"failed_auths": 4}
        await asyncio.sleep(int(refused.headers["retry-after"]) + 0.2)
        assert (await get(credential_route, secret)).status_code == 404  # served: hana has no key


async def test_L10_a_verified_service_secret_is_not_refused_by_its_address_lockout(
    limited_broker: BrokerProcess, idp: IdpProcess
) -> None:
    """L10. Siblings behind one address (a shared NAT): wrong secrets from one of them spend the
    address's budget, and a secret this broker has verified keeps being served on every path,
    as verified MCP tokens are, while the wrong ones are refused unchecked."""
    created = cli("service", "create", "nat-sibling", config_path=limited_broker.config_path)
    assert created.returncode == 0, created.stderr
    secret = created.stdout.strip()
    wrong = "cbs_" + secrets.token_urlsafe(32)
    query = {"issuer": idp.issuer, "subject": "ivan"}
    async with local_client(base_url=limited_broker.url) as http:

        def get(path: str, bearer: str) -> Any:
            return http.get(path, params=query, headers={"Authorization": f"Bearer {bearer}"})

        assert (await get("/api/v1/credentials/demo", secret)).status_code == 404  # verified
        window = LogWindow(limited_broker)
        for _ in range(BURST):
            assert (await get("/api/v1/connections", wrong)).status_code == 401
        assert await window.shows("auth.failed_auth_limit_reached address=127.0.0.1")
        assert (await get("/api/v1/connections", wrong)).status_code == 429

        served = [
            await get("/api/v1/credentials/demo", secret),  # ivan has no key
            await http.get(  # authenticated, then refused for the extra parameter
                "/api/v1/credentials/demo",
                params={**query, "via": "x"},
                headers={"Authorization": f"Bearer {secret}"},
            ),
            await get("/api/v1/connections", secret),
        ]
        refused = await get("/api/v1/credentials/demo", wrong)

    assert [answer.status_code for answer in served] == [404, 422, 200]
    assert refused.status_code == 429
    assert refused.json()["type"] == "urn:connect-broker:error:too_many_failed_authentications"
    assert secret not in limited_broker.log() and wrong not in limited_broker.log()
    assert await refusals(limited_broker) == {"failed_auths": 2}


ADMIN_TOKEN = "admin-" + "b" * 40


@pytest.mark.parametrize("verified_before", [True, False], ids=["verified", "never-verified"])
async def test_L12_a_verified_admin_token_is_not_refused_by_its_address_lockout(
    idp: IdpProcess, workdir: Path, verified_before: bool
) -> None:
    """L12 for operators: wrong secrets from a shared address spend its budget; the admin token,
    once verified by this broker, is still served there. One it has never verified gets the 429
    any credential gets, so the lockout still tells a guesser nothing."""
    config = BrokerConfig(
        issuer=idp.issuer,
        providers={"demo": DEMO_PROVIDER},
        extra={"limits": SMALL_LIMITS, "admin": {"token": ADMIN_TOKEN}},
    )
    with running_broker(config, workdir, name="limited-admin") as broker:
        user = {"issuer": idp.issuer, "subject": f"nobody-{secrets.token_hex(3)}"}
        async with local_client(base_url=broker.url) as http:

            def erase(bearer: str) -> Any:
                headers = {"Authorization": f"Bearer {bearer}"}
                return http.delete("/api/v1/admin/users", params=user, headers=headers)

            if verified_before:
                assert (await erase(ADMIN_TOKEN)).status_code == 200
            wrong = "cbs_" + secrets.token_urlsafe(32)
            for _ in range(BURST):
                wrong_secret = {"Authorization": f"Bearer {wrong}"}
                response = await http.get("/api/v1/connections", headers=wrong_secret)
                assert response.status_code == 401
            assert (await erase("admin-" + "c" * 40)).status_code == 429
            answer = await erase(ADMIN_TOKEN)

    assert answer.status_code == (200 if verified_before else 429), answer.text


async def test_a_sibling_refused_for_its_address_answers_a_retryable_error_result(
    limited_broker: BrokerProcess, idp: IdpProcess
) -> None:
    """The Python helper turns the integration API's 429 into "unavailable, try again", not a
    crash: the sibling's own secret is right, another process at its address spent the budget."""
    created = cli("service", "create", "helper-sibling", config_path=limited_broker.config_path)
    assert created.returncode == 0, created.stderr
    wrong = {"Authorization": "Bearer cbs_" + secrets.token_urlsafe(32)}
    async with local_client(base_url=limited_broker.url) as http:
        for _ in range(BURST):
            failed = await http.get("/api/v1/connections", params={}, headers=wrong)
            assert failed.status_code == 401
    with Sibling(idp, limited_broker.url, created.stdout.strip()) as sibling:
        response = await sibling.call(sibling.token("jan"), "demo_fingerprint")
    answer = result_of(response)
    assert answer["isError"] is True
    assert answer["content"][0]["text"].endswith(
        "Connect Broker is unavailable; try again shortly."
    )
    assert [a.get("type") for a in sibling.calls.answers] == [
        "urn:connect-broker:error:too_many_failed_authentications"
    ]
