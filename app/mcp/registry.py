"""The public API for adding tools to the broker's MCP endpoint.

A tool is a name, a JSON Schema for its arguments and an async handler. The handler gets a
`ToolCall` and returns a `ToolResult` (final) or an `InputRequired` (ask the client first, MRTR).
A handler that needs a user's third-party account calls `await call.connections.require(...)`;
when the account is not connected that raises `ConnectionRequired`, and the endpoint answers with a
URL-mode elicitation for a new connect flow, then re-runs the handler on the client's retry once
the flow has completed. A long tool may `await call.report_progress(done, total)`: a client that
asked for progress then receives it on an event stream before the result.

    registry = ToolRegistry()

    @registry.tool("whoami", description="Who am I at GitHub?")
    async def whoami(call: ToolCall) -> ToolResult:
        credential = await call.connections.require("github")
        ...
"""

from __future__ import annotations

import json
import re
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Protocol

from jsonschema.exceptions import SchemaError

from app.auth.principal import McpCaller
from app.credentials import Credential
from app.mcp.arguments import ArgumentsValidator, compile_arguments_schema
from app.mcp.progress import ProgressReporter

TOOL_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,128}$")
NO_ARGUMENTS: dict[str, Any] = {"type": "object", "additionalProperties": False}

__all__ = [
    "ConnectionRequired",
    "Credential",
    "InputRequired",
    "Tool",
    "ToolCall",
    "ToolRegistry",
    "ToolResult",
]


class ConnectionRequired(Exception):
    """The user has no usable connection to `provider` (with `scopes`) yet. `granted`: the
    scopes of a connection that lacks some of them (a step-up asks for those too)."""

    def __init__(
        self,
        provider: str,
        scopes: tuple[str, ...] = (),
        *,
        granted: frozenset[str] = frozenset(),
    ) -> None:
        super().__init__(provider)
        self.provider = provider
        self.scopes = scopes
        self.granted = granted


class Connections(Protocol):
    async def require(
        self, provider: str, scopes: tuple[str, ...] = (), *, account: str | None = None
    ) -> Credential:
        """The caller's credential for `provider`. Raises ConnectionRequired when there is none.

        With several accounts connected, `account` names one (as `list_connections` lists it;
        "new": connect another); None: the one chosen for this client, else the client is asked
        which (form mode), else the default one (app/mcp/accounts.py)."""
        ...


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict[str, Any]
    caller: McpCaller
    client_name: str | None
    capabilities: dict[str, Any]
    input_responses: dict[str, Any]
    state: Any  # the `state` of the InputRequired this call answers, verified; None on round 1
    connections: Connections
    progress: ProgressReporter | None = None  # set when the client asked for progress

    async def report_progress(
        self, progress: float, total: float | None = None, message: str | None = None
    ) -> None:
        """Tell the client how far the call has come (`notifications/progress`), if it asked to
        be told (a progress token, and an `Accept` listing text/event-stream); otherwise this does
        nothing. `progress` must increase with each report; `message` is shown to the user and
        neutralised like any outside text (app/display.py).

        Raises:
            ValueError: a value the client could not be sent (app/mcp/progress.py).
        """
        if self.progress is not None:
            await self.progress.report(progress, total, message)

    def has_capability(self, *path: str) -> bool:
        node: Any = self.capabilities
        for part in path:
            if not isinstance(node, dict) or part not in node:
                return False
            node = node[part]
        return isinstance(node, dict)


@dataclass(frozen=True)
class ToolResult:
    """A final `CallToolResult`. `structured` is also rendered as JSON text (tools §Output)."""

    text: str | None = None
    structured: Any = None
    is_error: bool = False
    content: tuple[dict[str, Any], ...] = ()

    def to_wire(self) -> dict[str, Any]:
        content = list(self.content)
        if self.text is not None:
            content.insert(0, {"type": "text", "text": self.text})
        if self.structured is not None and not content:
            content.append({"type": "text", "text": json.dumps(self.structured)})
        result: dict[str, Any] = {"resultType": "complete", "content": content}
        if self.structured is not None:
            result["structuredContent"] = self.structured
        if self.is_error:
            result["isError"] = True
        return result


@dataclass(frozen=True)
class InputRequired:
    """Ask the client for inputs (bare `{method, params}` requests by key); `state` comes back."""

    requests: dict[str, dict[str, Any]]
    state: Any = None


ToolOutcome = ToolResult | InputRequired
ToolHandler = Callable[[ToolCall], Awaitable[ToolOutcome]]


@dataclass(frozen=True)
class Tool:
    name: str
    description: str
    handler: ToolHandler
    input_schema: dict[str, Any] = field(default_factory=lambda: dict(NO_ARGUMENTS))
    title: str | None = None
    annotations: dict[str, Any] | None = None
    output_schema: dict[str, Any] | None = None

    @cached_property
    def arguments_validator(self) -> ArgumentsValidator:
        """Checks `tools/call` arguments against `input_schema`, the schema `tools/list` shows."""
        return compile_arguments_schema(self.input_schema)

    def to_wire(self) -> dict[str, Any]:
        tool: dict[str, Any] = {
            "name": self.name,
            "description": self.description,
            "inputSchema": self.input_schema,
        }
        if self.title:
            tool["title"] = self.title
        if self.annotations:
            tool["annotations"] = self.annotations
        if self.output_schema:
            tool["outputSchema"] = self.output_schema
        return tool


class ToolRegistry:
    """Tools by name, listed in registration order (deterministic `tools/list`)."""

    def __init__(self) -> None:
        self._tools: dict[str, Tool] = {}

    def add(self, tool: Tool) -> None:
        if not TOOL_NAME.match(tool.name):
            raise ValueError(f"invalid tool name {tool.name!r}")
        if tool.name in self._tools:
            raise ValueError(f"tool {tool.name!r} is already registered")
        if tool.input_schema.get("type") != "object":
            raise ValueError("a tool's inputSchema must have type object")
        try:
            tool.arguments_validator  # noqa: B018 - compiled now: a bad schema fails registration
        except SchemaError as exc:
            raise ValueError(
                f"tool {tool.name!r} has an invalid inputSchema: {exc.message}"
            ) from None
        self._tools[tool.name] = tool

    def tool(
        self,
        name: str,
        *,
        description: str,
        input_schema: dict[str, Any] | None = None,
        title: str | None = None,
        annotations: dict[str, Any] | None = None,
    ) -> Callable[[ToolHandler], ToolHandler]:
        def register(handler: ToolHandler) -> ToolHandler:
            self.add(
                Tool(
                    name=name,
                    description=description,
                    handler=handler,
                    input_schema=input_schema or dict(NO_ARGUMENTS),
                    title=title,
                    annotations=annotations,
                )
            )
            return handler

        return register

    def get(self, name: str) -> Tool | None:
        return self._tools.get(name)

    def __iter__(self) -> Iterator[Tool]:
        return iter(self._tools.values())
