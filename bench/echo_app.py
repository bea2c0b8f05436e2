"""The bare reference for the benchmark: two Starlette routes, no auth, no database.

POST /mcp reads and parses the JSON body and answers a small JSON-RPC-shaped result; GET
/api/v1/credentials/{provider} answers a small JSON shaped like the broker's credential. Served
by uvicorn with the same settings as `connect-broker serve` (app/cli.py), so the ratio broker /
bare measures what the broker adds on top of the HTTP stack.
Run: `python -m bench.echo_app --port 8001`.
"""

from __future__ import annotations

import argparse
import json

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route


async def echo(request: Request) -> Response:
    message = json.loads(await request.body())
    result = {"resultType": "complete", "content": [{"type": "text", "text": "ok"}]}
    body = {"jsonrpc": "2.0", "id": message.get("id"), "result": result}
    return Response(json.dumps(body, separators=(",", ":")), media_type="application/json")


async def credential(request: Request) -> Response:
    provider = request.path_params["provider"]
    body = {"provider": provider, "kind": "api_key", "secret": "sk_bare_reference"}
    return Response(json.dumps(body, separators=(",", ":")), media_type="application/json")


app = Starlette(
    routes=[
        Route("/mcp", echo, methods=["POST"]),
        Route("/api/v1/credentials/{provider}", credential, methods=["GET"]),
    ]
)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args(argv)
    # Same options as app/cli.py `_serve` (uvicorn.run defaults otherwise: httptools, uvloop).
    uvicorn.run(
        "bench.echo_app:app",
        host=args.host,
        port=args.port,
        workers=1,
        access_log=False,
        server_header=False,
        log_config=None,
    )


if __name__ == "__main__":
    main()
