"""L1: every request body is capped, and read only after its sender is authenticated.

A body is refused at its route's cap as it arrives (`server.max_body_bytes` for /mcp,
`server.max_api_body_bytes` for /api/v1 and the browser forms), whether it declares its length or
comes chunked, and in its surface's own shape: a JSON-RPC error for /mcp, problem JSON for
/api/v1, a page for a form. The bodies here never end: a server that reads to the end before
answering never answers (tests/support/raw_http.py), so each test also shows that nothing past the
cap was waited for.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from app.config import ServerSettings

from .integration_api.test_api import fresh_name, register
from .support.broker import BrokerProcess
from .support.clients import Browser, request_body, request_headers
from .support.raw_http import chunk, exchange, request_head

API_CAP = ServerSettings().max_api_body_bytes
MCP_CAP = ServerSettings().max_body_bytes
HUGE = 105 * 1024 * 1024  # the size of the body the cap was first measured with
REQUIRE = "/api/v1/connections/demo/require"


@pytest.fixture(scope="module")
def secret(broker: BrokerProcess) -> str:
    return register(broker, fresh_name("capped")).secret


def api_head(port: int, secret: str, **framing: str) -> bytes:
    headers = {"Authorization": f"Bearer {secret}", "Content-Type": "application/json"}
    return request_head("POST", REQUIRE, port, {**headers, **framing})


def problem(answer_body: bytes) -> dict[str, Any]:
    document: dict[str, Any] = json.loads(answer_body)
    return document


async def test_L1_api_wrong_secret_is_refused_before_the_body_is_read(
    broker: BrokerProcess,
) -> None:
    """A wrong secret with a 105 MB body announced: 401 at once, none of the body read."""
    head = api_head(broker.config.port, "cbs_wrong", **{"Content-Length": str(HUGE)})
    answer = await exchange(broker.config.port, head, [b"[" * 1024])
    assert answer.status == 401
    assert answer.headers["content-type"] == "application/problem+json"
    assert problem(answer.body)["type"] == "urn:connect-broker:error:invalid_service_credentials"


async def test_L1_api_body_over_cap_is_413_before_read(broker: BrokerProcess, secret: str) -> None:
    """A declared length past the cap: problem JSON 413 before any of the body is sent."""
    head = api_head(broker.config.port, secret, **{"Content-Length": str(HUGE)})
    answer = await exchange(broker.config.port, head)
    assert answer.status == 413
    assert answer.headers["content-type"] == "application/problem+json"
    assert problem(answer.body)["type"] == "urn:connect-broker:error:payload_too_large"


async def test_L1_api_chunked_body_is_refused_at_the_cap(
    broker: BrokerProcess, secret: str
) -> None:
    """No Content-Length: the chunks are counted as they arrive and the cap ends the read."""
    head = api_head(broker.config.port, secret, **{"Transfer-Encoding": "chunked"})
    parts = [chunk(b" " * 4096) for _ in range(2 * API_CAP // 4096)]
    answer = await exchange(broker.config.port, head, parts)
    assert answer.status == 413
    assert problem(answer.body)["type"] == "urn:connect-broker:error:payload_too_large"


async def test_L1_api_body_under_cap_still_reaches_the_route(
    broker: BrokerProcess, secret: str
) -> None:
    """The body read before the route is the one the route validates (here: not JSON, 422)."""
    head = api_head(broker.config.port, secret, **{"Content-Length": "5"})
    answer = await exchange(broker.config.port, head, [b"{nope"])
    assert answer.status == 422
    assert problem(answer.body)["type"] == "urn:connect-broker:error:invalid_request"


async def test_L1_form_chunked_body_is_refused_at_the_cap(
    broker: BrokerProcess, browser: Browser
) -> None:
    """A signed-in user's form posted as endless `&`: a 413 page at the cap, not parsed."""
    await browser.login_as(fresh_name("former"))
    headers = browser._headers(
        {
            "Origin": broker.url,
            "Content-Type": "application/x-www-form-urlencoded",
            "Transfer-Encoding": "chunked",
        }
    )
    head = request_head("POST", "/logout", broker.config.port, headers)
    parts = [chunk(b"&" * 4096) for _ in range(2 * API_CAP // 4096)]
    answer = await exchange(broker.config.port, head, parts)
    assert answer.status == 413
    assert answer.headers["content-type"].startswith("text/html")
    assert b"too large for this address" in answer.body


async def test_L1_mcp_body_over_cap_is_a_json_rpc_413(
    broker: BrokerProcess, token_for: Any
) -> None:
    """/mcp: a chunked body past `server.max_body_bytes` ends in a JSON-RPC error, and a wrong
    token is refused before a byte of an announced 105 MB body."""
    port = broker.config.port
    body = request_body("tools/list")
    headers = request_headers(body, token_for(fresh_name("capped")))
    head = request_head("POST", "/mcp", port, {**headers, "Transfer-Encoding": "chunked"})
    parts = [chunk(b" " * 16384) for _ in range(2 * MCP_CAP // 16384)]
    answer = await exchange(port, head, parts)
    assert answer.status == 413
    assert json.loads(answer.body)["error"]["code"] == -32600

    wrong = request_headers(body, "not-a-token")
    head = request_head("POST", "/mcp", port, {**wrong, "Content-Length": str(HUGE)})
    answer = await exchange(port, head)
    assert answer.status == 401
