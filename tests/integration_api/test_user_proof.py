"""`[services.<name>] user_proof = "token"`: the sibling proves the user with the user's own
access token, and a service secret alone reads no one's credential.

A broker of its own (the option is configuration) with two registered services: `proofed`, whose
tokens are for its sibling's /mcp URL, and `plain`, configured as before. Tokens are signed with
the node IdP's own key and verified by the broker against that IdP's JWKS. Every refusal is
asserted by its own `type` (and, at the token exchange, its RFC 6749 `error`). The example
sibling with `user_proof = "token"`, end to end with Chromium: tests/e2e/test_sibling_server.py.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs

import httpx2
import pytest
from sqlalchemy.ext.asyncio import AsyncEngine

from app.db import create_engine

from ..conftest import DEMO_PROVIDER, count_rows
from ..support.broker import BrokerProcess, LogWindow
from ..support.clients import Browser
from ..support.idp import free_port, generate_rsa_jwk, mint_token
from ..support.stack import Stack, running_stack
from .test_api import (
    Registered,
    ServiceApi,
    connected,
    fresh_user,
    input_required,
    ok,
    problem,
    register,
    require_body,
    submit_api_key,
)
from .test_helper import Sibling, result_of

pytestmark = pytest.mark.both_databases

PROOFED, PLAIN = "proofed", "plain"
KEY_A, KEY_B = "sk_CANARYKEY_proof_alice", "sk_CANARYKEY_proof_bob"
GRANT = "urn:ietf:params:oauth:grant-type:token-exchange"
ACCESS_TOKEN = "urn:ietf:params:oauth:token-type:access_token"
TOKEN_ERROR_KEYS = {"error", "error_description", "type", "instance"}


@dataclass(frozen=True)
class ProofStack:
    stack: Stack
    sibling_port: int
    proofed: Registered
    plain: Registered

    @property
    def broker(self) -> BrokerProcess:
        return self.stack.broker

    @property
    def audience(self) -> str:
        """The proofed service's token_audience: its sibling's /mcp URL (nothing listens)."""
        return f"http://127.0.0.1:{self.sibling_port}/mcp"

    def token(self, user: str, **overrides: Any) -> str:
        """The user's access token for the proofed sibling, signed by the IdP's key."""
        return self.stack.token(user, **({"audience": self.audience} | overrides))

    def user(self, subject: str) -> dict[str, str]:
        return {"issuer": self.stack.idp.issuer, "subject": subject}


@contextlib.contextmanager
def proof_stack(workdir: Path, name: str, **options: Any) -> Iterator[ProofStack]:
    sibling_port = free_port()
    audience = f"http://127.0.0.1:{sibling_port}/mcp"
    with running_stack(
        workdir,
        name,
        idp={"resources": [audience]},
        providers={
            "demo": DEMO_PROVIDER,
            "other": DEMO_PROVIDER,  # configured, but neither service may use it
        },
        services={PROOFED: {"user_proof": "token", "token_audience": audience}},
        **options,
    ) as stack:
        proofed = register(stack.broker, PROOFED, ("demo",))
        plain = register(stack.broker, PLAIN, ("demo",))
        yield ProofStack(stack, sibling_port, proofed, plain)


@pytest.fixture(scope="module")
def proof(workdir: Path) -> Iterator[ProofStack]:
    with proof_stack(workdir, "user-proof") as stack:
        yield stack


@pytest.fixture(scope="module")
async def proof_db(proof: ProofStack) -> AsyncIterator[AsyncEngine]:
    """The module broker's database, for asserting what was stored."""
    engine = create_engine(proof.broker.database_url, pool_size=2)
    yield engine
    await engine.dispose()


@pytest.fixture
async def proofed_api(proof: ProofStack) -> AsyncIterator[ServiceApi]:
    client = ServiceApi(proof.broker.url, proof.proofed)
    yield client
    await client.aclose()


@pytest.fixture
async def plain_api(proof: ProofStack) -> AsyncIterator[ServiceApi]:
    client = ServiceApi(proof.broker.url, proof.plain)
    yield client
    await client.aclose()


@pytest.fixture
async def browser(proof: ProofStack) -> AsyncIterator[Browser]:
    client = Browser(proof.broker.url)
    yield client
    await client.aclose()


