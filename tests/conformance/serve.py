"""Run a broker with the conformance fixture tools, for the official MCP conformance suite.

    python -m tests.conformance.serve --config broker.toml --port 8123

The suite sends no credentials, so a tiny ASGI wrapper adds `Authorization: Bearer <token>` to
every request for /mcp that has none. The token is a real access token (a JWT signed by the test
IdP's key, audience = this broker's /mcp) read from the environment variable named by
`TOKEN_VARIABLE`; the broker still verifies it like any other. Everything else is the ordinary
app built by `app.main.create_app` from the TOML configuration.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

import uvicorn
from starlette.types import ASGIApp, Receive, Scope, Send

from app.config import load_settings, require_serve_ready
from app.main import create_app

from .fixtures import conformance_registry

TOKEN_VARIABLE = "CONFORMANCE_BEARER_TOKEN"
MCP_PATH = "/mcp"


class InjectBearer:
    """Add the bearer token to requests for /mcp that carry no Authorization header."""

    def __init__(self, app: ASGIApp, token: str) -> None:
        self.app = app
        self.header = (b"authorization", f"Bearer {token}".encode("ascii"))

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] == MCP_PATH:
            headers = list(scope["headers"])
            if not any(name == b"authorization" for name, _ in headers):
                scope = {**scope, "headers": [*headers, self.header]}
        await self.app(scope, receive, send)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=Path, required=True, help="broker TOML configuration")
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args(argv)
    token = os.environ.get(TOKEN_VARIABLE, "").strip()
    if not token:
        parser.error(f"set {TOKEN_VARIABLE} to the access token to inject")
    settings = load_settings(args.config)
    require_serve_ready(settings)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    app = InjectBearer(create_app(settings, registry=conformance_registry()), token)
    uvicorn.run(
        app,
        host="127.0.0.1",
        port=args.port,
        access_log=False,
        log_config=None,
        server_header=False,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
