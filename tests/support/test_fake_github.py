"""Proves the fake GitHub (tests/support/fake_github.py) behaves as the E/F tests assume."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any
from urllib.parse import parse_qs, urlsplit

import httpx2
import pytest

from .fake_github import METADATA_URL, FakeGitHub
from .http import local_client
from .idp import pkce_pair

CALLBACK = "http://127.0.0.1:9/oauth/github/callback"
JSON = {"Accept": "application/json"}


@pytest.fixture(scope="module")
def fake() -> Iterator[FakeGitHub]:
    with FakeGitHub(redirect_uri=CALLBACK) as server:
        yield server


@pytest.fixture
async def gh(fake: FakeGitHub) -> AsyncIterator[httpx2.AsyncClient]:
    fake.reset()
    async with local_client(base_url=fake.url, timeout=5.0) as client:
        yield client


def query_of(response: httpx2.Response) -> dict[str, str]:
    return {k: v[0] for k, v in parse_qs(urlsplit(response.headers["location"]).query).items()}


async def authorize(
    gh: httpx2.AsyncClient, fake: FakeGitHub, challenge: str, **extra: str
) -> httpx2.Response:
    params = {
        "client_id": fake.client_id, "redirect_uri": CALLBACK, "scope": "read:user repo",
        "state": "S_A", "code_challenge": challenge, "code_challenge_method": "S256", **extra,
    }  # fmt: skip
    return await gh.get("/login/oauth/authorize", params=params)


async def get_code(gh: httpx2.AsyncClient, fake: FakeGitHub) -> tuple[str, str]:
    """(code, verifier) after an auto-approved authorization."""
    verifier, challenge = pkce_pair()
    response = await authorize(gh, fake, challenge)
    return query_of(response)["code"], verifier


async def exchange(
    gh: httpx2.AsyncClient, fake: FakeGitHub, code: str, verifier: str, **kwargs: Any
) -> httpx2.Response:
    """POST the code with client credentials in the form; kwargs may override form fields."""
    form = {
        "client_id": fake.client_id, "client_secret": fake.client_secret, "code": code,
        "code_verifier": verifier, "redirect_uri": CALLBACK, **kwargs.pop("form", {}),
    }  # fmt: skip
    headers = kwargs.pop("headers", JSON)
    return await gh.post(fake.token_url, data=form, headers=headers, **kwargs)


async def new_token(gh: httpx2.AsyncClient, fake: FakeGitHub) -> dict[str, Any]:
    code, verifier = await get_code(gh, fake)
    body: dict[str, Any] = (await exchange(gh, fake, code, verifier)).json()
    return body


async def refresh(gh: httpx2.AsyncClient, fake: FakeGitHub, refresh_token: str) -> dict[str, Any]:
    form = {"grant_type": "refresh_token", "refresh_token": refresh_token}
    auth = (fake.client_id, fake.client_secret)
    response = await gh.post(fake.token_url, data=form, auth=auth, headers=JSON)
    assert response.status_code == 200
    body: dict[str, Any] = response.json()
    return body


async def user_status(gh: httpx2.AsyncClient, access_token: str) -> int:
    return (await gh.get("/user", headers={"Authorization": f"Bearer {access_token}"})).status_code


async def revoke(
    gh: httpx2.AsyncClient, fake: FakeGitHub, access_token: str, secret: str = ""
) -> httpx2.Response:
    url = f"/applications/{fake.client_id}/grant"
    auth = (fake.client_id, secret or fake.client_secret)
    return await gh.request("DELETE", url, json={"access_token": access_token}, auth=auth)


async def test_authorize_auto_approves_with_a_canary_code_and_the_state(
    gh: httpx2.AsyncClient, fake: FakeGitHub
) -> None:
    _, challenge = pkce_pair()

    response = await authorize(gh, fake, challenge, login="alice")

    assert response.status_code == 302
    assert response.headers["location"].startswith(CALLBACK + "?")
    assert query_of(response)["code"].startswith("CANARYCODE")
    assert query_of(response)["state"] == "S_A"
    assert fake.authorize_hits == 1
    assert fake.authorize_requests[0]["login"] == "alice"


async def test_authorize_refuses_an_unregistered_redirect_uri_without_redirecting(
    gh: httpx2.AsyncClient, fake: FakeGitHub
) -> None:
    _, challenge = pkce_pair()

    response = await authorize(gh, fake, challenge, redirect_uri="https://evil.example/cb")

    assert response.status_code == 400
    assert "location" not in response.headers


async def test_authorize_without_s256_redirects_with_invalid_request(
    gh: httpx2.AsyncClient, fake: FakeGitHub
) -> None:
    response = await authorize(gh, fake, "plain-challenge", code_challenge_method="plain")

    assert query_of(response)["error"] == "invalid_request"
    assert "code" not in query_of(response)


async def test_deny_next_redirects_access_denied_once(
    gh: httpx2.AsyncClient, fake: FakeGitHub
) -> None:
    fake.deny_next = True
    _, challenge = pkce_pair()

    denied = query_of(await authorize(gh, fake, challenge))
    approved = query_of(await authorize(gh, fake, challenge))

    assert denied["error"] == "access_denied"
    assert denied["error_description"]
    assert denied["state"] == "S_A"
    assert "code" not in denied
    assert "code" in approved


async def test_code_exchange_issues_a_token_for_the_approving_user(
    gh: httpx2.AsyncClient, fake: FakeGitHub
) -> None:
    fake.next_user = "alice"
    code, verifier = await get_code(gh, fake)

    body = (await exchange(gh, fake, code, verifier)).json()
    user = await gh.get("/user", headers={"Authorization": f"token {body['access_token']}"})

    assert body["access_token"].startswith("gho_CANARYTOKEN")
    assert body["token_type"] == "bearer"
    assert body["scope"] == "read:user,repo"
    assert "refresh_token" not in body
    assert user.json()["login"] == "alice"
    assert (fake.token_calls, fake.user_calls) == (1, 1)
    assert fake.seen_authorization == [f"token {body['access_token']}"]


async def test_wrong_verifier_is_an_error_in_a_200_body_and_spends_the_code(
    gh: httpx2.AsyncClient, fake: FakeGitHub
) -> None:
    code, verifier = await get_code(gh, fake)

    wrong = await exchange(gh, fake, code, verifier + "x")
    retry = await exchange(gh, fake, code, verifier)

    assert wrong.status_code == 200
    assert wrong.json()["error"] == "bad_verification_code"
    assert retry.json()["error"] == "bad_verification_code"
    assert fake.issued_access_tokens == []


async def test_code_is_single_use(gh: httpx2.AsyncClient, fake: FakeGitHub) -> None:
    code, verifier = await get_code(gh, fake)

    first = await exchange(gh, fake, code, verifier)
    second = await exchange(gh, fake, code, verifier)

    assert "access_token" in first.json()
    assert second.json()["error"] == "bad_verification_code"


async def test_client_credentials_are_checked_in_the_form_or_basic_auth(
    gh: httpx2.AsyncClient, fake: FakeGitHub
) -> None:
    code, verifier = await get_code(gh, fake)
    good_basic = (fake.client_id, fake.client_secret)

    bad = await exchange(gh, fake, code, verifier, form={"client_secret": "nope"})
    basic = await exchange(gh, fake, code, verifier, auth=good_basic)

    assert bad.status_code == 200
    assert bad.json()["error"] == "incorrect_client_credentials"
    assert "access_token" in basic.json()


async def test_without_accept_json_the_answer_is_form_encoded(
    gh: httpx2.AsyncClient, fake: FakeGitHub
) -> None:
    code, verifier = await get_code(gh, fake)

    response = await exchange(gh, fake, code, verifier + "x", headers={})

    assert response.headers["content-type"].startswith("application/x-www-form-urlencoded")
    assert parse_qs(response.text)["error"] == ["bad_verification_code"]


async def test_revocation_with_client_basic_auth_kills_the_token_and_its_refresh_token(
    gh: httpx2.AsyncClient, fake: FakeGitHub
) -> None:
    fake.expiring_tokens = True
    body = await new_token(gh, fake)

    forged = await revoke(gh, fake, body["access_token"], secret="wrong")
    status_after_forged = await user_status(gh, body["access_token"])
    response = await revoke(gh, fake, body["access_token"])

    assert (forged.status_code, status_after_forged) == (401, 200)
    assert response.status_code == 204
    assert fake.revocations == 2
    assert await user_status(gh, body["access_token"]) == 401
    assert (await refresh(gh, fake, body["refresh_token"]))["error"] == "bad_refresh_token"


async def test_refresh_rotates_both_tokens(gh: httpx2.AsyncClient, fake: FakeGitHub) -> None:
    fake.expiring_tokens = True
    first = await new_token(gh, fake)

    second = await refresh(gh, fake, first["refresh_token"])
    replay = await refresh(gh, fake, first["refresh_token"])

    assert first["refresh_token"].startswith("ghr_CANARY")
    assert (first["expires_in"], first["refresh_token_expires_in"]) == (28800, 15897600)
    assert second["refresh_token"] != first["refresh_token"]
    assert replay["error"] == "bad_refresh_token"
    assert await user_status(gh, second["access_token"]) == 200
    assert await user_status(gh, first["access_token"]) == 401
    assert fake.refresh_calls == 2


async def test_user_refuses_unknown_tokens_and_honours_the_500_switch_once(
    gh: httpx2.AsyncClient, fake: FakeGitHub
) -> None:
    token = (await new_token(gh, fake))["access_token"]
    fake.user_fault = "500"

    statuses = [await user_status(gh, token), await user_status(gh, token)]
    unknown = await gh.get("/user", headers={"Authorization": "Bearer gho_unknown"})

    assert statuses == [500, 200]
    assert unknown.status_code == 401
    assert unknown.json()["message"] == "Bad credentials"


async def test_echo_authorization_puts_the_header_in_user_and_repos(
    gh: httpx2.AsyncClient, fake: FakeGitHub
) -> None:
    token = (await new_token(gh, fake))["access_token"]
    fake.echo_authorization = True
    headers = {"Authorization": f"Bearer {token}"}

    user = (await gh.get("/user", headers=headers)).json()
    repos = (await gh.get("/user/repos", headers=headers)).json()

    assert user == {"login": "octocat", "id": 1, "name": "The Octocat"} | {
        "received_authorization": f"Bearer {token}"
    }
    assert len(repos) == 3
    assert {repo["owner"]["login"] for repo in repos} == {"octocat"}
    assert all(repo["received_authorization"] == f"Bearer {token}" for repo in repos)


SIMPLE_FAULTS: dict[str, Any] = {
    "500": lambda r: r.status_code == 500,
    "html": lambda r: r.headers["content-type"].startswith("text/html") and "<html>" in r.text,
    "truncated": lambda r: r.headers["content-type"] == "application/json" and r.text[-1] != "}",
    "missing_token": lambda r: (
        r.status_code == 200 and "token_type" in r.json() and "access_token" not in r.json()
    ),
    "mac": lambda r: r.json()["token_type"] == "mac",
    "huge": lambda r: len(r.content) > 5_000_000 and "access_token" in r.json(),
    "redirect": lambda r: r.status_code == 302 and r.headers["location"] == METADATA_URL,
}


@pytest.mark.parametrize("fault", list(SIMPLE_FAULTS))
async def test_token_fault_produces_its_documented_response_once(
    gh: httpx2.AsyncClient, fake: FakeGitHub, fault: Any
) -> None:
    fake.token_fault = fault
    code, verifier = await get_code(gh, fake)

    faulty = await exchange(gh, fake, code, verifier)
    code, verifier = await get_code(gh, fake)
    healthy = await exchange(gh, fake, code, verifier)

    assert SIMPLE_FAULTS[fault](faulty)
    if fault == "truncated":
        with pytest.raises(json.JSONDecodeError):
            faulty.json()
    assert "access_token" in healthy.json()
    assert fake.token_fault is None


async def test_sticky_faults_keep_firing(gh: httpx2.AsyncClient, fake: FakeGitHub) -> None:
    fake.sticky_faults, fake.token_fault = True, "500"

    statuses = [(await exchange(gh, fake, "c", "v")).status_code for _ in range(2)]

    assert statuses == [500, 500]
    assert fake.token_fault == "500"


async def test_refresh_invalid_waits_for_a_refresh_grant(
    gh: httpx2.AsyncClient, fake: FakeGitHub
) -> None:
    fake.expiring_tokens, fake.token_fault = True, "refresh_invalid"
    body = await new_token(gh, fake)

    refused = await refresh(gh, fake, body["refresh_token"])

    assert refused["error"] == "bad_refresh_token"
    assert fake.token_fault is None


async def test_timeout_fault_does_not_answer_quickly(
    gh: httpx2.AsyncClient, fake: FakeGitHub
) -> None:
    fake.token_fault = "timeout"

    with pytest.raises(httpx2.ReadTimeout):
        await exchange(gh, fake, "c", "v", timeout=0.3)

    assert fake.token_calls == 1


async def test_reset_releases_a_response_held_by_the_timeout_fault(
    gh: httpx2.AsyncClient, fake: FakeGitHub
) -> None:
    fake.token_fault = "timeout"
    pending = asyncio.create_task(exchange(gh, fake, "c", "v"))
    async with asyncio.timeout(2.0):
        while fake.token_calls == 0:
            await asyncio.sleep(0.01)

    fake.reset()
    response = await asyncio.wait_for(pending, timeout=2.0)

    assert response.json()["error"] == "bad_verification_code"


async def test_trickle_fault_beats_per_read_timeouts_but_not_a_total_deadline(
    gh: httpx2.AsyncClient, fake: FakeGitHub
) -> None:
    fake.token_fault = "trickle"
    received = bytearray()
    statuses: list[int] = []

    async def read_to_the_end() -> None:
        form = {"client_id": fake.client_id, "client_secret": fake.client_secret, "code": "c"}
        async with gh.stream("POST", fake.token_url, data=form, headers=JSON) as response:
            statuses.append(response.status_code)
            async for chunk in response.aiter_bytes():
                received.extend(chunk)

    with pytest.raises(TimeoutError):
        await asyncio.wait_for(read_to_the_end(), timeout=1.5)

    assert statuses == [200]
    assert 1 <= len(received) <= 3
    assert received.startswith(b"{")


def test_stop_is_quick_while_a_slow_response_is_pending() -> None:
    with FakeGitHub(redirect_uri=CALLBACK) as server:
        server.token_fault = "timeout"
        with pytest.raises(httpx2.ReadTimeout):
            httpx2.post(server.token_url, data={"code": "c"}, timeout=0.2)
        started = time.monotonic()

    assert time.monotonic() - started < 2.0


async def test_reset_forgets_counters_faults_and_tokens(
    gh: httpx2.AsyncClient, fake: FakeGitHub
) -> None:
    token = (await new_token(gh, fake))["access_token"]
    switches = {"token_fault": "500", "echo_authorization": True, "next_user": "bob"}
    for name, value in switches.items():
        setattr(fake, name, value)

    fake.reset()

    assert (fake.token_calls, fake.authorize_hits, fake.seen_authorization) == (0, 0, [])
    assert (fake.token_fault, fake.echo_authorization, fake.next_user) == (None, False, "octocat")
    assert await user_status(gh, token) == 401