def exchange_form(token: str | None, provider: str = "demo", **extra: str) -> dict[str, str]:
    form = {
        "grant_type": GRANT,
        "subject_token_type": ACCESS_TOKEN,
        "requested_token_type": f"urn:connect-broker:credential:{provider}",
        **extra,
    }
    if token is not None:
        form["subject_token"] = token
    return form


async def exchange(api: ServiceApi, form: dict[str, str]) -> httpx2.Response:
    return await api.http.post("/token", data=form)


def token_error(response: httpx2.Response, status: int, error: str, code: str) -> dict[str, Any]:
    """An RFC 6749 §5.2 refusal with the broker's problem type beside the OAuth code."""
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == "application/json"
    assert response.headers["cache-control"] == "no-store"
    body: dict[str, Any] = response.json()
    assert set(body) == TOKEN_ERROR_KEYS, body
    assert (body["error"], body["type"]) == (error, f"urn:connect-broker:error:{code}")
    assert '"' not in body["error_description"] and "\\" not in body["error_description"]
    return body


async def connect_with_token(proof: ProofStack, api: ServiceApi, subject: str, key: str) -> None:
    """The user connects the demo provider (in a browser of their own) through the proofed
    service, which sends only the user's token (require and resume take `subject_token`)."""
    token = proof.token(subject)
    body = require_body(proof.user(subject), subject_token=token)
    del body["user"]
    first, flow_id = input_required(await api.http.post("/connections/demo/require", json=body))
    browser = Browser(proof.broker.url)
    try:
        await submit_api_key(browser, subject, flow_id, key)
    finally:
        await browser.aclose()
    resumed = {
        **body,
        "request_state": first["requestState"],
        "input_response": {"action": "accept"},
    }
    assert connected(await api.http.post("/connections/demo/resume", json=resumed))["secret"] == key


# ------------------------------------------------------------------------------------------------
# The token exchange
# ------------------------------------------------------------------------------------------------


async def test_a_valid_token_is_exchanged_for_that_users_credential(
    proof: ProofStack, proofed_api: ServiceApi, proof_db: AsyncEngine
) -> None:
    """RFC 8693 §2.2.1: the credential of the user the token stands for, never stored by caches."""
    alice = fresh_user("alice")
    await connect_with_token(proof, proofed_api, alice, KEY_A)

    answer = await exchange(proofed_api, exchange_form(proof.token(alice)))

    assert answer.headers["cache-control"] == "no-store"
    assert ok(answer) == {
        "access_token": KEY_A,
        "issued_token_type": "urn:connect-broker:credential:demo",
        "token_type": "N_A",  # an API key is not an OAuth access token
    }
    owned = await count_rows(
        proof_db, "connections", subject=alice, provider="demo", audience=PROOFED
    )
    assert owned == 1


async def test_the_exchange_refuses_a_malformed_or_unknown_account(
    proof: ProofStack, proofed_api: ServiceApi
) -> None:
    """`account` (our extension) is checked at the edge; an account not connected is 404."""
    alice = fresh_user("alice-accounts")
    await connect_with_token(proof, proofed_api, alice, KEY_A)
    token = proof.token(alice)

    malformed = await exchange(proofed_api, exchange_form(token, account="bell\x07"))
    too_long = await exchange(proofed_api, exchange_form(token, account="x" * 256))
    unknown = await exchange(proofed_api, exchange_form(token, account="@nobody"))
    default = await exchange(proofed_api, exchange_form(token))

    token_error(malformed, 400, "invalid_request", "invalid_request")
    token_error(too_long, 400, "invalid_request", "invalid_request")
    token_error(unknown, 404, "invalid_target", "not_connected")
    assert ok(default)["access_token"] == KEY_A


