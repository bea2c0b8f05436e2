"""Several GitHub accounts of one user over HTTP: added by another upstream account, replaced by
the same one; a tool asks which one with a form-mode elicitation and keeps the answer per MCP
client; a client without form mode gets the default account; one account is disconnected."""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from typing import Any

import pytest
from sqlalchemy import func, select, update
from sqlalchemy.ext.asyncio import AsyncEngine

from app.mcp.protocol import INVALID_PARAMS
from app.models import Connection

from ..support.clients import Browser, McpHttp
from ..support.fake_github import FakeGitHub
from ..support.schema import validate_response
from .flows import connect

pytestmark = pytest.mark.both_databases

CHOICE_KEY = "choose_github_account"
URL_ONLY: dict[str, Any] = {"elicitation": {"url": {}}}
FORM_ONLY: dict[str, Any] = {"elicitation": {}}  # an empty object means form mode only
YES = {"confirm": True}


def fresh(label: str) -> str:
    return f"{label}-{secrets.token_hex(4)}"


@pytest.fixture(autouse=True)
def github(fake_github: FakeGitHub) -> Iterator[FakeGitHub]:
    fake_github.reset()
    yield fake_github
    fake_github.reset()


async def connect_as(
    mcp: McpHttp,
    browser: Browser,
    github: FakeGitHub,
    token: str,
    user: str,
    login: str,
    *,
    new: bool = True,
) -> None:
    """Connect the GitHub account `login` for `user` (`new`: as another account)."""
    github.next_user = login
    arguments = {"provider": "github", **({"account": "new"} if new else {})}
    await connect(mcp, browser, token, user, arguments)


async def two_accounts(
    mcp: McpHttp, browser: Browser, github: FakeGitHub, token_for: Any, label: str
) -> tuple[str, str, str, str]:
    """A fresh user holding @work then @home (the default, connected last): (user, token, work,
    home) with the logins."""
    user, work, home = fresh(label), fresh("work"), fresh("home")
    token = token_for(user)
    await connect_as(mcp, browser, github, token, user, work, new=False)
    await connect_as(mcp, browser, github, token, user, home)
    return user, token, work, home


def complete(response: Any) -> dict[str, Any]:
    body = response.json()
    validate_response(body, "CallToolResult")
    result: dict[str, Any] = body["result"]
    assert result["resultType"] == "complete", result
    return result


def choice_asked(response: Any) -> tuple[list[str], str]:
    """(the accounts offered, the requestState) of the form-mode account choice."""
    assert response.status_code == 200, response.text
    body = response.json()
    validate_response(body, "InputRequiredResult")
    ((key, request),) = body["result"]["inputRequests"].items()
    assert key == CHOICE_KEY
    params = request["params"]
    assert params["mode"] == "form"
    assert params["requestedSchema"]["required"] == ["account"]
    offered: list[str] = params["requestedSchema"]["properties"]["account"]["enum"]
    return offered, body["result"]["requestState"]


def rpc_error(response: Any) -> dict[str, Any]:
    body = response.json()
    validate_response(body)
    assert "error" in body, body
    error: dict[str, Any] = body["error"]
    return error


async def rows_of(db: AsyncEngine, user: str) -> int:
    statement = select(func.count()).select_from(Connection).where(Connection.subject == user)
    async with db.connect() as connection:
        return int((await connection.execute(statement)).scalar_one())


async def test_another_github_account_is_added_and_the_same_one_again_replaces_it(
    mcp: McpHttp, browser: Browser, github: FakeGitHub, token_for: Any, db: AsyncEngine
) -> None:
    """Our decision: the upstream account id (GitHub's user id) tells a new account from the
    same one connected again."""
    user, token, work, home = await two_accounts(mcp, browser, github, token_for, "accounts-add")

    listed = complete(await mcp.call_tool(token, "list_connections"))["structuredContent"]
    await connect_as(mcp, browser, github, token, user, work)
    relisted = complete(await mcp.call_tool(token, "list_connections"))["structuredContent"]

    accounts = [(item["account"], item["default"]) for item in listed["connections"]]
    assert accounts == [(f"@{home}", True), (f"@{work}", False)]
    assert all(item["account_id"].isdigit() for item in listed["connections"])
    reordered = [(item["account"], item["default"]) for item in relisted["connections"]]
    assert reordered == [(f"@{work}", True), (f"@{home}", False)]
    assert await rows_of(db, user) == 2


