"""The response of the hot paths (MCP answers, credential fetches)."""

from __future__ import annotations

from starlette.responses import Response
from starlette.types import Receive, Scope, Send


class JsonMessage(Response):
    """A JSON response with exactly the headers Starlette's `Response` would send for it
    (the extra ones, then content-length and content-type), built and sent without its general
    header and background-task handling."""

    media_type = "application/json"

    def __init__(self, body: bytes, status: int, headers: dict[str, str] | None) -> None:
        self.status_code = status
        self.body = body
        self.background = None
        self.raw_headers = [
            (name.lower().encode("latin-1"), value.encode("latin-1"))
            for name, value in (headers or {}).items()
        ]
        self.raw_headers += (
            (b"content-length", str(len(body)).encode()),
            (b"content-type", b"application/json"),
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send(
            {"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers}
        )
        await send({"type": "http.response.body", "body": self.body})
