"""A sibling MCP server that lists the caller's GitHub repositories through Connect Broker.

It is an ordinary official-SDK `MCPServer` with its own audience at the broker's IdP. Its tool
`list_github_repos` asks the broker for the caller's GitHub token; until the user has connected
GitHub, the call answers the broker's URL-mode elicitation, and the client's retry gets the
repositories. `disconnect_github` deletes the caller's GitHub connection of this sibling.

    connect-broker service create repo-bot --providers github     # prints the service secret
    BROKER_URL=https://broker.example.com \\
    BROKER_SERVICE_SECRET=cbs_... \\
    SIBLING_ISSUER=https://idp.example.com \\
    SIBLING_AUDIENCE=https://repos.example.com/mcp \\
    GITHUB_API_URL=https://api.github.com \\
    python examples/sibling_server.py --port 8200

Optional: SIBLING_NAME (default `github-repos`, the server's name and the audience of its sealed
requestState); SIBLING_STATE_KEYS (comma-separated secrets of 32+ bytes) seals requestState under
keys every instance shares; without it each process has its own key, fine for a single process;
BROKER_USER_PROOF=token for a service the broker configures with `user_proof = "token"` and
`token_audience` = SIBLING_AUDIENCE: the caller's own access token then proves the caller to the
broker (default `off`: the sibling names the caller).
"""

from __future__ import annotations

import argparse
import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import httpx2
from mcp.server.auth.settings import AuthSettings
from mcp.server.mcpserver import Context, MCPServer, RequestStateSecurity
from mcp.server.mcpserver.exceptions import ToolError
from pydantic import BaseModel

from connect_broker_client import ConnectBroker, IdpTokenVerifier

GITHUB_TIMEOUT_SECONDS = 15.0


@dataclass(frozen=True)
class SiblingConfig:
    broker_url: str
    service_secret: str = field(repr=False)
    issuer: str
    audience: str
    github_api_url: str = "https://api.github.com"
    name: str = "github-repos"
    state_keys: tuple[str, ...] = field(default=(), repr=False)
    user_proof: bool = False

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None) -> SiblingConfig:
        values = dict(os.environ if env is None else env)
        missing = [
            key
            for key in ("BROKER_URL", "BROKER_SERVICE_SECRET", "SIBLING_ISSUER", "SIBLING_AUDIENCE")
            if not values.get(key)
        ]
        if missing:
            raise SystemExit(f"missing environment variables: {', '.join(missing)}")
        keys = tuple(key for key in values.get("SIBLING_STATE_KEYS", "").split(",") if key)
        proof = values.get("BROKER_USER_PROOF") or "off"
        if proof not in ("off", "token"):
            raise SystemExit("BROKER_USER_PROOF must be off or token")
        return cls(
            broker_url=values["BROKER_URL"],
            service_secret=values["BROKER_SERVICE_SECRET"],
            issuer=values["SIBLING_ISSUER"],
            audience=values["SIBLING_AUDIENCE"],
            github_api_url=values.get("GITHUB_API_URL") or cls.github_api_url,
            name=values.get("SIBLING_NAME") or cls.name,
            state_keys=keys,
            user_proof=proof == "token",
        )


class Repo(BaseModel):
    name: str
    full_name: str
    private: bool


def build_server(config: SiblingConfig) -> MCPServer[Any]:
    """The MCPServer with its token verifier, the broker's middleware and the tools."""
    broker = ConnectBroker(config.broker_url, config.service_secret, user_proof=config.user_proof)
    verifier = IdpTokenVerifier(config.issuer, config.audience)
    github = httpx2.AsyncClient(base_url=config.github_api_url, timeout=GITHUB_TIMEOUT_SECONDS)

    @asynccontextmanager
    async def lifespan(_: MCPServer[Any]) -> AsyncIterator[dict[str, Any]]:
        try:
            yield {}
        finally:
            for client in (broker, verifier, github):
                await client.aclose()

    server: MCPServer[Any] = MCPServer(
        config.name,
        version="1.0.0",
        lifespan=lifespan,
        token_verifier=verifier,
        auth=AuthSettings(
            issuer_url=config.issuer,
            resource_server_url=config.audience,
            validate_token_resource=True,
        ),
        request_state_security=(
            RequestStateSecurity(keys=list(config.state_keys)) if config.state_keys else None
        ),
    )
    broker.install(server)

    @server.tool()
    async def list_github_repos(ctx: Context[Any, Any]) -> list[Repo]:
        """List the GitHub repositories of the signed-in user (connects GitHub on first use)."""
        token = await broker.require(ctx, "github", scopes=("repo",))
        response = await github.get(
            "/user/repos",
            params={"per_page": "100", "sort": "updated"},
            headers={"Authorization": f"Bearer {token}", "Accept": "application/vnd.github+json"},
        )
        if response.status_code == 401:
            raise ToolError("GitHub refused the connection; reconnect GitHub and try again.")
        if response.status_code != 200:
            raise ToolError(f"GitHub answered HTTP {response.status_code}; try again shortly.")
        return [
            Repo(name=repo["name"], full_name=repo["full_name"], private=bool(repo["private"]))
            for repo in response.json()
        ]

    @server.tool()
    async def disconnect_github(ctx: Context[Any, Any]) -> str:
        """Disconnect the signed-in user's GitHub account from this server (revoked at GitHub)."""
        # each account by name: with several, the broker deletes none unless one is named; one
        # it only shares with this server (made elsewhere) is not this server's to delete
        named: list[str | None] = [
            str(connection["account"])
            for connection in await broker.connections(ctx)
            if connection["provider"] == "github" and connection.get("account")
        ]
        removed = [
            name for name in named or [None] if await broker.disconnect(ctx, "github", account=name)
        ]
        if not removed:
            return "GitHub was not connected through this server."
        return f"Disconnected GitHub ({', '.join(name or 'its account' for name in removed)})."

    return server


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8200)
    arguments = parser.parse_args()
    server = build_server(SiblingConfig.from_env())
    server.run(
        "streamable-http",
        host=arguments.host,
        port=arguments.port,
        json_response=True,
        stateless_http=True,
    )


if __name__ == "__main__":
    main()