@pytest.mark.parametrize("pick", [0, 1])
async def test_a_tool_asks_which_account_in_form_mode_and_keeps_the_answer(
    mcp: McpHttp, browser: Browser, github: FakeGitHub, token_for: Any, pick: int
) -> None:
    """MCP 2026-07-28 §5: names of accounts are not secret, so form mode asks; the answer is kept
    for this client (the token's client id), so the next call asks nothing."""
    user, token, work, home = await two_accounts(
        mcp, browser, github, token_for, f"accounts-pick{pick}"
    )

    offered, state = choice_asked(await mcp.call_tool(token, "github_whoami"))
    chosen = offered[pick]
    answered = complete(
        await mcp.call_tool(
            token,
            "github_whoami",
            input_responses={CHOICE_KEY: {"action": "accept", "content": {"account": chosen}}},
            request_state=state,
        )
    )
    again = complete(await mcp.call_tool(token, "github_whoami"))
    other_client = await mcp.call_tool(token_for(user, client_id="other-client"), "github_whoami")

    assert offered == [f"@{home}", f"@{work}"]  # the default (latest connected) first
    assert answered["structuredContent"]["login"] == chosen[1:]  # the fake echoes its user
    assert again["structuredContent"]["login"] == chosen[1:]
    # another client chooses for itself; the account chosen last is now the default, offered first
    assert choice_asked(other_client)[0] == [chosen, *(name for name in offered if name != chosen)]


async def test_a_client_without_form_mode_gets_the_default_account_never_an_error(
    mcp: McpHttp, browser: Browser, github: FakeGitHub, token_for: Any
) -> None:
    """MCP 2026-07-28 §4.3 rule 7: no form mode declared, no form asked; the account used is the
    latest connected or chosen."""
    _, token, work, home = await two_accounts(mcp, browser, github, token_for, "accounts-noform")

    first = complete(await mcp.call_tool(token, "github_whoami", capabilities=URL_ONLY))
    named = complete(
        await mcp.call_tool(
            token,
            "connect_account",
            {"provider": "github", "account": f"@{work}"},
            capabilities=URL_ONLY,
        )
    )
    after = complete(await mcp.call_tool(token, "github_whoami", capabilities={}))

    assert first["structuredContent"]["login"] == home
    assert named["structuredContent"] == {
        "provider": "github",
        "status": "connected",
        "account": f"@{work}",
    }
    assert after["structuredContent"]["login"] == work


@pytest.mark.parametrize("capabilities", [URL_ONLY, {}], ids=["url-only", "none"])
async def test_a_retry_of_the_choice_without_form_mode_gets_the_default_account(
    mcp: McpHttp, browser: Browser, github: FakeGitHub, token_for: Any, capabilities: Any
) -> None:
    """Rule 7 holds on the retry too: a client that no longer declares form mode is not asked
    again (nor any other question) but served with the default account."""
    _, token, _, home = await two_accounts(mcp, browser, github, token_for, "accounts-reform")
    _, state = choice_asked(await mcp.call_tool(token, "github_whoami"))

    retried = await mcp.call_tool(
        token, "github_whoami", capabilities=capabilities, request_state=state
    )

    assert complete(retried)["structuredContent"]["login"] == home