async def test_another_users_token_reads_that_user_only_whoever_is_named(
    proof: ProofStack, proofed_api: ServiceApi
) -> None:
    """The user is taken from the token: naming Alice beside Bob's token (in the form, in the
    require body, in the query of the old route) never reads Alice's credential."""
    alice, bob = fresh_user("alice"), fresh_user("bob")
    await connect_with_token(proof, proofed_api, alice, KEY_A)
    await connect_with_token(proof, proofed_api, bob, KEY_B)
    bobs = proof.token(bob)

    named = exchange_form(bobs, subject=alice, issuer=proof.stack.idp.issuer)
    exchanged = ok(await exchange(proofed_api, named))
    body = {**require_body(proof.user(alice)), "subject_token": bobs}
    required = await proofed_api.http.post("/connections/demo/require", json=body)
    queried = await proofed_api.credential("demo", proof.user(alice))

    assert exchanged["access_token"] == KEY_B
    assert connected(required)["secret"] == KEY_B
    problem(queried, 403, "user_proof_required")
    for answer in (exchanged, required.text, queried.text):
        assert KEY_A not in str(answer)


async def test_a_secret_without_a_token_is_refused(
    proof: ProofStack, proofed_api: ServiceApi
) -> None:
    """Missing `subject_token` at the exchange is invalid_request; require without it is 403."""
    alice = fresh_user("alice")
    await connect_with_token(proof, proofed_api, alice, KEY_A)

    missing = await exchange(proofed_api, exchange_form(None))
    named = await proofed_api.require("demo", proof.user(alice))

    body = token_error(missing, 400, "invalid_request", "invalid_request")
    assert "subject_token" in body["error_description"]
    problem(named, 403, "user_proof_required")
    assert KEY_A not in missing.text + named.text


async def test_a_token_for_another_audience_is_refused(
    proof: ProofStack, proofed_api: ServiceApi
) -> None:
    """A token for the broker's own /mcp (or any resource but the sibling's) proves nothing to
    the sibling's service: RFC 8693 §2.2.2 invalid_request, type subject_token_wrong_audience."""
    alice = fresh_user("alice")
    await connect_with_token(proof, proofed_api, alice, KEY_A)

    for audience in (proof.broker.mcp_url, "https://elsewhere.example.com/mcp"):
        answer = await exchange(proofed_api, exchange_form(proof.token(alice, audience=audience)))
        token_error(answer, 400, "invalid_request", "subject_token_wrong_audience")
        assert KEY_A not in answer.text


async def test_an_expired_or_forged_token_is_refused(
    proof: ProofStack, proofed_api: ServiceApi
) -> None:
    """Expired (past the minute of leeway): subject_token_expired; signed by a key the IdP does
    not publish, of another issuer, or without a subject: subject_token_invalid; also in require."""
    alice = fresh_user("alice")
    await connect_with_token(proof, proofed_api, alice, KEY_A)
    expired = proof.token(alice, lifetime=-3600)
    forged = mint_token(
        generate_rsa_jwk(proof.stack.idp.signing_jwk["kid"]),
        issuer=proof.stack.idp.issuer,
        audience=proof.audience,
        subject=alice,
    )
    invalid = [
        forged,
        proof.token(alice, issuer="https://evil.example"),
        proof.token(alice, omit=("sub",)),
    ]

    token_error(
        await exchange(proofed_api, exchange_form(expired)),
        400,
        "invalid_request",
        "subject_token_expired",
    )
    for token in invalid:
        answer = await exchange(proofed_api, exchange_form(token))
        token_error(answer, 400, "invalid_request", "subject_token_invalid")
    body = {**require_body(proof.user(alice)), "subject_token": expired}
    problem(
        await proofed_api.http.post("/connections/demo/require", json=body),
        400,
        "subject_token_expired",
    )


