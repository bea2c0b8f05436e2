"""The `connect-broker dev` playground: generated secrets in a data directory, embedded defaults.

Everything here is for the loopback playground only; `serve` never uses it. The data directory
(default ./data) holds the generated keys, the development IdP's key and the SQLite database;
`dev --config FILE` adds the file's providers and services, and `dev` records them there (as read
at start, `_file` secrets resolved) so that `dev-token` and `service …` given `--data-dir` see the
running playground's configuration from any directory. `[logging]` applies to `dev` as to
`serve`: from the file, and from `BROKER_LOGGING_*` with or without one.
"""

from __future__ import annotations

import json
import os
import secrets
from pathlib import Path
from typing import TYPE_CHECKING, Any

from app.config import ConfigError, Settings, load_settings
from app.config_sources import read_raw
from app.crypto import generate_key

if TYPE_CHECKING:
    from app.auth.dev_idp import DevIdentityProvider

DEFAULT_DATA_DIR = Path("data")
DEV_CLIENT_ID = "connect-broker-dev"  # the broker's login client at the development IdP
STATE_FILE = "dev.json"
IDP_KEY_FILE = "dev-idp-key.json"
DEMO_PROVIDER = {
    "kind": "api_key",
    "display_name": "Demo service",
    "label": "API key",
    "pattern": r"^demo_[A-Za-z0-9]{6,64}$",
}
# Only these tables of a `--config` file join the playground; its own identity provider, keys and
# database stay the playground's.
ADOPTED_TABLES = ("providers", "services", "logging")
# What the environment sets without a `--config` file (a provider's or service's variable needs
# its table in a file)
UNFILED_TABLES = ("logging",)


def new_state(data_dir: Path, port: int, config: str | None) -> dict[str, Any]:
    """The state `dev` is about to save: the saved secrets (fresh ones the first time), this
    run's port and the tables it adopts from `config`. Nothing is written yet."""
    path = data_dir / STATE_FILE
    state: dict[str, Any] = json.loads(path.read_text()) if path.exists() else {}
    if not state:
        state = {
            "signing": generate_key("dev-s1"),
            "encryption": generate_key("dev-e1"),
            "login_secret": secrets.token_urlsafe(32),
        }
    state["port"] = port
    state["config"] = str(Path(config).resolve()) if config else None
    state["adopted"] = adopted_tables(config)
    return state


