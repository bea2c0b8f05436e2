"""Steady background traffic for the reliability tests (SECURITY.md R2, R5)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from .clients import McpHttp


@dataclass(frozen=True)
class Answer:
    started: float  # loop time
    seconds: float
    status: int
    code: int | None  # the JSON-RPC error code, if any
    connected: bool  # the tool's result said "connected"


class BackgroundLoad:
    """`connect_account` calls of a user connected to `provider`, from a few workers each
    calling again 50 ms after its answer: steady traffic that reads the database."""

    def __init__(self, mcp: McpHttp, token: str, *, provider: str, workers: int = 4) -> None:
        self._mcp, self._token, self._provider = mcp, token, provider
        self._stop = asyncio.Event()
        self._tasks = [asyncio.create_task(self._work()) for _ in range(workers)]
        self.answers: list[Answer] = []

    async def _work(self) -> None:
        loop = asyncio.get_running_loop()
        while not self._stop.is_set():
            started = loop.time()
            response = await self._mcp.call_tool(
                self._token, "connect_account", {"provider": self._provider}
            )
            seconds = loop.time() - started
            body = response.json()
            error = body.get("error") if response.status_code != 200 else None
            code = error.get("code") if isinstance(error, dict) else None
            result = body.get("result") if response.status_code == 200 else None
            structured = result.get("structuredContent") if isinstance(result, dict) else None
            connected = isinstance(structured, dict) and structured.get("status") == "connected"
            self.answers.append(Answer(started, seconds, response.status_code, code, connected))
            await asyncio.sleep(0.05)

    async def stop(self) -> list[Answer]:
        self._stop.set()
        await asyncio.gather(*self._tasks)
        return self.answers