async def test_malformed_exchanges_are_told_apart(
    proof: ProofStack, proofed_api: ServiceApi, plain_api: ServiceApi
) -> None:
    """Each refusal of the form, the secret and the service has its own error and type."""
    token = proof.token(fresh_user("alice"))
    cases = [
        (proofed_api, exchange_form(token, grant_type="authorization_code"), 400,
         "unsupported_grant_type", "unsupported_grant_type"),
        (proofed_api, exchange_form(token, subject_token_type="urn:x:id_token"), 400,
         "invalid_request", "unsupported_subject_token_type"),
        (proofed_api, exchange_form(token, requested_token_type="urn:x:demo"), 400,
         "invalid_request", "unsupported_requested_token_type"),
        (proofed_api, exchange_form(token, provider="nope"), 404, "invalid_request",
         "unknown_provider"),
        (proofed_api, exchange_form(token, provider="other"), 403, "unauthorized_client",
         "provider_not_allowed"),
        (proofed_api, exchange_form(token, actor_token="x"), 400, "invalid_request",
         "invalid_request"),
        (proofed_api, exchange_form(token), 404, "invalid_target", "not_connected"),
        (plain_api, exchange_form(token), 400, "unauthorized_client", "user_proof_not_enabled"),
    ]  # fmt: skip
    for api, form, status, error, code in cases:
        token_error(await exchange(api, form), status, error, code)
    as_json = await proofed_api.http.post("/token", json=exchange_form(token))
    token_error(as_json, 400, "invalid_request", "invalid_request")
    twice = await proofed_api.http.post(
        "/token",
        content=f"{httpx2.QueryParams(exchange_form(token))}&grant_type={GRANT}",
        headers={"Content-Type": "application/x-www-form-urlencoded"},
    )
    token_error(twice, 400, "invalid_request", "invalid_request")
    anonymous = await proofed_api.http.post(
        "/token", data=exchange_form(token), headers={"Authorization": "Bearer cbs_unknown"}
    )
    token_error(anonymous, 401, "invalid_client", "invalid_service_credentials")
    assert anonymous.headers["www-authenticate"] == 'Bearer realm="connect-broker"'


# ------------------------------------------------------------------------------------------------
# Listing and disconnecting: the user's token in the Subject-Token header
# ------------------------------------------------------------------------------------------------


async def listed(api: ServiceApi, token: str, **query: str) -> httpx2.Response:
    return await api.http.get("/connections", params=query, headers={"Subject-Token": token})


async def disconnected(
    api: ServiceApi, token: str, provider: str = "demo", **query: str
) -> httpx2.Response:
    return await api.http.delete(
        f"/connections/{provider}", params=query, headers={"Subject-Token": token}
    )


async def test_a_token_lists_and_disconnects_that_users_connections(
    proof: ProofStack, proofed_api: ServiceApi, proof_db: AsyncEngine
) -> None:
    """GET /connections and DELETE /connections/{provider} with the user's token in the header:
    the user's connections, then the connection deleted (a second delete finds none)."""
    alice = fresh_user("alice")
    await connect_with_token(proof, proofed_api, alice, KEY_A)
    token = proof.token(alice)

    before = ok(await listed(proofed_api, token))
    deleted = ok(await disconnected(proofed_api, token))
    after = ok(await listed(proofed_api, token))
    again = await disconnected(proofed_api, token)

    assert [(item["provider"], item["owner"]) for item in before["connections"]] == [
        ("demo", PROOFED)
    ]
    assert deleted == {
        "provider": "demo",
        "status": "disconnected",
        "revoked_upstream": False,
        "upstream_failed": False,
    }
    assert after == {"connections": []}
    problem(again, 404, "not_connected")
    assert await count_rows(proof_db, "connections", subject=alice, audience=PROOFED) == 0
    for answer in (before, deleted, after):
        assert KEY_A not in str(answer)


async def test_another_users_token_lists_and_disconnects_that_user_only_whoever_is_named(
    proof: ProofStack, proofed_api: ServiceApi, proof_db: AsyncEngine
) -> None:
    """The user is taken from the token: the query's issuer and subject are not read, so naming
    Alice beside Bob's token lists and deletes Bob's connection, never Alice's."""
    alice, bob = fresh_user("alice"), fresh_user("bob")
    await connect_with_token(proof, proofed_api, alice, KEY_A)
    await connect_with_token(proof, proofed_api, bob, KEY_B)
    bobs = proof.token(bob)
    named = proof.user(alice)

    bobs_list = ok(await listed(proofed_api, bobs, **named))
    bobs_delete = ok(await disconnected(proofed_api, bobs, **named))
    nothing_left = await disconnected(proofed_api, bobs, **named)
    alices_list = ok(await listed(proofed_api, proof.token(alice)))

    assert [item["provider"] for item in bobs_list["connections"]] == ["demo"]
    assert bobs_delete["status"] == "disconnected"
    problem(nothing_left, 404, "not_connected")
    assert [item["provider"] for item in alices_list["connections"]] == ["demo"]
    assert await count_rows(proof_db, "connections", subject=bob, audience=PROOFED) == 0
    assert await count_rows(proof_db, "connections", subject=alice, audience=PROOFED) == 1


