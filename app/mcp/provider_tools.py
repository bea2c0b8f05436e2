"""Tools that use a stored provider credential, proving the connection works."""

from __future__ import annotations

from collections.abc import Mapping

import httpx2

from app.display import display_text
from app.mcp.registry import Tool, ToolCall, ToolRegistry, ToolResult
from app.providers import oauth
from app.providers.settings import OAuthProviderSettings, ProviderSettings

WHOAMI_FIELDS = ("login", "id", "name")


def register_provider_tools(
    registry: ToolRegistry, providers: Mapping[str, ProviderSettings], http: httpx2.AsyncClient
) -> None:
    """`github_whoami` for the first provider built on the GitHub preset, if any."""
    for name, provider in providers.items():
        if isinstance(provider, OAuthProviderSettings) and provider.preset == "github":
            registry.add(_github_whoami(http, name, provider))
            return


def _github_whoami(http: httpx2.AsyncClient, name: str, provider: OAuthProviderSettings) -> Tool:
    async def whoami(call: ToolCall) -> ToolResult:
        credential = await call.connections.require(name)
        try:
            user = await oauth.get_api_json(provider, http, "/user", credential.secret)
        except oauth.UpstreamError as exc:
            return ToolResult(
                text=f"{provider.display_name} did not answer ({exc.reason}). If this persists, "
                "disconnect and connect the account again.",
                is_error=True,
            )
        profile = _profile(user)
        return ToolResult(
            text=f"Connected to {provider.display_name} as @{profile['login']}.", structured=profile
        )

    return Tool(
        name="github_whoami",
        description="Show which GitHub account is connected (calls the GitHub API /user).",
        handler=whoami,
        annotations={"readOnlyHint": True, "openWorldHint": True},
    )


def _profile(user: Mapping[str, object]) -> dict[str, str | int | None]:
    """The named fields of a provider's `/user` answer, and only those: a provider response may
    echo credentials (I3). Each is an integer or a readable, bounded string (app/display.py);
    anything else is None, as a provider's answer is checked before it reaches a result."""
    profile: dict[str, str | int | None] = {}
    for key in WHOAMI_FIELDS:
        value = user.get(key)
        if isinstance(value, str):
            profile[key] = display_text(value)
        elif isinstance(value, int) and not isinstance(value, bool):
            profile[key] = value
        else:
            profile[key] = None
    return profile
