"""Clients of the handshake era (`initialize`) are told which version this server speaks.

2026-07-28 has no `initialize`; the versioning rules ask a server to name its supported versions
in any error to `initialize`. SDKs in their legacy mode show users only the error message, so the
message says it in words and `data.supported` says it to programs; the code and HTTP status stay
what the request's shape earns (modern-shaped requests keep their answers).
"""

from __future__ import annotations

import json
from typing import Any

import httpx2
import pytest
from mcp import Client
from mcp.client.streamable_http import streamable_http_client
from mcp.shared.exceptions import MCPError

from ..support.broker import BrokerProcess
from ..support.clients import McpHttp, request_body
from ..support.http import local_client
from ..support.schema import validate, validate_response

SUPPORTED = ["2026-07-28"]
IN_WORDS = "This server speaks MCP 2026-07-28 only"
LEGACY_INITIALIZE: dict[str, Any] = {
    "jsonrpc": "2.0",
    "id": 1,
    "method": "initialize",
    "params": {
        "protocolVersion": "2025-11-25",
        "capabilities": {},
        "clientInfo": {"name": "legacy-client", "version": "1"},
    },
}


def refusal(response: httpx2.Response, status: int, code: int) -> dict[str, Any]:
    assert response.status_code == status, response.text
    body: dict[str, Any] = response.json()
    validate_response(body)
    assert body["id"] == 1
    error: dict[str, Any] = body["error"]
    assert error["code"] == code, body
    return error


async def test_L12_legacy_initialize_without_mcp_headers_names_supported_versions(
    mcp: McpHttp, token_for: Any
) -> None:
    """A 2025-11-25 client's first request, with no Mcp-Method / MCP-Protocol-Version headers."""
    response = await mcp.post(
        LEGACY_INITIALIZE,
        token=token_for("legacy-bare"),
        drop=("MCP-Protocol-Version", "Mcp-Method"),
    )

    error = refusal(response, 400, -32020)
    validate(response.json(), "HeaderMismatchError")
    assert error["data"]["supported"] == SUPPORTED
    assert error["message"].startswith(IN_WORDS), error


async def test_L12_legacy_initialize_with_mcp_headers_names_supported_versions(
    mcp: McpHttp, token_for: Any
) -> None:
    """Headers present (Mcp-Method: initialize) but no params._meta: the -32602 says why too."""
    response = await mcp.post(
        LEGACY_INITIALIZE,
        token=token_for("legacy-headers"),
        headers={"MCP-Protocol-Version": "2025-11-25", "Mcp-Method": "initialize"},
    )

    error = refusal(response, 400, -32602)
    assert error["data"] == {"supported": SUPPORTED}
    assert error["message"].startswith(IN_WORDS), error
    assert "params._meta is required" in error["message"]


async def test_L12_modern_shaped_initialize_keeps_404_and_names_supported_versions(
    mcp: McpHttp, token_for: Any
) -> None:
    """With 2026-07-28 `_meta` and headers, `initialize` is an unknown method (404, -32601)."""
    body = request_body("initialize", request_id=1)

    error = refusal(await mcp.post(body, token=token_for("legacy-modern")), 404, -32601)

    assert error["data"] == {"supported": SUPPORTED}
    assert error["message"].startswith(IN_WORDS), error


async def test_L12_other_methods_keep_their_answers(mcp: McpHttp, token_for: Any) -> None:
    """Control: the same missing header on tools/list is today's plain -32020."""
    body = request_body("tools/list", request_id=1)

    response = await mcp.post(body, token=token_for("legacy-control"), drop=("Mcp-Method",))

    error = refusal(response, 400, -32020)
    assert "data" not in error
    assert not error["message"].startswith(IN_WORDS)


async def post_raw(mcp: McpHttp, body: dict[str, Any], token: str) -> httpx2.Response:
    """`body` as it is, whatever its params, with the method's and version's headers."""
    headers = {"Mcp-Method": body["method"], "MCP-Protocol-Version": "2026-07-28"}
    return await mcp.post(None, token=token, headers=headers, raw=json.dumps(body).encode())


@pytest.mark.parametrize(
    ("params", "status", "code"),
    [(5, 400, -32602), ([], 400, -32602), (None, 400, -32602)],
    ids=["number", "array", "null"],
)
async def test_L12_initialize_with_params_not_an_object_names_supported_versions(
    mcp: McpHttp, token_for: Any, params: Any, status: int, code: int
) -> None:
    """`params` refused before the request is read as a message (number, array) or read as
    empty (null): the error still names the versions, in words and in `data.supported`."""
    body = {"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": params}

    response = await post_raw(mcp, body, token_for("legacy-params"))

    error = refusal(response, status, code)
    assert error["data"]["supported"] == SUPPORTED
    assert error["message"].startswith(IN_WORDS), error


async def test_L12_initialize_with_a_bad_id_names_supported_versions(
    mcp: McpHttp, token_for: Any
) -> None:
    """An id of the wrong type keeps its -32600 (and no id to echo), with the versions named."""
    body = {**LEGACY_INITIALIZE, "id": [1]}

    response = await mcp.post(body, token=token_for("legacy-bad-id"))

    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["code"] == -32600
    assert error["data"] == {"supported": SUPPORTED}
    assert error["message"].startswith(IN_WORDS), error


async def test_L12_other_methods_with_params_not_an_object_keep_their_answer(
    mcp: McpHttp, token_for: Any
) -> None:
    """Control: tools/list with `"params": 5` is today's plain -32602."""
    body = {"jsonrpc": "2.0", "id": 1, "method": "tools/list", "params": 5}

    error = refusal(await post_raw(mcp, body, token_for("legacy-params-control")), 400, -32602)

    assert "data" not in error
    assert error["message"] == "params must be an object"


def the_mcp_error(raised: BaseException) -> MCPError:
    """The SDK's MCPError, also when its task group wraps it in an exception group."""
    if isinstance(raised, MCPError):
        return raised
    assert isinstance(raised, BaseExceptionGroup), raised
    found = [the_mcp_error(inner) for inner in raised.exceptions]
    assert len(found) == 1, raised
    return found[0]


async def test_L12_official_client_in_legacy_mode_shows_which_version_the_server_speaks(
    broker: BrokerProcess, token_for: Any
) -> None:
    """The `mcp` SDK's handshake mode (`mode="legacy"`) surfaces the words and the versions."""
    http = local_client(headers={"Authorization": f"Bearer {token_for('legacy-sdk')}"})

    async def connect() -> None:
        transport = streamable_http_client(broker.mcp_url, http_client=http)
        async with Client(transport, mode="legacy"):
            pass

    async with http:
        with pytest.raises(BaseException) as caught:  # noqa: PT011 - unwrapped just below
            await connect()

    error = the_mcp_error(caught.value)
    assert error.message.startswith(IN_WORDS), error
    assert error.data["supported"] == SUPPORTED
