"""The `connect-broker dev` playground: generated secrets in ./data, embedded defaults.

Everything here is for the loopback playground only; `serve` never uses it.
"""

from __future__ import annotations

import json
import os
import secrets
from pathlib import Path
from typing import Any

from app.auth.dev_idp import DEV_CLIENT_ID, DevIdentityProvider
from app.config import Settings, load_settings
from app.crypto import generate_key

DATA_DIR = Path("data")
DEV_STATE = DATA_DIR / "dev.json"
DEV_IDP_KEY = DATA_DIR / "dev-idp-key.json"


def dev_state(port: int | None) -> dict[str, Any]:
    """The playground's generated secrets and URL, kept in ./data (0600) across runs."""
    DATA_DIR.mkdir(mode=0o700, exist_ok=True)
    state: dict[str, Any] = json.loads(DEV_STATE.read_text()) if DEV_STATE.exists() else {}
    if not state:
        state = {
            "signing": generate_key("dev-s1"),
            "encryption": generate_key("dev-e1"),
            "login_secret": secrets.token_urlsafe(32),
            "port": 8000,
        }
    if port is not None:
        state["port"] = port
    descriptor = os.open(DEV_STATE, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(descriptor, "w") as handle:
        json.dump(state, handle)
    return state


def dev_settings(state: dict[str, Any]) -> Settings:
    public_url = f"http://127.0.0.1:{state['port']}"
    return load_settings(
        None,
        environ={},
        overrides={
            "server.public_url": public_url,
            "server.allowed_origins": [f"http://localhost:{state['port']}"],
            "database.url": f"sqlite:///{DATA_DIR / 'dev.db'}",
            "identity.issuer": f"{public_url}/dev-idp",
            "identity.login_client_id": DEV_CLIENT_ID,
            "identity.login_client_secret": state["login_secret"],
            "keys.signing": [state["signing"]],
            "keys.encryption": [state["encryption"]],
            "providers.demo": {
                "kind": "api_key",
                "display_name": "Demo service",
                "label": "API key",
                "pattern": r"^demo_[A-Za-z0-9]{6,64}$",
            },
        },
    )


def dev_idp(settings: Settings, state: dict[str, Any]) -> DevIdentityProvider:
    return DevIdentityProvider(
        issuer=settings.identity.issuer,
        audience=settings.audience,
        key_path=DEV_IDP_KEY,
        client_secret=state["login_secret"],
    )


def dev_banner(settings: Settings, token: str) -> str:
    snippet = json.dumps(
        {
            "mcpServers": {
                "connect-broker-dev": {
                    "type": "http",
                    "url": settings.mcp_url,
                    "headers": {"Authorization": f"Bearer {token}"},
                }
            }
        },
        indent=2,
    )
    return "\n".join(
        [
            "Connect Broker development playground (DEVELOPMENT IDENTITY PROVIDER: any user name)",
            f"  MCP endpoint : {settings.mcp_url}",
            f"  Bearer token for 'alice' (12 h): {token}",
            "  Another user : connect-broker dev-token bob",
            "  Demo provider: 'demo' (API keys look like demo_abc123)",
            "  Client configuration:",
            snippet,
        ]
    )
