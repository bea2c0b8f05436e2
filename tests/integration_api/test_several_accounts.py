"""Several GitHub accounts made through a sibling service: listed one by one, fetched by name
(the default without one), deleted by name (never a guess when there are several); the same
through the Python helper's `account=` (`connect_broker_client`)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest

from ..support.broker import BrokerProcess
from ..support.clients import Browser, flow_id_from
from ..support.fake_github import FakeGitHub
from ..support.http import local_client
from ..support.idp import IdpProcess
from .test_api import (
    Registered,
    ServiceApi,
    authorize_github,
    connected,
    fresh_name,
    fresh_user,
    input_required,
    ok,
    problem,
    register,
)
from .test_helper import Sibling, fingerprint, result_of

pytestmark = pytest.mark.both_databases


@pytest.fixture(scope="module")
def service(broker: BrokerProcess) -> Registered:
    return register(broker, fresh_name("accounts"))


@pytest.fixture
async def api(broker: BrokerProcess, service: Registered) -> AsyncIterator[ServiceApi]:
    client = ServiceApi(broker.url, service)
    yield client
    await client.aclose()


@pytest.fixture(autouse=True)
def github(fake_github: FakeGitHub) -> Iterator[FakeGitHub]:
    fake_github.reset()
    yield fake_github
    fake_github.reset()


async def connect_github(
    api: ServiceApi,
    browser: Browser,
    github: FakeGitHub,
    user: dict[str, str],
    login: str,
    **body: Any,
) -> dict[str, Any]:
    """One connect round through the service, approved at the fake as `login`."""
    github.next_user = login
    first, flow_id = input_required(await api.require("github", user, **body))
    await authorize_github(browser, user["subject"], flow_id)
    return connected(await api.resume("github", user, first["requestState"], **body))


async def login_of(github: FakeGitHub, secret: str) -> str:
    """Who the access token belongs to, as the fake GitHub says."""
    async with local_client() as http:
        answer = await http.get(f"{github.url}/user", headers={"Authorization": f"Bearer {secret}"})
    login: str = answer.json()["login"]
    return login


@pytest.fixture
async def two_accounts(
    api: ServiceApi, browser: Browser, github: FakeGitHub, idp: IdpProcess
) -> tuple[dict[str, str], str, str]:
    """A fresh user with @work, then @home added by `account: "new"`: (user, work, home)."""
    user = {"issuer": idp.issuer, "subject": fresh_user("api-accounts")}
    work, home = fresh_user("work"), fresh_user("home")
    await connect_github(api, browser, github, user, work)
    added = await connect_github(api, browser, github, user, home, account="new")
    assert added["account"] == f"@{home}"
    return user, work, home


async def test_each_account_is_listed_and_fetched_by_name_the_default_without_one(
    api: ServiceApi, github: FakeGitHub, two_accounts: tuple[dict[str, str], str, str]
) -> None:
    """Our decision: without `account`, the default (the latest connected or chosen)."""
    user, work, home = two_accounts

    listed = ok(await api.connections(user))["connections"]
    default = ok(await api.http.get("/credentials/github", params=user))
    named = ok(await api.http.get("/credentials/github", params={**user, "account": f"@{work}"}))

    assert [(item["account"], item["default"]) for item in listed] == [
        (f"@{home}", True),
        (f"@{work}", False),
    ]
    assert all(item["account_id"].isdigit() for item in listed)
    assert (default["account"], await login_of(github, default["secret"])) == (f"@{home}", home)
    assert (named["account"], await login_of(github, named["secret"])) == (f"@{work}", work)


async def test_delete_with_several_accounts_needs_the_account_and_leaves_the_other(
    api: ServiceApi, two_accounts: tuple[dict[str, str], str, str]
) -> None:
    """Our decision: never delete a guessed account; 409 names the fault, nothing is deleted."""
    user, work, home = two_accounts

    unnamed = await api.http.delete("/connections/github", params=user)
    unknown = await api.http.delete(
        "/connections/github", params={**user, "account": "@nobody-here"}
    )
    deleted = ok(
        await api.http.delete("/connections/github", params={**user, "account": f"@{work}"})
    )
    left = ok(await api.connections(user))["connections"]
    fetched = ok(await api.http.get("/credentials/github", params=user))

    problem(unnamed, 409, "account_required")
    problem(unknown, 404, "not_connected")
    assert deleted["provider"] == "github"
    assert [item["account"] for item in left] == [f"@{home}"]
    assert fetched["account"] == f"@{home}"


@pytest.mark.parametrize(
    "account", ["", "x" * 256, "bell\x07"], ids=["empty", "too-long", "control-character"]
)
async def test_a_malformed_account_is_a_422_problem_on_fetch_and_delete(
    api: ServiceApi, two_accounts: tuple[dict[str, str], str, str], account: str
) -> None:
    """Checked at the edge, before any account is read: the query's fault, located."""
    user, _, _ = two_accounts

    fetch = await api.http.get("/credentials/github", params={**user, "account": account})
    delete = await api.http.delete("/connections/github", params={**user, "account": account})
    left = ok(await api.connections(user))["connections"]

    for response in (fetch, delete):
        body = problem(response, 422, "invalid_request")
        assert [error["loc"] for error in body["errors"]] == [["query", "account"]]
    assert len(left) == 2