async def test_a_named_account_refused_for_want_of_a_capability_is_not_remembered(
    mcp: McpHttp, browser: Browser, github: FakeGitHub, token_for: Any
) -> None:
    """A call naming an account whose grant falls short, from a client that cannot be sent to
    the provider, is refused (-32021) and changes nothing: the next call still asks which
    account, as before it."""
    _, token, work, home = await two_accounts(mcp, browser, github, token_for, "accounts-named")

    refused = await mcp.call_tool(
        token,
        "connect_account",
        {"provider": "github", "account": f"@{work}", "scopes": ["admin:org"]},
        capabilities={},
    )

    assert refused.status_code == 400, refused.text
    assert rpc_error(refused)["code"] == -32021
    offered, _ = choice_asked(await mcp.call_tool(token, "github_whoami"))
    assert offered == [f"@{home}", f"@{work}"]


async def test_disconnecting_one_account_leaves_the_other(
    mcp: McpHttp, browser: Browser, github: FakeGitHub, token_for: Any, db: AsyncEngine
) -> None:
    """Our decision: with several accounts, disconnect_account must be told which; never a guess."""
    user, token, work, home = await two_accounts(mcp, browser, github, token_for, "accounts-drop")
    _, state = choice_asked(await mcp.call_tool(token, "github_whoami"))
    complete(
        await mcp.call_tool(
            token,
            "github_whoami",
            input_responses={CHOICE_KEY: {"action": "accept", "content": {"account": f"@{work}"}}},
            request_state=state,
        )
    )

    unnamed = complete(await mcp.call_tool(token, "disconnect_account", {"provider": "github"}))
    arguments = {"provider": "github", "account": f"@{work}"}
    confirm = (await mcp.call_tool(token, "disconnect_account", arguments)).json()["result"]
    done = complete(
        await mcp.call_tool(
            token,
            "disconnect_account",
            arguments,
            input_responses={
                "confirm_disconnect": {"action": "accept", "content": {"confirm": True}}
            },
            request_state=confirm["requestState"],
        )
    )
    listed = complete(await mcp.call_tool(token, "list_connections"))["structuredContent"]
    whoami = complete(await mcp.call_tool(token, "github_whoami"))

    assert unnamed["isError"] is True
    assert unnamed["structuredContent"]["status"] == "choose_account"
    assert sorted(unnamed["structuredContent"]["accounts"]) == sorted([f"@{work}", f"@{home}"])
    assert f"@{work}" in confirm["inputRequests"]["confirm_disconnect"]["params"]["message"]
    assert done["structuredContent"]["status"] == "disconnected"
    assert [item["account"] for item in listed["connections"]] == [f"@{home}"]
    assert whoami["structuredContent"]["login"] == home  # one account left: nothing to ask
    assert await rows_of(db, user) == 1


@pytest.mark.parametrize(
    "account",
    ["", "x" * 256, "bell\x07", "@nobody-connected-this"],
    ids=["empty", "too-long", "control-character", "unknown"],
)
async def test_a_bad_account_argument_is_refused_with_invalid_params(
    mcp: McpHttp, browser: Browser, github: FakeGitHub, token_for: Any, account: str
) -> None:
    """Every value from outside is checked at the edge: -32602, nothing chosen or deleted."""
    user, work = fresh("accounts-bad"), fresh("work")
    token = token_for(user)
    await connect_as(mcp, browser, github, token, user, work, new=False)
    arguments = {"provider": "github", "account": account}

    connecting = rpc_error(await mcp.call_tool(token, "connect_account", arguments))
    disconnecting = rpc_error(await mcp.call_tool(token, "disconnect_account", arguments))

    assert connecting["code"] == INVALID_PARAMS
    assert disconnecting["code"] == INVALID_PARAMS
    still = complete(await mcp.call_tool(token, "list_connections"))["structuredContent"]
    assert [item["account"] for item in still["connections"]] == [f"@{work}"]


