"""The broker's own tools: list_connections, list_providers, and disconnect_account with its
form-mode confirmation (DESIGN.md §4: a non-secret yes/no question, never a URL)."""

from __future__ import annotations

import secrets
from datetime import datetime
from typing import Any

import httpx2
import pytest
from sqlalchemy.ext.asyncio import AsyncEngine

from ..conftest import count_rows
from ..support.clients import Browser, McpHttp, flow_id_from
from ..support.schema import validate, validate_response

pytestmark = pytest.mark.both_databases

API_KEY = "sk_CANARYKEY_broker_tools_1"
DEMO = {"provider": "demo"}
CONFIRM_KEY = "confirm_disconnect"
FORM_ONLY: dict[str, Any] = {"elicitation": {"form": {}}}


def fresh_user(label: str) -> str:
    """A subject of its own, so row counts see only this test (the session DB is shared)."""
    return f"{label}-{secrets.token_hex(4)}"


def complete(response: httpx2.Response) -> dict[str, Any]:
    assert response.status_code == 200, response.text
    body = response.json()
    validate_response(body, "CallToolResult")
    result: dict[str, Any] = body["result"]
    assert result["resultType"] == "complete"
    return result


def input_required(response: httpx2.Response) -> dict[str, Any]:
    assert response.status_code == 200, response.text
    body = response.json()
    validate_response(body, "InputRequiredResult")
    result: dict[str, Any] = body["result"]
    return result


async def connect_demo(mcp: McpHttp, browser: Browser, token: str, user: str) -> None:
    """The whole URL-mode round: elicitation, login, API-key form, retry."""
    first = input_required(await mcp.call_tool(token, "connect_account", DEMO))
    key, flow_id = flow_id_from(first)
    await browser.login_as(user, next_path=f"/connect/{flow_id}")
    csrf = await browser.csrf_token(f"/connect/{flow_id}")
    submitted = await browser.post(
        f"/connect/{flow_id}/api-key", data={"csrf": csrf, "api_key": API_KEY}
    )
    assert submitted.status_code == 303, submitted.text
    done = await mcp.call_tool(
        token,
        "connect_account",
        DEMO,
        input_responses={key: {"action": "accept"}},
        request_state=first["requestState"],
    )
    assert complete(done)["structuredContent"]["status"] == "connected"


@pytest.fixture
async def connected(mcp: McpHttp, browser: Browser, token_for: Any) -> tuple[str, str]:
    """(user, token) of a user whose demo account is connected."""
    user = fresh_user("tools")
    token = token_for(user)
    await connect_demo(mcp, browser, token, user)
    return user, token


async def ask_to_disconnect(
    mcp: McpHttp, token: str, capabilities: dict[str, Any] | None = None
) -> dict[str, Any]:
    return input_required(
        await mcp.call_tool(token, "disconnect_account", DEMO, capabilities=capabilities)
    )


async def answer(
    mcp: McpHttp, token: str, asked: dict[str, Any], response: dict[str, Any]
) -> httpx2.Response:
    return await mcp.call_tool(
        token,
        "disconnect_account",
        DEMO,
        input_responses={CONFIRM_KEY: response},
        request_state=asked["requestState"],
    )


# ------------------------------------------------------------------------------------------------
# disconnect_account
# ------------------------------------------------------------------------------------------------


async def test_disconnect_asks_a_form_mode_yes_no_question_without_a_url(
    mcp: McpHttp, connected: tuple[str, str]
) -> None:
    """DESIGN §4: the confirmation is a form-mode elicitation (non-secret boolean), no URL."""
    _, token = connected

    asked = await ask_to_disconnect(mcp, token)

    assert set(asked["inputRequests"]) == {CONFIRM_KEY}
    request = asked["inputRequests"][CONFIRM_KEY]
    validate(request, "ElicitRequest")
    params = request["params"]
    assert request["method"] == "elicitation/create"
    assert params["mode"] == "form"
    assert "url" not in params
    assert "Demo" in params["message"]
    schema = params["requestedSchema"]
    assert schema["properties"]["confirm"]["type"] == "boolean"
    assert schema["required"] == ["confirm"]
    assert isinstance(asked["requestState"], str)


