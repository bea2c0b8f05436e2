"""R1, shortened for CI: sustained `tools/call` load from wrk (32 connections) on users who have a
credential, after a warm-up; two back-to-back 30 s windows stand for R1's minute 1 and minute 2.

Checked: no error of any kind, every answer the tool's real result, the broker's memory flat
from the first window to the second (R1's leak check), and on PostgreSQL no more database
connections than the configured pools hold. Speed is the benchmark's business (bench/run.py), so
the latency wrk reports is not asserted here.

On PostgreSQL the load is R1's closed loop (each connection sends again as soon as it is
answered), which is what fills the pools the check counts. On SQLite, where no connections are
counted, each connection pauses PACED_MS between requests (at most about 1,300 a second, tens of
thousands a window for the leak check), so the run no longer takes both CPUs from the rest of
the suite for a minute.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import asyncpg
import pytest

from bench.pool import call_body, write_pool
from bench.wrk import WrkResult, run_wrk

from .conftest import DEMO_PROVIDER
from .connect import open_flow, submit_key, unique
from .mcp.test_retry import API_KEY, tool_result
from .support.broker import PG_ADMIN, database_kind
from .support.clients import Browser, McpHttp
from .support.stack import Stack, running_stack

pytestmark = [pytest.mark.both_databases, pytest.mark.slow]

USERS = 50
CONNECTIONS = 32
WARM_UP_SECONDS = 5
WINDOW_SECONDS = 30
RSS_GROWTH_LIMIT = 0.10  # R1: no RSS growth > 10% between minute 1 and minute 2
POOL_SIZE = 10
PACED_MS = 25
MIN_WINDOW_REQUESTS = 10_000  # what the leak check needs to mean something, paced or not


@pytest.fixture(scope="module")
def stack(workdir: Path) -> Iterator[Stack]:
    with running_stack(
        workdir,
        "sustained",
        providers={"demo": DEMO_PROVIDER},
        extra={"database": {"pool_size": POOL_SIZE}},
    ) as stack:
        yield stack


async def _connect_demo(stack: Stack, user: str, limit: asyncio.Semaphore) -> str:
    """The user's API key stored through the real flow; their token for the load."""
    token = stack.token(user)
    async with limit:
        mcp, browser = McpHttp(stack.broker.mcp_url), Browser(stack.broker.url)
        try:
            flow_id = await open_flow(mcp, token)
            await browser.login_as(user, next_path=f"/connect/{flow_id}")
            assert (await submit_key(browser, flow_id, API_KEY)).status_code == 303
            answer = tool_result(
                await mcp.call_tool(token, "connect_account", {"provider": "demo"})
            )
            assert answer["structuredContent"]["status"] == "connected", answer
        finally:
            await mcp.aclose()
            await browser.aclose()
    return token


def _rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError(f"no VmRSS for process {pid}")


async def _broker_connections(database_url: str) -> int:
    """Connections to the broker's PostgreSQL database, this check's own not counted."""
    connection = await asyncpg.connect(PG_ADMIN.replace("postgresql://", "postgres://"))
    try:
        count = await connection.fetchval(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = $1 AND pid <> pg_backend_pid()",
            database_url.rsplit("/", 1)[1],
        )
    finally:
        await connection.close()
    return int(count)


async def test_r1_sustained_load_has_no_errors_no_leak_and_stays_within_the_pools(
    stack: Stack, tmp_path: Path
) -> None:
    limit = asyncio.Semaphore(10)
    tokens = await asyncio.gather(
        *(_connect_demo(stack, unique(f"r1-{n}"), limit) for n in range(USERS))
    )
    pool = write_pool(tmp_path / "r1-pool.txt", [(token, call_body()) for token in tokens])
    broker = stack.broker
    pid = broker.process.pid

    pause_ms = PACED_MS if database_kind() == "sqlite" else 0

    def load(seconds: int) -> WrkResult:
        return run_wrk(
            broker.mcp_url,
            pool,
            '"connected"',
            duration=seconds,
            connections=CONNECTIONS,
            pause_ms=pause_ms,
        )

    await asyncio.to_thread(load, WARM_UP_SECONDS)
    windows: list[tuple[WrkResult, int]] = []
    peak_connections = 0
    for _ in range(2):
        running = asyncio.create_task(asyncio.to_thread(load, WINDOW_SECONDS))
        while not running.done():
            if database_kind() == "postgresql":
                connections = await _broker_connections(broker.database_url)
                peak_connections = max(peak_connections, connections)
            await asyncio.sleep(1)
        windows.append((await running, _rss_kib(pid)))

    assert broker.process.poll() is None
    for result, _ in windows:
        assert result.requests >= MIN_WINDOW_REQUESTS and result.issued >= result.requests
        assert (result.non_2xx, result.socket_errors, result.unexpected) == (0, 0, 0), result
    (_, first_rss), (_, second_rss) = windows
    assert second_rss <= first_rss * (1 + RSS_GROWTH_LIMIT), (first_rss, second_rss)
    if database_kind() == "postgresql":
        # the ORM's pool (pool_size + the same overflow) and the direct store's pool
        assert 0 < peak_connections <= 3 * POOL_SIZE, peak_connections