async def test_fetching_an_account_not_connected_is_a_404_problem(
    api: ServiceApi, two_accounts: tuple[dict[str, str], str, str]
) -> None:
    user, _, _ = two_accounts

    response = await api.http.get("/credentials/github", params={**user, "account": "@nobody-here"})

    problem(response, 404, "not_connected")


@pytest.fixture
def helper_sibling(
    idp: IdpProcess, broker: BrokerProcess, service: Registered
) -> Iterator[Sibling]:
    """test_helper.py's sibling (an MCPServer using the helper) as this module's service."""
    with Sibling(idp, broker.url, service.secret) as running:
        yield running


async def holding(sibling: Sibling, token: str, **arguments: Any) -> dict[str, Any]:
    """The sibling's `github_holding` tool: what the helper read, removed or was refused."""
    held: dict[str, Any] = result_of(await sibling.call(token, "github_holding", arguments))[
        "structuredContent"
    ]
    return held


async def test_the_helpers_account_reads_and_disconnects_the_named_account_only(
    api: ServiceApi, helper_sibling: Sibling, two_accounts: tuple[dict[str, str], str, str]
) -> None:
    """`credential(ctx, provider, account=...)` reads the named account (the default without
    one); `disconnect` without `account` among several raises BrokerRefused `account_required`
    and deletes nothing; with `account=...` only that account goes."""
    user, work, home = two_accounts
    token = helper_sibling.token(user["subject"])
    works = ok(await api.http.get("/credentials/github", params={**user, "account": f"@{work}"}))
    homes = ok(await api.http.get("/credentials/github", params=user))

    named = await holding(helper_sibling, token, account=f"@{work}")
    default = await holding(helper_sibling, token)
    unnamed = await holding(helper_sibling, token, disconnect=True)
    kept = ok(await api.connections(user))["connections"]
    removed = await holding(helper_sibling, token, account=f"@{work}", disconnect=True)
    left = ok(await api.connections(user))["connections"]
    gone = await holding(helper_sibling, token, account=f"@{work}")

    assert works["secret"] != homes["secret"]
    assert named == {
        "account": f"@{work}",
        "sha256": fingerprint(works["secret"]),
        "removed": None,
        "refused": None,
    }
    assert (default["account"], default["sha256"]) == (f"@{home}", fingerprint(homes["secret"]))
    assert (unnamed["account"], unnamed["removed"]) == (f"@{home}", None)
    assert unnamed["refused"] == "account_required"
    assert [item["account"] for item in kept] == [f"@{home}", f"@{work}"]
    assert (removed["account"], removed["removed"], removed["refused"]) == (f"@{work}", True, None)
    assert [item["account"] for item in left] == [f"@{home}"]
    assert gone == {"account": None, "sha256": None, "removed": None, "refused": None}
    deletes = [r for r in helper_sibling.calls.requests if r.method == "DELETE"]
    assert [r.url.params.get("account") for r in deletes] == [None, f"@{work}"]
    assert all(r.url.params["subject"] == user["subject"] for r in deletes)


async def test_the_helpers_new_account_connects_another_account_while_one_is_held(
    api: ServiceApi,
    browser: Browser,
    github: FakeGitHub,
    idp: IdpProcess,
    helper_sibling: Sibling,
) -> None:
    """`require_credential(ctx, provider, new_account=True)` elicits although the user holds
    @work; the retry answers the account just connected, and both accounts are listed."""
    user = {"issuer": idp.issuer, "subject": fresh_user("helper-new")}
    work, home = fresh_user("work"), fresh_user("home")
    await connect_github(api, browser, github, user, work)
    token = helper_sibling.token(user["subject"])

    first = result_of(await helper_sibling.call(token, "github_add_account"), "InputRequiredResult")
    key, flow_id = flow_id_from(first)
    github.next_user = home
    await authorize_github(browser, user["subject"], flow_id)
    added = result_of(
        await helper_sibling.call(
            token,
            "github_add_account",
            input_responses={key: {"action": "accept"}},
            request_state=first["requestState"],
        )
    )["structuredContent"]
    homes = ok(await api.http.get("/credentials/github", params={**user, "account": f"@{home}"}))
    listed = ok(await api.connections(user))["connections"]

    assert (added["account"], added["sha256"]) == (f"@{home}", fingerprint(homes["secret"]))
    assert [item["account"] for item in listed] == [f"@{home}", f"@{work}"]
    sent = zip(helper_sibling.calls.paths(), helper_sibling.calls.bodies(), strict=True)
    assert [(path, body.get("account")) for path, body in sent] == [
        ("POST /api/v1/connections/github/require", "new"),
        ("POST /api/v1/connections/github/resume", None),
    ]
