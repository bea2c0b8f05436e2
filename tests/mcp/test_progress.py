"""Progress notifications: an event stream only for a request that asked and a tool that reports.

The broker here is the real app (`create_app`, served by uvicorn in this process) with test tools
registered through the public tool API: one that reports progress, one that never does, one that
fails after reporting, one that reports a value going backwards and one that waits until
cancelled. Without a progress token, without `text/event-stream` in `Accept`, or from a tool that
never reports, the answer is the same plain JSON as before progress existed.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx2
import pytest
import uvicorn
from fastapi import FastAPI
from mcp import Client
from mcp.client.streamable_http import streamable_http_client

from app.config import load_settings
from app.main import create_app
from app.mcp.progress import accepts_event_stream
from app.mcp.registry import ToolCall, ToolRegistry, ToolResult

from ..support.broker import BrokerConfig, cli, drop_database, fresh_database
from ..support.clients import CLIENT_LIMITS, request_body, request_headers
from ..support.http import local_client
from ..support.idp import IdpProcess, free_port, mint_token
from ..support.schema import validate, validate_response

START_TIMEOUT = 30.0
SPOOFED = "step \u202e3\nof 3"  # a bidi override and a line break from outside text
STEPS = ((1, "first"), (2, "second"), (3, SPOOFED))


@dataclass
class Served:
    mcp_url: str
    token: str
    cancelled: asyncio.Event


def progress_app(config_path: Path, cancelled: asyncio.Event) -> FastAPI:
    registry = ToolRegistry()

    @registry.tool("steps", description="Reports three steps, then answers")
    async def steps(call: ToolCall) -> ToolResult:
        for done, message in STEPS:
            await call.report_progress(done, total=3, message=message)
        return ToolResult(text="all steps done")

    @registry.tool("silent", description="Never reports progress")
    async def silent(_call: ToolCall) -> ToolResult:
        return ToolResult(text="done without a word")

    @registry.tool("breaks", description="Reports once, then fails")
    async def breaks(call: ToolCall) -> ToolResult:
        await call.report_progress(1)
        raise RuntimeError("the tool broke after reporting")

    @registry.tool("backwards", description="Reports a value lower than the one before")
    async def backwards(call: ToolCall) -> ToolResult:
        await call.report_progress(2)
        await call.report_progress(1)
        return ToolResult(text="unreachable")

    @registry.tool("endless", description="Reports once, then waits until cancelled")
    async def endless(call: ToolCall) -> ToolResult:
        await call.report_progress(1)
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            cancelled.set()
            raise
        return ToolResult(text="unreachable")

    return create_app(load_settings(config_path), registry=registry)


@pytest.fixture(scope="module")
def config(idp: IdpProcess, workdir: Path) -> Iterator[tuple[BrokerConfig, Path]]:
    broker_config = BrokerConfig(issuer=idp.issuer, port=free_port())
    database_url = fresh_database(workdir, "progress")
    config_path = workdir / f"progress-{broker_config.port}.toml"
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
    cancelled = asyncio.Event()
    server = uvicorn.Server(
        uvicorn.Config(
            progress_app(config_path, cancelled),
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
            idp.signing_jwk, issuer=idp.issuer, audience=broker_config.mcp_url, subject="paula"
        )
        yield Served(broker_config.mcp_url, token, cancelled)
    finally:
        server.should_exit = True
        await asyncio.wait_for(task, START_TIMEOUT)


@pytest.fixture
async def http() -> AsyncIterator[httpx2.AsyncClient]:
    async with local_client(timeout=30, limits=CLIENT_LIMITS) as client:
        yield client


def call_body(tool: str, token: Any = None, *, request_id: int = 7) -> dict[str, Any]:
    body = request_body("tools/call", {"name": tool, "arguments": {}}, request_id=request_id)
    if token is not None:
        body["params"]["_meta"]["progressToken"] = token
    return body


async def post(
    http: httpx2.AsyncClient, served: Served, body: dict[str, Any], accept: str | None = None
) -> httpx2.Response:
    headers = request_headers(body, served.token)
    if accept is not None:
        headers["Accept"] = accept
    return await http.post(served.mcp_url, content=json.dumps(body).encode(), headers=headers)


def events(response: httpx2.Response) -> list[dict[str, Any]]:
    """The JSON messages of an event stream, each `data: <json>` and a blank line."""
    assert response.text.endswith("\n\n"), response.text
    messages = []
    for event in response.text.split("\n\n")[:-1]:
        assert event.startswith("data: "), event
        assert "\n" not in event, event  # one data line per event
        messages.append(json.loads(event.removeprefix("data: ")))
    return messages


async def test_L15_progress_streams_as_events_before_the_result(
    http: httpx2.AsyncClient, served: Served
) -> None:
    response = await post(http, served, call_body("steps", "tok-1"))

    assert response.status_code == 200
    assert response.headers["content-type"] == "text/event-stream"
    assert response.headers["cache-control"] == "no-store"
    *notifications, final = events(response)
    assert [n["method"] for n in notifications] == ["notifications/progress"] * 3
    for notification in notifications:
        validate(notification, "ProgressNotification")
    assert [n["params"]["progress"] for n in notifications] == [1, 2, 3]
    assert {n["params"]["progressToken"] for n in notifications} == {"tok-1"}
    assert {n["params"]["total"] for n in notifications} == {3}
    assert notifications[0]["params"]["message"] == "first"
    assert notifications[2]["params"]["message"] == "step [U+202E]3 of 3"
    validate_response(final)
    assert final["id"] == 7
    assert final["result"]["content"] == [{"type": "text", "text": "all steps done"}]


async def test_L15_an_integer_progress_token_is_echoed_as_an_integer(
    http: httpx2.AsyncClient, served: Served
) -> None:
    response = await post(http, served, call_body("steps", 42))

    *notifications, final = events(response)
    assert [n["params"]["progressToken"] for n in notifications] == [42, 42, 42]
    assert "result" in final


async def test_L15_without_a_progress_token_the_answer_is_plain_json(
    http: httpx2.AsyncClient, served: Served
) -> None:
    response = await post(http, served, call_body("steps"))

    assert response.status_code == 200
    assert response.headers["content-type"] == "application/json"
    body = response.json()
    validate_response(body)
    assert body["result"]["content"] == [{"type": "text", "text": "all steps done"}]


async def test_L15_a_client_that_does_not_accept_event_streams_gets_plain_json(
    http: httpx2.AsyncClient, served: Served
) -> None:
    for accept in ("application/json", "application/json, text/event-stream;q=0"):
        response = await post(http, served, call_body("steps", "tok-2"), accept=accept)

        assert response.headers["content-type"] == "application/json", accept
        body = response.json()
        validate_response(body)
        assert body["result"]["content"] == [{"type": "text", "text": "all steps done"}]


async def test_L15_a_tool_that_never_reports_answers_the_same_bytes_as_without_a_token(
    http: httpx2.AsyncClient, served: Served
) -> None:
    plain = await post(http, served, call_body("silent"))
    asked = await post(http, served, call_body("silent", "tok-3"))

    assert asked.status_code == plain.status_code == 200
    assert asked.content == plain.content
    assert list(asked.headers.items()) == list(plain.headers.items())


@pytest.mark.parametrize("token", [1.5, True, None, {"id": 1}, ["tok"]])
async def test_L15_a_progress_token_of_another_type_is_invalid_params(
    http: httpx2.AsyncClient, served: Served, token: Any
) -> None:
    body = call_body("steps")
    body["params"]["_meta"]["progressToken"] = token

    response = await post(http, served, body)

    assert response.status_code == 400
    answer = response.json()
    validate_response(answer)
    assert answer["error"]["code"] == -32602
    assert answer["error"]["message"] == "params._meta.progressToken must be a string or an integer"


async def test_L15_an_error_after_the_stream_started_is_its_last_event(
    http: httpx2.AsyncClient, served: Served
) -> None:
    for tool in ("breaks", "backwards"):
        response = await post(http, served, call_body(tool, "tok-4"))

        assert response.status_code == 200
        assert response.headers["content-type"] == "text/event-stream"
        *notifications, final = events(response)
        assert [n["params"]["progress"] for n in notifications] == [1 if tool == "breaks" else 2]
        validate_response(final)
        assert final["id"] == 7
        assert final["error"]["code"] == -32603
        assert final["error"]["message"] == "Internal error"
        assert "broke" not in response.text


async def test_L15_closing_the_stream_cancels_the_tool(
    http: httpx2.AsyncClient, served: Served
) -> None:
    body = call_body("endless", "tok-5")
    headers = request_headers(body, served.token)
    async with http.stream(
        "POST", served.mcp_url, content=json.dumps(body).encode(), headers=headers
    ) as response:
        assert response.headers["content-type"] == "text/event-stream"
        first = await anext(response.aiter_text())
        assert first.startswith("data: "), first

    async with asyncio.timeout(10):
        await served.cancelled.wait()


async def test_L15_the_official_client_receives_progress_through_its_callback(
    served: Served,
) -> None:
    seen: list[tuple[float, float | None, str | None]] = []

    async def on_progress(progress: float, total: float | None, message: str | None) -> None:
        seen.append((progress, total, message))

    http = local_client(headers={"Authorization": f"Bearer {served.token}"})
    async with http, Client(streamable_http_client(served.mcp_url, http_client=http)) as client:
        result = await client.call_tool("steps", {}, progress_callback=on_progress)

    assert seen == [(1, 3, "first"), (2, 3, "second"), (3, 3, "step [U+202E]3 of 3")]
    assert result.content[0].text == "all steps done"  # type: ignore[union-attr]


def test_L15_event_streams_are_accepted_only_when_listed_with_a_quality_above_zero() -> None:
    assert accepts_event_stream({"accept": "application/json, text/event-stream"})
    assert accepts_event_stream({"accept": "Text/Event-Stream; q=0.5"})
    assert not accepts_event_stream({"accept": "application/json"})
    assert not accepts_event_stream({"accept": "text/event-stream;q=0"})
    assert not accepts_event_stream({"accept": "text/event-streams"})
    assert not accepts_event_stream({})
