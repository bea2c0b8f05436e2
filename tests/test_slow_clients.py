"""L2: slow clients cannot hold connections forever (app/serving.py).

A broker of its own, with a 1 s header deadline and a cap of a few connections. Real sockets:
a connection that sends nothing, or part of its headers, is closed once the deadline passes
(waited for with a bound, never a fixed sleep); one past the cap is answered 503 at once.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import uvicorn
from starlette.responses import PlainTextResponse

from app.serving import guarded_protocol

from .support.broker import BrokerConfig, BrokerProcess, running_broker
from .support.idp import IdpProcess, free_port
from .support.raw_http import ANSWER_SECONDS, read_answer, request_head

HEADER_TIMEOUT_SECONDS = 1
MAX_CONNECTIONS = 6


@pytest.fixture(scope="module")
def slow_broker(idp: IdpProcess, workdir: Path) -> Iterator[BrokerProcess]:
    config = BrokerConfig(
        issuer=idp.issuer,
        extra={
            "server": {
                "header_timeout_seconds": HEADER_TIMEOUT_SECONDS,
                "max_connections": MAX_CONNECTIONS,
            }
        },
    )
    with running_broker(config, workdir, name="slow") as broker:
        yield broker


Connection = tuple[asyncio.StreamReader, asyncio.StreamWriter]


@contextlib.asynccontextmanager
async def connected(broker: BrokerProcess) -> AsyncIterator[Connection]:
    reader, writer = await asyncio.open_connection("127.0.0.1", broker.config.port)
    try:
        yield reader, writer
    finally:
        writer.close()


async def closed_by_server(reader: asyncio.StreamReader) -> bool:
    """True once the server closes the connection (end of stream, or a reset); False if it is
    still open after ANSWER_SECONDS, many times the deadline."""
    try:
        async with asyncio.timeout(ANSWER_SECONDS):
            return await reader.read() == b""
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


def healthz(broker: BrokerProcess) -> bytes:
    return request_head("GET", "/healthz", broker.config.port, {})


async def test_L2_silent_connection_is_closed_after_the_header_deadline(
    slow_broker: BrokerProcess,
) -> None:
    async with connected(slow_broker) as (reader, _writer):
        assert await closed_by_server(reader)


async def test_L2_half_sent_headers_are_closed_after_the_header_deadline(
    slow_broker: BrokerProcess,
) -> None:
    async with connected(slow_broker) as (reader, writer):
        writer.write(healthz(slow_broker)[:20])
        assert await closed_by_server(reader)


async def test_L2_next_request_on_a_kept_alive_connection_has_the_same_deadline(
    slow_broker: BrokerProcess,
) -> None:
    """After an answer the connection is kept alive; a next request's headers, once begun, are
    due within the deadline like the first's."""
    async with connected(slow_broker) as (reader, writer):
        writer.write(healthz(slow_broker))
        answer = await read_answer(reader)
        assert answer.status == 200
        writer.write(healthz(slow_broker)[:20])
        assert await closed_by_server(reader)


async def test_L2_headers_completed_in_pieces_within_the_deadline_are_answered(
    slow_broker: BrokerProcess,
) -> None:
    async with connected(slow_broker) as (reader, writer):
        head = healthz(slow_broker)
        writer.write(head[:10])
        await writer.drain()
        writer.write(head[10:])
        async with asyncio.timeout(ANSWER_SECONDS):
            assert (await read_answer(reader)).status == 200


async def test_L2_connections_past_the_cap_are_refused_with_503(
    slow_broker: BrokerProcess,
) -> None:
    """The cap's connections are held open in keep-alive (after an answer: no header deadline
    runs); one more gets 503 and is closed; once one closes, a new one is served."""
    async with contextlib.AsyncExitStack() as stack:
        held = [
            await stack.enter_async_context(connected(slow_broker)) for _ in range(MAX_CONNECTIONS)
        ]
        for reader, writer in held:
            writer.write(healthz(slow_broker))
            assert (await read_answer(reader)).status == 200

        async with connected(slow_broker) as (reader, _writer):
            async with asyncio.timeout(ANSWER_SECONDS):
                refused = await read_answer(reader)
            assert refused.status == 503
            assert refused.headers["retry-after"] == "1"
            assert await closed_by_server(reader)

        held[0][1].close()
        served = await _served_once_a_place_is_free(slow_broker)
        assert served == 200
    assert await slow_broker.log_shows("serve.connections_full max_connections=6")


async def _served_once_a_place_is_free(broker: BrokerProcess) -> int:
    """The status of a /healthz on a new connection, retried (bounded) while the server has
    not yet seen the freed connection close."""
    async with asyncio.timeout(ANSWER_SECONDS):
        while True:
            async with connected(broker) as (reader, writer):
                writer.write(healthz(broker))
                answer = await read_answer(reader)
            if answer.status != 503:
                return answer.status
            await asyncio.sleep(0.05)


@pytest.mark.parametrize("http", ["h11", "httptools"])
async def test_L2_both_uvicorn_protocols_keep_the_deadline_and_the_cap(http: str) -> None:
    """`serve` runs httptools (uvicorn's "auto" when installed); h11 is its fallback. Both,
    in-process with a one-line app: the deadline closes a silent connection, the cap refuses."""
    port = free_port()
    config = uvicorn.Config(
        PlainTextResponse("ok"),
        port=port,
        log_config=None,
        http=guarded_protocol(HEADER_TIMEOUT_SECONDS, 1, http=http),
    )
    server = uvicorn.Server(config)
    serving = asyncio.create_task(server.serve())
    try:
        async with asyncio.timeout(ANSWER_SECONDS):
            while not server.started:
                await asyncio.sleep(0.02)
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        second_reader, second_writer = await asyncio.open_connection("127.0.0.1", port)
        async with asyncio.timeout(ANSWER_SECONDS):
            assert (await read_answer(second_reader)).status == 503
        second_writer.close()
        assert await closed_by_server(reader)
        writer.close()
    finally:
        server.should_exit = True
        await serving
