"""Tools that use a stored provider credential, proving the connection works."""

from __future__ import annotations

from app.mcp.registry import Tool, ToolCall, ToolRegistry, ToolResult
from app.providers import oauth
from app.providers.settings import OAuthProviderSettings
from app.runtime import Runtime

WHOAMI_FIELDS = ("login", "id", "name")


def register_provider_tools(registry: ToolRegistry, runtime: Runtime) -> None:
    """`github_whoami` for the first provider built on the GitHub preset, if any."""
    for name, provider in runtime.settings.providers.items():
        if isinstance(provider, OAuthProviderSettings) and provider.preset == "github":
            registry.add(_github_whoami(runtime, name, provider))
            return


def _github_whoami(runtime: Runtime, name: str, provider: OAuthProviderSettings) -> Tool:
    async def whoami(call: ToolCall) -> ToolResult:
        credential = await call.connections.require(name)
        try:
            user = await oauth.get_api_json(provider, runtime.http, "/user", credential.secret)
        except oauth.UpstreamError as exc:
            return ToolResult(
                text=f"{provider.display_name} did not answer ({exc.reason}). If this persists, "
                "disconnect and connect the account again.",
                is_error=True,
            )
        # Only named fields leave the broker: a provider response may echo credentials (I3).
        profile = {key: user.get(key) for key in WHOAMI_FIELDS}
        return ToolResult(
            text=f"Connected to {provider.display_name} as @{profile['login']}.", structured=profile
        )

    return Tool(
        name="github_whoami",
        description="Show which GitHub account is connected (calls the GitHub API /user).",
        handler=whoami,
        annotations={"readOnlyHint": True, "openWorldHint": True},
    )