async def test_a_bad_header_token_is_refused_by_its_type_and_changes_nothing(
    proof: ProofStack, proofed_api: ServiceApi, proof_db: AsyncEngine
) -> None:
    """Another audience, expired, or forged: the refusal the token exchange gives, as problem
    JSON, on both routes; each failure logged without the token; the connection stays."""
    alice = fresh_user("alice")
    await connect_with_token(proof, proofed_api, alice, KEY_A)
    forged = mint_token(
        generate_rsa_jwk(proof.stack.idp.signing_jwk["kid"]),
        issuer=proof.stack.idp.issuer,
        audience=proof.audience,
        subject=alice,
    )
    cases = [
        (proof.token(alice, audience=proof.broker.mcp_url), "subject_token_wrong_audience"),
        (proof.token(alice, lifetime=-3600), "subject_token_expired"),
        (forged, "subject_token_invalid"),
    ]
    window = LogWindow(proof.broker)

    for token, code in cases:
        problem(await listed(proofed_api, token), 400, code)
        problem(await disconnected(proofed_api, token), 400, code)
    await window.wait_for("service.user_proof_failed", 2 * len(cases))

    log = window.text()
    for token, code in cases:
        assert f"service.user_proof_failed service={PROOFED} reason={code}" in log
        assert token.rsplit(".", 1)[1] not in log
    assert await count_rows(proof_db, "connections", subject=alice, audience=PROOFED) == 1


async def test_the_header_is_refused_from_a_service_without_the_option(
    proof: ProofStack, plain_api: ServiceApi, browser: Browser
) -> None:
    """A service that names its users gets user_proof_not_enabled for a Subject-Token header,
    as for a `subject_token`, even beside a valid query; without the header, a query lacking
    the user is 422 as before, and the named user's connections are listed."""
    user = proof.user(fresh_user("erin"))
    first, flow_id = input_required(await plain_api.require("demo", user))
    await submit_api_key(browser, user["subject"], flow_id, KEY_A)
    assert connected(await plain_api.resume("demo", user, first["requestState"]))["secret"] == KEY_A
    token = proof.token(user["subject"])

    with_header = [
        await listed(plain_api, token, **user),
        await disconnected(plain_api, token, **user),
    ]
    without_user = await plain_api.http.get("/connections")
    named = ok(await plain_api.connections(user))

    for answer in with_header:
        problem(answer, 400, "user_proof_not_enabled")
    body = problem(without_user, 422, "invalid_request")
    assert {tuple(error["loc"]) for error in body["errors"]} == {
        ("query", "issuer"),
        ("query", "subject"),
    }
    assert [item["owner"] for item in named["connections"]] == [PLAIN]


# ------------------------------------------------------------------------------------------------
# The routes that name the user
# ------------------------------------------------------------------------------------------------


async def test_routes_naming_the_user_refuse_a_proofed_service_and_change_nothing(
    proof: ProofStack, proofed_api: ServiceApi, proof_db: AsyncEngine
) -> None:
    """GET /credentials, and GET /connections and DELETE /connections without the
    Subject-Token header: 403 user_proof_required, the connection left in place; resume without
    a token is refused as require is."""
    alice = fresh_user("alice")
    await connect_with_token(proof, proofed_api, alice, KEY_A)
    user = proof.user(alice)

    refused = [
        await proofed_api.credential("demo", user),
        await proofed_api.connections(user),
        await proofed_api.delete("demo", user),
        await proofed_api.resume("demo", user, "any-state"),
    ]

    for answer in refused:
        problem(answer, 403, "user_proof_required")
        assert KEY_A not in answer.text
    assert await count_rows(proof_db, "connections", subject=alice, audience=PROOFED) == 1


async def test_a_service_without_the_option_keeps_the_routes_naming_the_user(
    proof: ProofStack, plain_api: ServiceApi, browser: Browser
) -> None:
    """Default `user_proof = "off"`: require, resume, credentials and connections as before;
    a `subject_token` sent by such a service is refused rather than trusted."""
    user = proof.user(fresh_user("carol"))
    first, flow_id = input_required(await plain_api.require("demo", user))
    await submit_api_key(browser, user["subject"], flow_id, KEY_A)
    assert connected(await plain_api.resume("demo", user, first["requestState"]))["secret"] == KEY_A

    fetched = ok(await plain_api.credential("demo", user))
    listed = ok(await plain_api.connections(user))
    with_token = await plain_api.http.post(
        "/connections/demo/require",
        json={**require_body(user), "subject_token": proof.token(user["subject"])},
    )

    assert fetched["secret"] == KEY_A
    assert [item["owner"] for item in listed["connections"]] == [PLAIN]
    problem(with_token, 400, "user_proof_not_enabled")