@pytest.mark.parametrize(
    "answer",
    [
        {"action": "accept", "content": {"account": "@someone-else"}},
        {"action": "accept", "content": {"account": 7}},
        {"action": "accept", "content": "@work"},
        {"action": "maybe"},
    ],
    ids=["not-offered", "not-a-string", "content-not-an-object", "bad-action"],
)
async def test_a_form_answer_that_is_not_an_offered_account_is_refused(
    mcp: McpHttp, browser: Browser, github: FakeGitHub, token_for: Any, answer: dict[str, Any]
) -> None:
    """The form answer must be one of the labels offered (they travel sealed in requestState)."""
    _, token, _, _ = await two_accounts(mcp, browser, github, token_for, "accounts-answer")
    _, state = choice_asked(await mcp.call_tool(token, "github_whoami"))

    refused = rpc_error(
        await mcp.call_tool(
            token,
            "github_whoami",
            input_responses={CHOICE_KEY: answer},
            request_state=state,
        )
    )
    asked_again = await mcp.call_tool(token, "github_whoami")

    assert refused["code"] == INVALID_PARAMS
    choice_asked(asked_again)  # nothing was remembered


async def test_declining_the_choice_ends_the_call_and_a_form_only_client_is_asked(
    mcp: McpHttp, browser: Browser, github: FakeGitHub, token_for: Any
) -> None:
    """An empty `elicitation` capability means form mode: it is asked; its decline is final."""
    _, token, _, _ = await two_accounts(mcp, browser, github, token_for, "accounts-decline")

    offered, state = choice_asked(
        await mcp.call_tool(token, "github_whoami", capabilities=FORM_ONLY)
    )
    declined = complete(
        await mcp.call_tool(
            token,
            "github_whoami",
            input_responses={CHOICE_KEY: {"action": "decline"}},
            request_state=state,
            capabilities=FORM_ONLY,
        )
    )

    assert len(offered) == 2
    assert declined["isError"] is True
    assert declined["structuredContent"]["status"] == "declined"


async def test_a_connection_of_old_is_taken_over_by_a_grant_with_its_label(
    mcp: McpHttp, browser: Browser, github: FakeGitHub, token_for: Any, db: AsyncEngine
) -> None:
    """Migration 0009 leaves connections made before it with no account id: the next grant of
    the account with the same label replaces it instead of adding a second connection."""
    user, work, home = fresh("accounts-old"), fresh("work"), fresh("home")
    token = token_for(user)
    await connect_as(mcp, browser, github, token, user, work, new=False)
    async with db.begin() as connection:  # as 0009 left a connection made before it
        await connection.execute(
            update(Connection).where(Connection.subject == user).values(account_id="")
        )

    await connect_as(mcp, browser, github, token, user, work)
    after_same = await account_ids(db, user)
    await connect_as(mcp, browser, github, token, user, home)
    after_other = await account_ids(db, user)

    assert len(after_same) == 1 and after_same[0].isdigit()
    assert len(after_other) == 2 and "" not in after_other


async def account_ids(db: AsyncEngine, user: str) -> list[str]:
    statement = select(Connection.account_id).where(Connection.subject == user)
    async with db.connect() as connection:
        return list((await connection.execute(statement)).scalars())


async def test_the_connections_page_lists_each_account_and_disconnects_the_one_pressed(
    mcp: McpHttp, browser: Browser, github: FakeGitHub, token_for: Any, db: AsyncEngine
) -> None:
    """DESIGN §4: each account has its own row and button; a form naming no account among
    several (an old page) deletes nothing."""
    user, _, work, home = await two_accounts(mcp, browser, github, token_for, "accounts-page")

    page = await browser.get("/connections")
    csrf = await browser.csrf_token("/connections")
    unnamed = await browser.post("/connections/github/disconnect", data={"csrf": csrf})
    pressed = await browser.post(
        "/connections/github/disconnect", data={"csrf": csrf, "account": f"@{work}"}
    )
    after = await browser.get("/connections")

    assert f"<td>@{work}</td>" in page.text and f"<td>@{home}</td>" in page.text
    assert f'name="account" value="@{work}"' in page.text
    assert unnamed.status_code == 400
    assert "Several accounts" in unnamed.text
    assert pressed.status_code == 303
    assert f"<td>@{work}</td>" not in after.text and f"<td>@{home}</td>" in after.text
    assert len(await account_ids(db, user)) == 1
