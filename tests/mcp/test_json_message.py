"""JsonMessage, the response of every MCP answer, sends what Starlette's Response sends."""

from __future__ import annotations

from typing import Any

import pytest
from starlette.responses import Response

from app.json_message import JsonMessage

BODY = b'{"jsonrpc":"2.0","id":1,"result":{}}'


async def sent(response: Response) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return {"type": "http.disconnect"}

    async def send(message: Any) -> None:
        messages.append(dict(message))

    await response({"type": "http", "method": "POST"}, receive, send)
    return messages


@pytest.mark.parametrize(
    ("status", "headers"),
    [
        (200, None),
        (400, {}),
        (401, {"WWW-Authenticate": 'Bearer resource_metadata="https://b.example/x"'}),
        (503, {"Retry-After": "5", "X-Extra": "é"}),
    ],
)
async def test_the_same_messages_as_starlette(status: int, headers: dict[str, str] | None) -> None:
    ours = await sent(JsonMessage(BODY, status, headers))
    starlettes = await sent(
        Response(BODY, status_code=status, media_type="application/json", headers=headers)
    )

    assert ours == starlettes
    assert (
        JsonMessage(BODY, status, headers).headers
        == Response(
            BODY, status_code=status, media_type="application/json", headers=headers
        ).headers
    )