async def test_disconnect_confirmed_removes_the_connection(
    mcp: McpHttp, connected: tuple[str, str], db: AsyncEngine
) -> None:
    """Accept with confirm=true deletes the user's connection, and says so."""
    user, token = connected
    asked = await ask_to_disconnect(mcp, token)

    response = await answer(mcp, token, asked, {"action": "accept", "content": {"confirm": True}})

    result = complete(response)
    assert "isError" not in result
    assert result["structuredContent"] == {
        "provider": "demo",
        "status": "disconnected",
        "revoked_upstream": False,
    }
    assert await count_rows(db, "connections", subject=user) == 0
    assert API_KEY not in response.text


@pytest.mark.parametrize(
    "response",
    [
        {"action": "decline"},
        {"action": "cancel"},
        {"action": "accept", "content": {"confirm": False}},
        {"action": "accept"},
        {"action": "accept", "content": {"confirm": "false"}},
        {"action": "accept", "content": {"confirm": 1}},
    ],
    ids=["decline", "cancel", "confirm-false", "no-content", "string-false", "integer-one"],
)
async def test_disconnect_without_a_true_confirmation_keeps_the_connection(
    response: dict[str, Any], mcp: McpHttp, connected: tuple[str, str], db: AsyncEngine
) -> None:
    """Only an explicit boolean true removes a connection; anything else leaves it in place."""
    user, token = connected
    asked = await ask_to_disconnect(mcp, token)

    result = complete(await answer(mcp, token, asked, response))

    assert result["structuredContent"] == {"provider": "demo", "status": "connected"}
    assert await count_rows(db, "connections", subject=user) == 1


@pytest.mark.parametrize("content", ["yes", ["confirm"], 7], ids=["string", "list", "number"])
async def test_disconnect_with_malformed_form_content_is_refused_and_keeps_the_connection(
    content: Any, mcp: McpHttp, connected: tuple[str, str], db: AsyncEngine
) -> None:
    """ElicitResult.content must be an object: other shapes are invalid params, never a 500."""
    user, token = connected
    asked = await ask_to_disconnect(mcp, token)

    response = await answer(mcp, token, asked, {"action": "accept", "content": content})

    assert response.status_code == 200, response.text
    body = response.json()
    validate_response(body)
    assert body["error"]["code"] == -32602
    assert await count_rows(db, "connections", subject=user) == 1


async def test_disconnect_confirmation_without_the_state_asks_again(
    mcp: McpHttp, connected: tuple[str, str], db: AsyncEngine
) -> None:
    """A client cannot skip the question by sending a made-up answer on the first call: the
    answer counts only with the state of the round that asked it."""
    user, token = connected

    response = await mcp.call_tool(
        token,
        "disconnect_account",
        DEMO,
        input_responses={CONFIRM_KEY: {"action": "accept", "content": {"confirm": True}}},
    )

    asked = input_required(response)
    assert set(asked["inputRequests"]) == {CONFIRM_KEY}
    assert await count_rows(db, "connections", subject=user) == 1


@pytest.mark.parametrize(
    "capabilities",
    [{}, {"elicitation": {"url": {}}}, {"sampling": {}}],
    ids=["none", "url-only", "sampling-only"],
)
async def test_disconnect_for_a_client_without_form_elicitation_needs_the_capability(
    capabilities: dict[str, Any], mcp: McpHttp, connected: tuple[str, str], db: AsyncEngine
) -> None:
    """MCP basic §Error codes: a request that needs an undeclared capability is -32021 at HTTP 400
    naming it; the connection is not removed without the question."""
    user, token = connected

    response = await mcp.call_tool(token, "disconnect_account", DEMO, capabilities=capabilities)

    assert response.status_code == 400, response.text
    body = response.json()
    validate_response(body)
    assert body["error"]["code"] == -32021
    assert body["error"]["data"] == {"requiredCapabilities": FORM_ONLY}
    assert await count_rows(db, "connections", subject=user) == 1


