"""The official client's elicitation callback used by the end-to-end tests."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Literal

from mcp.client.session import ClientRequestContext
from mcp_types import ElicitRequestParams, ElicitRequestURLParams, ElicitResult

Action = Literal["accept", "decline", "cancel"]


@dataclass
class UrlElicitations:
    """The client's elicitation callback: each URL-mode request goes to `on_url`, which answers."""

    on_url: Callable[[str], Awaitable[Action]]
    urls: list[str] = field(default_factory=list)
    modes: list[str] = field(default_factory=list)

    async def __call__(
        self, context: ClientRequestContext, params: ElicitRequestParams
    ) -> ElicitResult:
        self.modes.append(params.mode)
        if not isinstance(params, ElicitRequestURLParams):
            return ElicitResult(action="decline")
        self.urls.append(params.url)
        return ElicitResult(action=await self.on_url(params.url))
