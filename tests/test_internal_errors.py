"""A bug in a handler: the client gets a plain 500 in its own format (a page, problem JSON, or
JSON-RPC -32603) with a reference and none of the exception's text; the log gets exactly one
traceback, tagged with that reference; the broker keeps serving.

The broker here is the real app (`create_app`, served by uvicorn in this process) with three
faulty handlers added by the test: a tool registered through the public tool API, a page under
an HTML prefix and an API route. Their exception messages carry a canary that must reach
neither the answer nor the log.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx2
import pytest
import uvicorn
from fastapi import FastAPI
from starlette.requests import Request

from app.bug_report import WITHHELD
from app.config import load_settings
from app.connect.refresh import RefreshUnavailable
from app.errors import on_provider_unavailable
from app.main import create_app
from app.mcp.registry import ToolCall, ToolRegistry, ToolResult

from .support.broker import BrokerConfig, cli, drop_database, fresh_database
from .support.clients import CLIENT_LIMITS, McpHttp
from .support.http import local_client
from .support.idp import IdpProcess, free_port, mint_token
from .support.schema import validate_response

CANARY = "sk_CANARY_internal_error_0001"
PAGE_PATH = "/oauth/faulty/page"  # an HTML prefix, no real route
API_PATH = "/api/v1/faulty"
START_TIMEOUT = 30.0


class FaultyHandler(RuntimeError):
    pass


def faulty() -> None:
    raise FaultyHandler(f"the handler broke holding {CANARY}")


@dataclass(frozen=True)
class Served:
    url: str
    mcp_url: str
    token: str


def faulty_app(config_path: Path) -> FastAPI:
    registry = ToolRegistry()

    @registry.tool("faulty", description="Always fails")
    async def faulty_tool(_call: ToolCall) -> ToolResult:
        faulty()
        raise AssertionError("unreachable")

    app = create_app(load_settings(config_path), registry=registry)
    app.add_api_route(PAGE_PATH, faulty)
    app.add_api_route(API_PATH, faulty)
    return app


@pytest.fixture(scope="module")
def config(idp: IdpProcess, workdir: Path) -> Iterator[tuple[BrokerConfig, Path]]:
    broker_config = BrokerConfig(issuer=idp.issuer, port=free_port())
    database_url = fresh_database(workdir, "internal-errors")
    config_path = workdir / f"internal-errors-{broker_config.port}.toml"
    config_path.write_text(broker_config.render(database_url))
    try:
        migrated = cli("migrate", config_path=config_path)
        assert migrated.returncode == 0, migrated.stderr
        yield broker_config, config_path
    finally:
        drop_database(database_url)


@pytest.fixture(scope="module")
async def served(config: tuple[BrokerConfig, Path], idp: IdpProcess) -> AsyncIterator[Served]:
    broker_config, config_path = config
    server = uvicorn.Server(
        uvicorn.Config(
            faulty_app(config_path),
            host="127.0.0.1",
            port=broker_config.port,
            log_config=None,
            access_log=False,
        )
    )
    task = asyncio.create_task(server.serve())
    try:
        async with asyncio.timeout(START_TIMEOUT):
            while not server.started:
                assert not task.done(), "the server stopped while starting"
                await asyncio.sleep(0.05)
        token = mint_token(
            idp.signing_jwk, issuer=idp.issuer, audience=broker_config.mcp_url, subject="erin"
        )
        yield Served(broker_config.public_url, broker_config.mcp_url, token)
    finally:
        server.should_exit = True
        await asyncio.wait_for(task, START_TIMEOUT)


@pytest.fixture
async def http() -> AsyncIterator[httpx2.AsyncClient]:
    async with local_client(timeout=30, limits=CLIENT_LIMITS) as client:
        yield client


def one_tagged_traceback(caplog: pytest.LogCaptureFixture, first_line: str) -> None:
    """Exactly one error record: the broker's own, `first_line` (naming the request id), then
    the traceback's frames and the exception's type, without its message."""
    errors = [record for record in caplog.records if record.levelno >= logging.ERROR]
    assert len(errors) == 1, [(record.name, record.getMessage()) for record in errors]
    (record,) = errors
    text = record.getMessage()
    assert text.startswith(f"{first_line}\nTraceback (most recent call last):\n"), text
    assert 'raise FaultyHandler(f"the handler broke holding {CANARY}")' in text  # the frame
    assert text.endswith(f"tests.test_internal_errors.FaultyHandler: {WITHHELD}"), text
    assert CANARY not in text
    assert record.exc_info is None  # a handler would print the message with the traceback


def access_rid(caplog: pytest.LogCaptureFixture, path: str) -> str:
    (line,) = [r.getMessage() for r in caplog.records if r.name == "broker.access"]
    assert line.startswith(f"POST {path} 500 "), line
    return line.rsplit("rid=", 1)[1]


async def still_serving(http: httpx2.AsyncClient, served: Served) -> None:
    assert (await http.get(f"{served.url}/healthz")).status_code == 200


async def test_page_bug_is_one_page_and_one_tagged_traceback(
    served: Served, http: httpx2.AsyncClient, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    response = await http.get(f"{served.url}{PAGE_PATH}")
    assert response.status_code == 500
    assert response.headers["content-type"].startswith("text/html")
    assert "Something went wrong" in response.text
    assert CANARY not in response.text and "FaultyHandler" not in response.text
    reference = re.search(r"Reference ([0-9a-f]{16})\b", response.text)
    assert reference is not None, response.text
    one_tagged_traceback(caplog, f"unexpected error rid={reference.group(1)}")
    await still_serving(http, served)


async def test_api_bug_is_problem_json_and_one_traceback(
    served: Served, http: httpx2.AsyncClient, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    response = await http.get(f"{served.url}{API_PATH}")
    assert response.status_code == 500
    assert response.headers["content-type"] == "application/problem+json"
    body = response.json()
    reference = body.pop("instance").removeprefix("urn:connect-broker:request:")
    assert body == {
        "type": "urn:connect-broker:error:internal_error",
        "title": "Something went wrong",
        "status": 500,
        "detail": "An unexpected error occurred; it has been logged under this answer's reference.",
    }
    assert CANARY not in response.text
    one_tagged_traceback(caplog, f"unexpected error rid={reference}")
    await still_serving(http, served)


async def test_tool_bug_is_jsonrpc_internal_error_and_one_traceback(
    served: Served, http: httpx2.AsyncClient, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    mcp = McpHttp(served.mcp_url)
    try:
        response = await mcp.call_tool(served.token, "faulty")
    finally:
        await mcp.aclose()
    assert response.status_code == 500
    body = response.json()
    validate_response(body)
    reference = access_rid(caplog, "/mcp")
    assert body["error"] == {
        "code": -32603,
        "message": "Internal error",
        "data": {"reference": reference},
    }
    assert CANARY not in response.text
    one_tagged_traceback(caplog, f"mcp.internal_error rid={reference}")
    await still_serving(http, served)


@pytest.mark.parametrize(
    ("path", "kind"), [("/api/v1/credentials/demo", "problem"), ("/connect/x", "page")]
)
async def test_a_provider_that_cannot_refresh_is_said_to_be_the_provider(
    path: str, kind: str
) -> None:
    """Answered as a short unavailability (503, Retry-After), but as the provider's: it was
    worded and logged as the broker's database being unreachable."""
    request = Request({"type": "http", "method": "GET", "path": path, "headers": [], "state": {}})

    answer = await on_provider_unavailable(request, RefreshUnavailable())

    assert answer.status_code == 503
    assert answer.headers["retry-after"] == "5"
    text = bytes(answer.body).decode()
    assert "provider" in text and "database" not in text
    if kind == "problem":
        assert json.loads(text)["type"] == "urn:connect-broker:error:provider_unavailable"
    else:
        assert answer.headers["content-type"].startswith("text/html")