@pytest.mark.parametrize("capabilities", [FORM_ONLY, {"elicitation": {}}], ids=["form", "empty"])
async def test_disconnect_asks_a_client_with_form_elicitation_only(
    capabilities: dict[str, Any], mcp: McpHttp, connected: tuple[str, str]
) -> None:
    """`"elicitation": {}` means form mode (elicitation §Capabilities), so both declarations may
    be asked the yes/no question."""
    _, token = connected

    asked = await ask_to_disconnect(mcp, token, capabilities)

    assert asked["inputRequests"][CONFIRM_KEY]["params"]["mode"] == "form"


async def test_disconnect_of_an_unconnected_provider_says_so_without_asking(
    mcp: McpHttp, token_for: Any
) -> None:
    """Nothing to remove, nothing to confirm."""
    token = token_for(fresh_user("tools-none"))

    result = complete(await mcp.call_tool(token, "disconnect_account", DEMO))

    assert result["structuredContent"] == {"provider": "demo", "status": "not_connected"}


async def test_disconnect_of_an_unknown_provider_is_a_tool_error(
    mcp: McpHttp, token_for: Any
) -> None:
    """An unknown provider is the model's mistake: an `isError` result listing the known ones."""
    token = token_for(fresh_user("tools-unknown"))

    result = complete(await mcp.call_tool(token, "disconnect_account", {"provider": "nope"}))

    assert result["isError"] is True
    assert "demo" in result["content"][0]["text"]


# ------------------------------------------------------------------------------------------------
# list_connections, list_providers
# ------------------------------------------------------------------------------------------------


async def test_list_connections_shows_provider_account_status_and_time(
    mcp: McpHttp, connected: tuple[str, str]
) -> None:
    """{connections: [{provider, account, account_id, default, status, connected_at}]}, nothing
    secret (an API key's account has no name and no upstream id)."""
    _, token = connected

    response = await mcp.call_tool(token, "list_connections")

    result = complete(response)
    (item,) = result["structuredContent"]["connections"]
    assert set(item) == {"provider", "account", "account_id", "default", "status", "connected_at"}
    assert (item["provider"], item["account"], item["status"]) == ("demo", None, "active")
    assert (item["account_id"], item["default"]) == (None, True)
    assert datetime.fromisoformat(item["connected_at"]).tzinfo is not None
    assert API_KEY not in response.text


async def test_list_connections_of_a_new_user_is_empty(mcp: McpHttp, token_for: Any) -> None:
    """No connections is an empty list, not an error."""
    token = token_for(fresh_user("tools-empty"))

    result = complete(await mcp.call_tool(token, "list_connections"))

    assert result["structuredContent"] == {"connections": []}
    assert "isError" not in result


async def test_list_connections_shows_only_the_callers_own(
    mcp: McpHttp, connected: tuple[str, str], token_for: Any
) -> None:
    """Connections are keyed on (issuer, subject): another user sees none of them."""
    other = token_for(fresh_user("tools-other"))

    result = complete(await mcp.call_tool(other, "list_connections"))

    assert result["structuredContent"] == {"connections": []}


async def test_list_providers_marks_which_are_connected(
    mcp: McpHttp, connected: tuple[str, str], token_for: Any
) -> None:
    """{providers: [{name, kind, display_name, connected}]} for the caller."""
    _, token = connected
    stranger = token_for(fresh_user("tools-stranger"))

    mine = complete(await mcp.call_tool(token, "list_providers"))
    theirs = complete(await mcp.call_tool(stranger, "list_providers"))

    demo = {"name": "demo", "kind": "api_key", "display_name": "Demo"}
    others = [
        {"name": "github", "kind": "oauth2", "display_name": "GitHub", "connected": False},
        {"name": "acme", "kind": "oidc", "display_name": "Acme", "connected": False},
        {"name": "slack", "kind": "oauth2", "display_name": "Slack", "connected": False},
    ]
    assert mine["structuredContent"] == {"providers": [{**demo, "connected": True}, *others]}
    assert theirs["structuredContent"] == {"providers": [{**demo, "connected": False}, *others]}


