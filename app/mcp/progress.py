"""Progress notifications on an SSE answer, for a request that asked for them.

A request asks with `params._meta.progressToken` (a string or an integer, checked with the rest of
`_meta` in app/mcp/envelope.py). The endpoint answers in one JSON response unless all three hold:
the request carries a token, its `Accept` lists `text/event-stream`, and the tool reports progress
(`ToolCall.report_progress`) before it returns. Then the answer becomes a Streamable HTTP event
stream (spec/DIGEST.md §3.2): the response starts at the first report (200, `text/event-stream`),
each report is one `notifications/progress` event, and the JSON-RPC response, result or error, is
the last event. A tool that never reports is answered in JSON byte for byte as without a token.

Closing the stream cancels the request: the tool is cancelled and nothing more is sent.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
from collections.abc import Awaitable, Callable
from typing import Any

from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from app import jsonbytes
from app.display import display_text
from app.json_message import JsonMessage
from app.mcp.envelope import HeaderMap, ProgressToken

EVENT_STREAM = "text/event-stream"
MESSAGE_LIMIT = 200  # characters of a progress message the client is shown
STREAM_HEADERS = [
    (b"content-type", EVENT_STREAM.encode()),
    (b"cache-control", b"no-store"),
    (b"x-accel-buffering", b"no"),  # a buffering proxy (nginx) would hold the events back
]


def accepts_event_stream(headers: HeaderMap) -> bool:
    """Whether the request's `Accept` lists `text/event-stream` (with a quality above 0)."""
    for item in headers.get("accept", "").split(","):
        media_type, *parameters = item.split(";")
        if media_type.strip().lower() != EVENT_STREAM:
            continue
        return not any(p.replace(" ", "").lower() in ("q=0", "q=0.0") for p in parameters)
    return False


def _number(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ValueError(f"progress {name} must be a finite number")
    return value


class ProgressReporter:
    """The progress of one request, sent as events on its answer; the first report starts it."""

    def __init__(self, token: ProgressToken, send: Send) -> None:
        self._token = token
        self._send = send
        self._last: float | None = None
        self._lock = asyncio.Lock()  # reports from concurrent tasks go out one at a time
        self.started = False
        self._finished = False

    async def report(
        self, progress: float, total: float | None = None, message: str | None = None
    ) -> None:
        """Send one `notifications/progress`; a report after the answer is dropped.

        Raises:
            ValueError: `progress` or `total` is not a finite number, `progress` is not above the
                last report's, or `message` is not text.
        """
        params: dict[str, Any] = {
            "progressToken": self._token,
            "progress": _number("progress", progress),
        }
        if total is not None:
            params["total"] = _number("total", total)
        if message is not None:
            if not isinstance(message, str):
                raise ValueError("a progress message must be text")
            params["message"] = display_text(message, MESSAGE_LIMIT)
        async with self._lock:
            if self._finished:
                return
            if self._last is not None and progress <= self._last:
                raise ValueError("progress must increase with each report")
            self._last = progress
            if not self.started:
                self.started = True
                await self._send(
                    {"type": "http.response.start", "status": 200, "headers": STREAM_HEADERS}
                )
            notification = {"jsonrpc": "2.0", "method": "notifications/progress", "params": params}
            await self._event(jsonbytes.dumps(notification), more=True)

    async def finish(self, answer: JsonMessage, scope: Scope, receive: Receive) -> None:
        """Send the JSON-RPC response: the last event of a stream, or else the JSON answer."""
        async with self._lock:
            self._finished = True
            if self.started:
                await self._event(bytes(answer.body), more=False)
            else:
                await answer(scope, receive, self._send)

    async def _event(self, data: bytes, *, more: bool) -> None:
        body = b"data: " + data + b"\n\n"  # compact JSON: one line, so one data field
        await self._send({"type": "http.response.body", "body": body, "more_body": more})


Answer = Callable[[ProgressReporter], Awaitable[JsonMessage]]


class ProgressAnswer(Response):
    """The answer of a request that may report progress: `answer` runs as the response is sent,
    with a reporter that turns it into an event stream at the first report."""

    def __init__(self, token: ProgressToken, answer: Answer) -> None:
        self.status_code = 200
        self.background = None
        self._token = token
        self._answer = answer

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        reporter = ProgressReporter(self._token, send)
        work = asyncio.ensure_future(self._answer(reporter))
        closed = asyncio.ensure_future(_closed(receive))
        try:
            await asyncio.wait((work, closed), return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:  # the server is stopping
            work.cancel()
            raise
        finally:
            closed.cancel()
        if not work.done():  # the client went away: the request is cancelled
            work.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await work
            return
        await reporter.finish(work.result(), scope, receive)


async def _closed(receive: Receive) -> None:
    """Returns when the client disconnects (the request body has been read already)."""
    while (await receive())["type"] != "http.disconnect":
        pass