# ------------------------------------------------------------------------------------------------
# Failed verifications: counted like wrong secrets, logged without the token
# ------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def strict(workdir: Path) -> Iterator[ProofStack]:
    """The same services on a broker that lets an address fail three times."""
    limits = {"failed_auths_per_minute": 1, "failed_auth_burst": 3}
    with proof_stack(workdir, "user-proof-strict", extra={"limits": limits}) as stack:
        yield stack


async def test_failed_verifications_spend_the_address_budget_and_the_log_holds_no_token(
    strict: ProofStack,
) -> None:
    """Three refused tokens spend the budget: the fourth new token is 429 without a signature
    check, while a token verified before still passes. The log names the service and each
    reason, and holds none of the tokens."""
    alice = fresh_user("alice")
    good = strict.token(alice)
    bad = [
        strict.token(alice, audience=strict.broker.mcp_url),
        strict.token(alice, lifetime=-3600),
        strict.token(alice, issuer="https://evil.example"),
    ]
    window = LogWindow(strict.broker)
    api = ServiceApi(strict.broker.url, strict.proofed)
    try:
        known = await exchange(api, exchange_form(good))  # verified: not connected
        refused = [await exchange(api, exchange_form(token)) for token in bad]
        spent = await exchange(api, exchange_form(strict.token(alice)))
        again = await exchange(api, exchange_form(good))
        await window.wait_for("auth.failed_auth_limit_reached")
        await window.wait_for("service.user_proof_failed", 3)
    finally:
        await api.aclose()

    token_error(known, 404, "invalid_target", "not_connected")
    codes = ["subject_token_wrong_audience", "subject_token_expired", "subject_token_invalid"]
    for answer, code in zip(refused, codes, strict=True):
        token_error(answer, 400, "invalid_request", code)
    token_error(spent, 429, "temporarily_unavailable", "too_many_failed_authentications")
    assert int(spent.headers["retry-after"]) >= 1
    token_error(again, 404, "invalid_target", "not_connected")
    log = window.text()
    for code in codes:
        assert f"service.user_proof_failed service={PROOFED} reason={code}" in log
    for token in [good, *bad]:
        assert token not in log
        assert token.rsplit(".", 1)[1] not in log  # not even the signature
    assert strict.broker.log().count("service.user_proof_failed") == 3


async def test_the_helpers_credential_exchanges_the_callers_token(
    proof: ProofStack, proofed_api: ServiceApi
) -> None:
    """`ConnectBroker(..., user_proof=True).credential(ctx, provider)`: the helper posts the
    caller's own token to the exchange and never names a user; the caller's key comes back, and
    a caller without a connection gets None."""
    alice, bob = fresh_user("alice"), fresh_user("bob")
    await connect_with_token(proof, proofed_api, alice, KEY_A)
    with Sibling(
        proof.stack.idp,
        proof.broker.url,
        proof.proofed.secret,
        audience=proof.audience,
        user_proof=True,
    ) as sibling:
        token = sibling.token(alice)
        held = result_of(await sibling.call(token, "demo_standing"))["structuredContent"]
        none = result_of(await sibling.call(sibling.token(bob), "demo_standing"))
        sent = sibling.calls.requests

    assert held == {"connected": True, "providers": ["demo"], "removed": None}
    assert none["structuredContent"]["connected"] is False
    exchange = sent[0]
    assert f"{exchange.method} {exchange.url.path}" == "POST /api/v1/token"
    form = parse_qs(exchange.content.decode())
    assert form["subject_token"] == [token]
    assert form["requested_token_type"] == ["urn:connect-broker:credential:demo"]
    assert sibling.calls.answers[0]["access_token"] == KEY_A
    for request in sent:
        assert "subject" not in request.url.params
        assert alice not in request.content.decode() + str(request.url)