async def test_disconnect_is_reflected_by_both_listings(
    mcp: McpHttp, connected: tuple[str, str]
) -> None:
    """After a confirmed disconnect the account is gone from list_connections and shows as not
    connected in list_providers."""
    _, token = connected
    asked = await ask_to_disconnect(mcp, token)
    await answer(mcp, token, asked, {"action": "accept", "content": {"confirm": True}})

    connections = complete(await mcp.call_tool(token, "list_connections"))
    providers = complete(await mcp.call_tool(token, "list_providers"))

    assert connections["structuredContent"] == {"connections": []}
    assert providers["structuredContent"]["providers"][0]["connected"] is False


# ------------------------------------------------------------------------------------------------
# Arguments checked against the advertised inputSchema
# ------------------------------------------------------------------------------------------------


def invalid_arguments(response: httpx2.Response) -> str:
    """The -32602 refusal of a call whose arguments break the tool's inputSchema."""
    assert response.status_code == 200, response.text
    body = response.json()
    validate_response(body)
    assert body["error"]["code"] == -32602, body
    assert body["error"]["data"] == {"reason": "invalid_arguments"}
    message: str = body["error"]["message"]
    return message


async def test_L13_an_argument_the_schema_does_not_declare_is_refused(
    mcp: McpHttp, token_for: Any
) -> None:
    token = token_for(fresh_user("args-extra"))

    message = invalid_arguments(
        await mcp.call_tool(token, "connect_account", {"provider": "demo", "bogus": 1})
    )

    assert message == (
        "Invalid arguments for tool connect_account: unexpected argument bogus "
        "(accepted: account, provider, scopes)"
    )


async def test_L13_a_missing_required_argument_is_named(mcp: McpHttp, token_for: Any) -> None:
    token = token_for(fresh_user("args-missing"))

    message = invalid_arguments(await mcp.call_tool(token, "connect_account", {}))

    assert (
        message == "Invalid arguments for tool connect_account: missing required argument provider"
    )
    assert "None" not in message


async def test_L13_a_wrongly_typed_argument_is_refused_without_echoing_its_value(
    mcp: McpHttp, token_for: Any
) -> None:
    token = token_for(fresh_user("args-type"))
    secretish = "sk_live_CANARY_argument_value_1"

    message = invalid_arguments(
        await mcp.call_tool(token, "connect_account", {"provider": "demo", "scopes": secretish})
    )

    assert message == "Invalid arguments for tool connect_account: scopes must be of type array"
    assert secretish not in message


async def test_L13_a_secret_looking_unexpected_argument_name_is_not_repeated(
    mcp: McpHttp, token_for: Any
) -> None:
    token = token_for(fresh_user("args-secret-name"))
    secretish = "ghp-CANARY-0123456789abcdef0123456789abcdef"

    message = invalid_arguments(await mcp.call_tool(token, "list_providers", {secretish: "x"}))

    assert (
        message
        == "Invalid arguments for tool list_providers: an unexpected argument (accepted: none)"
    )
    assert secretish not in message


async def test_L13_an_array_item_of_the_wrong_type_is_located(mcp: McpHttp, token_for: Any) -> None:
    token = token_for(fresh_user("args-item"))

    message = invalid_arguments(
        await mcp.call_tool(token, "connect_account", {"provider": "demo", "scopes": ["a", 7]})
    )

    assert message == "Invalid arguments for tool connect_account: scopes[1] must be of type string"
