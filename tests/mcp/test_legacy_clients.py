"""Clients of the handshake era (`initialize`) are told which version this server speaks.

2026-07-28 has no `initialize`; the versioning rules ask a server to name its supported versions
in any error to `initialize`. SDKs in their legacy mode show users only the error message, so the
message says it in words and `data.supported` says it to programs; the code and HTTP status stay
what the request's shape earns (modern-shaped requests keep their answers).
"""

from __future__ import annotations

from typing import Any

import httpx2
import pytest
from mcp import Client
from mcp.client.streamable_http import streamable_http_client
from mcp.shared.exceptions import MCPError

from ..support.broker import BrokerProcess
from ..support.clients import McpHttp, request_body
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
    http = httpx2.AsyncClient(
        headers={"Authorization": f"Bearer {token_for('legacy-sdk')}"}, trust_env=False
    )

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
