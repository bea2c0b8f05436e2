"""The MCP methods the broker implements; anything else is -32601 (HTTP 404)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from app.auth.principal import McpCaller
from app.mcp.calls import CallToolRound
from app.mcp.envelope import HeaderMap, Message
from app.mcp.progress import ProgressReporter
from app.mcp.protocol import SUPPORTED_VERSIONS, invalid_params
from app.mcp.server import McpServer

LIST_TTL_MS = 300_000
INSTRUCTIONS = (
    "Connect Broker keeps the user's third-party accounts (OAuth and API keys). Use "
    "connect_account when a provider is needed; the user finishes the connection in a browser."
)

# the last argument reports progress when the request asked for it (app/mcp/progress.py)
Method = Callable[
    [McpServer, McpCaller, Message, HeaderMap, ProgressReporter | None], Awaitable[dict[str, Any]]
]


async def discover(
    server: McpServer,
    _caller: McpCaller,
    _message: Message,
    _headers: HeaderMap,
    _progress: ProgressReporter | None,
) -> dict[str, Any]:
    return {
        "resultType": "complete",
        "supportedVersions": list(SUPPORTED_VERSIONS),
        "capabilities": {"tools": {}},
        "instructions": INSTRUCTIONS,
        "ttlMs": LIST_TTL_MS,
        "cacheScope": "public",
    }


async def list_tools(
    server: McpServer,
    _caller: McpCaller,
    message: Message,
    _headers: HeaderMap,
    _progress: ProgressReporter | None,
) -> dict[str, Any]:
    if message.params.get("cursor") is not None:
        raise invalid_params("Invalid cursor: tools/list has a single page")
    return {
        "resultType": "complete",
        "tools": [tool.to_wire() for tool in server.registry],
        "ttlMs": LIST_TTL_MS,
        "cacheScope": "public",
    }


async def call_tool(
    server: McpServer,
    caller: McpCaller,
    message: Message,
    headers: HeaderMap,
    progress: ProgressReporter | None,
) -> dict[str, Any]:
    return await CallToolRound(server, caller, message, progress).run(headers)


METHODS: dict[str, Method] = {
    "server/discover": discover,
    "tools/list": list_tools,
    "tools/call": call_tool,
}