def save_state(data_dir: Path, state: dict[str, Any]) -> None:
    """Keep the state in `data_dir` (0700) as dev.json (0600) across runs."""
    data_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    descriptor = os.open(data_dir / STATE_FILE, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(descriptor, "w") as handle:
        json.dump(state, handle)


def saved_state(data_dir: Path) -> dict[str, Any]:
    """The state the last `dev` run saved in `data_dir`.

    Raises:
        ConfigError: no playground there yet.
    """
    path = data_dir / STATE_FILE
    if not path.is_file():
        raise ConfigError(
            f"--data-dir: no playground in {data_dir.resolve()} (no {STATE_FILE}); run "
            "`connect-broker dev` first, or pass the data directory it printed"
        )
    state: dict[str, Any] = json.loads(path.read_text())
    return state


def adopted_tables(config: str | None) -> dict[str, Any]:
    """The `[providers.*]`, `[services.*]` and `[logging]` tables of the user's configuration
    file, with their `BROKER_PROVIDERS_*`/`BROKER_SERVICES_*`/`BROKER_LOGGING_*` overrides and
    `_file` secrets resolved; without a file, `[logging]` from the environment alone."""
    tables = ADOPTED_TABLES if config else UNFILED_TABLES
    environ = {
        name: value
        for name, value in os.environ.items()
        if name.startswith(tuple(f"BROKER_{table.upper()}_" for table in tables))
    }
    raw = read_raw(Path(config) if config else None, environ, {})
    return {table: dict(raw.get(table, {})) for table in ADOPTED_TABLES}


def dev_settings(data_dir: Path, state: dict[str, Any]) -> Settings:
    public_url = f"http://127.0.0.1:{state['port']}"
    adopted = {table: {} for table in ADOPTED_TABLES} | state.get("adopted", {})
    return load_settings(
        None,
        environ={},
        overrides={
            "server.public_url": public_url,
            "server.allowed_origins": [f"http://localhost:{state['port']}"],
            "database.url": f"sqlite:///{data_dir.resolve() / 'dev.db'}",
            "identity.issuer": f"{public_url}/dev-idp",
            "identity.login_client_id": DEV_CLIENT_ID,
            "identity.require_at_jwt": True,  # its access tokens are RFC 9068's
            "identity.login_client_secret": state["login_secret"],
            "keys.signing": [state["signing"]],
            "keys.encryption": [state["encryption"]],
            "providers": {"demo": DEMO_PROVIDER, **adopted["providers"]},
            "services": adopted["services"],
            "logging": adopted["logging"],
        },
    )


def playground_settings(data_dir: Path) -> Settings:
    """The running playground's settings, for `dev-token` and `service … --data-dir`."""
    return dev_settings(data_dir, saved_state(data_dir))


def dev_idp(data_dir: Path, settings: Settings, state: dict[str, Any]) -> DevIdentityProvider:
    # Imported here: the development IdP brings the web framework, which the operator commands
    # (`service`, `audit`, `users`, ...) do not need; they start in half the time without it.
    from app.auth.dev_idp import DevIdentityProvider

    return DevIdentityProvider(
        issuer=settings.identity.issuer,
        audience=settings.audience,
        key_path=data_dir / IDP_KEY_FILE,
        client_id=DEV_CLIENT_ID,
        client_secret=state["login_secret"],
    )


def dev_banner(settings: Settings, token: str, data_dir: Path) -> str:
    url, where = settings.mcp_url, data_dir.resolve()
    others = sorted(name for name in settings.providers if name != "demo")
    return "\n".join(
        [
            "Connect Broker development playground (DEVELOPMENT IDENTITY PROVIDER: any user name)",
            f"  MCP endpoint : {url}",
            f"  Data dir     : {where}",
            f"  Bearer token for 'alice' (12 h): {token}",
            f"  Another user : connect-broker dev-token bob --data-dir {where}",
            f"  A service    : connect-broker service create NAME --data-dir {where}",
            "  Demo provider: 'demo' (API keys look like demo_abc123)",
            *(
                [
                    f"  Your providers: {', '.join(others)} (callbacks at "
                    f"{settings.public_url}/oauth/<name>/callback)"
                ]
                if others
                else []
            ),
            "",
            *client_snippets(url, token),
        ]
    )


def client_snippets(url: str, token: str) -> list[str]:
    """How to point the official SDKs, and any `mcpServers` client, at the playground."""
    servers = json.dumps(
        {
            "mcpServers": {
                "connect-broker-dev": {
                    "type": "http",
                    "url": url,
                    "headers": {"Authorization": f"Bearer {token}"},
                }
            }
        },
        indent=2,
    )
    return [
        "Python (mcp 2.x):",
        "  import asyncio",
        "  import httpx2",
        "  from mcp import Client",
        "  from mcp.client.streamable_http import streamable_http_client",
        "",
        "  async def main() -> None:",
        f'      http = httpx2.AsyncClient(headers={{"Authorization": "Bearer {token}"}})',
        f'      async with http, Client(streamable_http_client("{url}", http_client=http)) as c:',
        "          print([tool.name for tool in (await c.list_tools()).tools])",
        "",
        "  asyncio.run(main())",
        "",
        "TypeScript (@modelcontextprotocol/client 2.x):",
        "  import { Client, StreamableHTTPClientTransport } from '@modelcontextprotocol/client';",
        f"  const transport = new StreamableHTTPClientTransport(new URL('{url}'), {{",
        f"    requestInit: {{ headers: {{ Authorization: 'Bearer {token}' }} }},",
        "  });",
        "  const client = new Client({ name: 'my-app', version: '1.0.0' });",
        "  await client.connect(transport);",
        "",
        "Any client with an mcpServers file:",
        servers,
    ]
