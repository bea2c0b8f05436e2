"""Proves the test IdP harness (tests/idp/server.mjs + tests/support/idp.py) works."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlencode, urlsplit

import pytest
from joserfc import jwt
from joserfc.jwk import KeySet

from .http import local_client
from .idp import (
    ALL_LISTEN_PORTS,
    IdpConfig,
    IdpError,
    IdpProcess,
    client_metadata,
    discover,
    free_port,
    idp_login,
    listen_ports,
    mint_token,
    obtain_access_token,
    obtain_tokens,
    pkce_pair,
    start_idp,
    unverified_jwt,
)

RESOURCE = "http://127.0.0.1:8123/mcp"
OTHER_RESOURCE = "http://127.0.0.1:8124/mcp"
REDIRECT_URI = "http://127.0.0.1:8123/login/callback"
MCP_REDIRECT_URI = "http://127.0.0.1:8765/callback"


def _clients() -> list[dict[str, Any]]:
    return [
        client_metadata("broker-login", [REDIRECT_URI], client_secret="s3cret"),
        client_metadata(
            "broker-post",
            [REDIRECT_URI],
            client_secret="s3cret-post",
            token_endpoint_auth_method="client_secret_post",
        ),
        client_metadata("mcp-public", [MCP_REDIRECT_URI]),
    ]


@pytest.fixture(scope="module")
def idp(tmp_path_factory: pytest.TempPathFactory) -> Iterator[IdpProcess]:
    config = IdpConfig(
        port=free_port(),
        resources=[RESOURCE, OTHER_RESOURCE],
        clients=_clients(),
        cookie_prefix="idpA",
        extra_claims={"alice": {"oid": "oid-alice", "tid": "tenant-1"}},
    )
    with start_idp(config, tmp_path_factory.mktemp("idp")) as proc:
        yield proc


@pytest.fixture(scope="module")
def pairwise_idp(tmp_path_factory: pytest.TempPathFactory) -> Iterator[IdpProcess]:
    config = IdpConfig(
        resources=[RESOURCE],
        clients=_clients(),
        cookie_prefix="idpP",
        extra_claims={"alice": {"oid": "oid-alice"}},
        pairwise_access_sub=True,
    )
    with start_idp(config, tmp_path_factory.mktemp("idp-pairwise")) as proc:
        yield proc


async def _jwks(issuer: str) -> KeySet:
    async with local_client() as client:
        resp = await client.get(f"{issuer}/jwks")
        resp.raise_for_status()
        return KeySet.import_key_set(resp.json())


async def _verify(issuer: str, token: str) -> tuple[dict[str, Any], dict[str, Any]]:
    keys = await _jwks(issuer)
    decoded = jwt.decode(token, keys, algorithms=["RS256"])
    return dict(decoded.header), dict(decoded.claims)


@pytest.mark.asyncio
async def test_discovery(idp: IdpProcess) -> None:
    doc = await discover(idp.issuer)
    assert doc["issuer"] == idp.issuer
    assert doc["jwks_uri"] == idp.jwks_uri
    assert doc["code_challenge_methods_supported"] == ["S256"]
    assert "mcp:tools" in doc["scopes_supported"]
    assert "oid" in doc["claims_supported"]
    keys = (await _jwks(idp.issuer)).keys
    assert [k.kid for k in keys] == [idp.signing_jwk["kid"]]
    assert all(not k.is_private for k in keys)


@pytest.mark.asyncio
async def test_obtain_access_token_confidential_basic(idp: IdpProcess) -> None:
    token = await obtain_access_token(
        idp.issuer,
        user="alice",
        client_id="broker-login",
        client_secret="s3cret",
        redirect_uri=REDIRECT_URI,
        resource=RESOURCE,
    )
    header, claims = await _verify(idp.issuer, token)
    assert header["typ"] == "at+jwt"
    assert header["alg"] == "RS256"
    assert header["kid"] == idp.signing_jwk["kid"]
    assert claims["iss"] == idp.issuer
    assert claims["aud"] == RESOURCE
    assert claims["sub"] == "alice"
    assert claims["client_id"] == "broker-login"
    assert "mcp:tools" in claims["scope"].split()
    assert claims["oid"] == "oid-alice"
    assert claims["tid"] == "tenant-1"
    now = time.time()
    assert claims["iat"] <= now + 5
    assert 590 <= claims["exp"] - claims["iat"] <= 600
    assert claims["jti"]


@pytest.mark.asyncio
async def test_obtain_access_token_post_and_public_clients(idp: IdpProcess) -> None:
    post = await obtain_access_token(
        idp.issuer,
        user="bob",
        client_id="broker-post",
        client_secret="s3cret-post",
        redirect_uri=REDIRECT_URI,
        resource=OTHER_RESOURCE,
        token_auth="client_secret_post",
    )
    _, claims = await _verify(idp.issuer, post)
    assert (claims["aud"], claims["sub"], claims["client_id"]) == (
        OTHER_RESOURCE,
        "bob",
        "broker-post",
    )
    assert "oid" not in claims

    public = await obtain_access_token(
        idp.issuer,
        user="carol",
        client_id="mcp-public",
        client_secret=None,
        redirect_uri=MCP_REDIRECT_URI,
        resource=RESOURCE,
        scope="mcp:tools",
    )
    _, claims = await _verify(idp.issuer, public)
    assert (claims["aud"], claims["sub"], claims["client_id"]) == (RESOURCE, "carol", "mcp-public")
    assert claims["scope"] == "mcp:tools"


@pytest.mark.asyncio
async def test_login_without_resource_gets_id_token_and_opaque_access_token(
    idp: IdpProcess,
) -> None:
    tokens = await obtain_tokens(
        idp.issuer,
        user="alice",
        client_id="broker-login",
        client_secret="s3cret",
        redirect_uri=REDIRECT_URI,
        resource=None,
        scope="openid profile",
    )
    assert tokens["access_token"].count(".") == 0  # opaque
    assert "refresh_token" in tokens
    _, id_claims = await _verify(idp.issuer, tokens["id_token"])
    assert id_claims["sub"] == "alice"
    assert id_claims["aud"] == "broker-login"
    assert id_claims["name"] == "alice"
    assert id_claims["oid"] == "oid-alice"
    assert id_claims["nonce"]
    async with local_client() as client:
        userinfo = await client.get(
            f"{idp.issuer}/me", headers={"Authorization": f"Bearer {tokens['access_token']}"}
        )
    assert userinfo.status_code == 200
    assert userinfo.json()["sub"] == "alice"


@pytest.mark.asyncio
async def test_refresh_token_yields_new_resource_jwt(idp: IdpProcess) -> None:
    tokens = await obtain_tokens(
        idp.issuer,
        user="alice",
        client_id="broker-login",
        client_secret="s3cret",
        redirect_uri=REDIRECT_URI,
        resource=RESOURCE,
    )
    async with local_client() as client:
        resp = await client.post(
            f"{idp.issuer}/token",
            data={
                "grant_type": "refresh_token",
                "refresh_token": tokens["refresh_token"],
                "resource": RESOURCE,
            },
            auth=("broker-login", "s3cret"),
        )
    assert resp.status_code == 200, resp.text
    refreshed = resp.json()["access_token"]
    assert refreshed != tokens["access_token"]
    _, claims = await _verify(idp.issuer, refreshed)
    assert (claims["aud"], claims["sub"], claims["oid"]) == (RESOURCE, "alice", "oid-alice")


@pytest.mark.asyncio
async def test_prompt_login_replaces_session_user(idp: IdpProcess) -> None:
    common: dict[str, Any] = {
        "client_id": "broker-login",
        "client_secret": "s3cret",
        "redirect_uri": REDIRECT_URI,
        "resource": None,
        "scope": "openid",
    }
    async with local_client() as browser:
        first = await obtain_tokens(idp.issuer, user="erin", http=browser, **common)
        second = await obtain_tokens(
            idp.issuer, user="frank", http=browser, extra_params={"prompt": "login"}, **common
        )
    assert unverified_jwt(first["id_token"])[1]["sub"] == "erin"
    assert unverified_jwt(second["id_token"])[1]["sub"] == "frank"


@pytest.mark.asyncio
async def test_unknown_resource_is_refused(idp: IdpProcess) -> None:
    with pytest.raises(IdpError, match="invalid_target"):
        await obtain_access_token(
            idp.issuer,
            user="alice",
            client_id="broker-login",
            client_secret="s3cret",
            redirect_uri=REDIRECT_URI,
            resource="http://127.0.0.1:9999/elsewhere",
        )


@pytest.mark.asyncio
async def test_public_client_requires_pkce(idp: IdpProcess) -> None:
    params = {
        "response_type": "code",
        "client_id": "mcp-public",
        "redirect_uri": MCP_REDIRECT_URI,
        "scope": "mcp:tools",
        "resource": RESOURCE,
        "state": "s",
    }
    async with local_client() as client:
        resp = await client.get(f"{idp.issuer}/auth?{urlencode(params)}")
    assert resp.is_redirect
    query = parse_qs(urlsplit(resp.headers["location"]).query)
    assert query["error"] == ["invalid_request"]


@pytest.mark.asyncio
async def test_idp_login_returns_redirect_to_relying_party(idp: IdpProcess) -> None:
    _, challenge = pkce_pair()
    params = {
        "response_type": "code",
        "client_id": "broker-login",
        "redirect_uri": REDIRECT_URI,
        "scope": "openid",
        "state": "st4te",
        "code_challenge": challenge,
        "code_challenge_method": "S256",
    }
    async with local_client() as client:
        client.cookies.set("rp_session", "keep-me", domain="127.0.0.1")
        resp = await idp_login(client, f"{idp.issuer}/auth?{urlencode(params)}", user="dave")
        assert resp.is_redirect
        location = resp.headers["location"]
        assert location.startswith(REDIRECT_URI + "?")
        query = parse_qs(urlsplit(location).query)
        assert query["state"] == ["st4te"]
        assert query["code"][0]
        assert query["iss"] == [idp.issuer]
        assert client.cookies.get("rp_session") == "keep-me"
        assert any(name.startswith("idpA_session") for name in client.cookies)


@pytest.mark.asyncio
async def test_pairwise_access_sub(pairwise_idp: IdpProcess) -> None:
    tokens = await obtain_tokens(
        pairwise_idp.issuer,
        user="alice",
        client_id="broker-login",
        client_secret="s3cret",
        redirect_uri=REDIRECT_URI,
        resource=RESOURCE,
    )
    _, at = await _verify(pairwise_idp.issuer, tokens["access_token"])
    _, it = await _verify(pairwise_idp.issuer, tokens["id_token"])
    assert it["sub"] == "alice"
    assert at["sub"] == "at-alice"
    assert at["sub"] != it["sub"]
    assert at["oid"] == it["oid"] == "oid-alice"
    assert at["aud"] == RESOURCE


@pytest.mark.asyncio
async def test_two_instances_with_distinct_cookie_prefixes(
    idp: IdpProcess, pairwise_idp: IdpProcess
) -> None:
    assert idp.port != pairwise_idp.port
    async with local_client() as browser:
        common: dict[str, Any] = {
            "client_id": "broker-login",
            "client_secret": "s3cret",
            "redirect_uri": REDIRECT_URI,
            "resource": RESOURCE,
            "http": browser,
        }
        a1 = await obtain_tokens(idp.issuer, user="alice", **common)
        b1 = await obtain_tokens(pairwise_idp.issuer, user="bob", **common)
        # Both sessions survive in one cookie jar: neither IdP shows its login form again, so
        # the user name passed now is ignored and the original session's subject comes back.
        a2 = await obtain_tokens(idp.issuer, user="mallory", **common)
        b2 = await obtain_tokens(pairwise_idp.issuer, user="mallory", **common)
    subs = [unverified_jwt(t["id_token"])[1]["sub"] for t in (a1, b1, a2, b2)]
    assert subs == ["alice", "bob", "alice", "bob"]
    names = set(browser.cookies.keys())
    assert {"idpA_session", "idpP_session"} <= names


@pytest.mark.asyncio
async def test_mint_token_verifies_with_idp_keys(idp: IdpProcess) -> None:
    token = mint_token(
        idp.signing_jwk, issuer=idp.issuer, audience=RESOURCE, subject="alice", extra={"x": 1}
    )
    header, claims = await _verify(idp.issuer, token)
    assert header == {"alg": "RS256", "typ": "at+jwt", "kid": idp.signing_jwk["kid"]}
    assert claims["iss"] == idp.issuer
    assert claims["aud"] == RESOURCE
    assert claims["sub"] == "alice"
    assert claims["client_id"] == "mcp-client"
    assert claims["scope"] == "mcp:tools"
    assert claims["x"] == 1
    assert claims["exp"] - claims["iat"] == 300
    assert {"nbf", "jti"} <= claims.keys()


def test_mint_token_edge_cases(tmp_path: Path) -> None:
    config = IdpConfig()
    jwk = config.signing_jwk
    token = mint_token(
        jwk,
        issuer="http://x",
        audience=["a", "b"],
        subject=None,
        omit=("exp", "nbf"),
        header={"typ": "JWT", "kid": "other"},
        lifetime=-10,
    )
    header, claims = unverified_jwt(token)
    assert header == {"alg": "RS256", "typ": "JWT", "kid": "other"}
    assert not {"sub", "exp", "nbf"} & claims.keys()
    assert claims["aud"] == ["a", "b"]

    no_kid = mint_token(jwk, issuer="i", audience="a", subject="s", header={"kid": None})
    assert "kid" not in unverified_jwt(no_kid)[0]

    unsigned = mint_token(jwk, issuer="i", audience="a", subject="s", header={"alg": "none"})
    assert unsigned.endswith(".")
    assert unverified_jwt(unsigned)[0]["alg"] == "none"

    expired = mint_token(jwk, issuer="i", audience="a", subject="s", lifetime=-60)
    claims = unverified_jwt(expired)[1]
    assert claims["exp"] < claims["iat"]


def test_start_failure_reports_output(tmp_path: Path) -> None:
    config = IdpConfig(jwks={"keys": [{"kty": "RSA", "kid": "broken"}]})
    with pytest.raises(IdpError, match="exited with code") as excinfo:
        start_idp(config, tmp_path)
    assert "output from" in str(excinfo.value)


@pytest.mark.asyncio
async def test_explicit_prompt_consent_is_answered(idp: IdpProcess) -> None:
    tokens = await obtain_tokens(
        idp.issuer,
        user="gina",
        client_id="broker-login",
        client_secret="s3cret",
        redirect_uri=REDIRECT_URI,
        resource=RESOURCE,
        scope="openid offline_access mcp:tools",
        extra_params={"prompt": "consent"},
    )
    # The token response's scope is the resource token's scope (no OIDC-only scopes).
    assert tokens["scope"] == "openid mcp:tools"
    assert "refresh_token" in tokens
    assert unverified_jwt(tokens["access_token"])[1]["sub"] == "gina"


def test_the_four_test_processes_draw_listening_ports_from_disjoint_slices() -> None:
    slices = [
        set(listen_ports({"PYTEST_XDIST_WORKER": worker, "BROKER_TEST_DB": database}))
        for worker in ("gw0", "gw1")
        for database in ("sqlite", "postgresql")
    ]

    assert all(len(ports) > 1000 for ports in slices)
    assert sum(map(len, slices)) == len(set().union(*slices))  # no port in two slices
    assert set().union(*slices) <= set(ALL_LISTEN_PORTS)
    assert listen_ports({}) == ALL_LISTEN_PORTS  # one process alone draws from all of them
