"""L2: slow clients cannot hold connections forever (app/serving.py).

A broker of its own, with a 1 s header deadline and a cap of a few connections. Real sockets:
a connection that sends nothing, or part of its headers, is closed once the deadline passes
(waited for with a bound, never a fixed sleep); one past the cap is answered 503 at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import uvicorn
from starlette.responses import PlainTextResponse

from app import serving as serving_module
from app.serving import guarded_protocol

from .support.broker import BrokerConfig, BrokerProcess, running_broker
from .support.idp import IdpProcess, free_port
from .support.raw_http import ANSWER_SECONDS, chunk, read_answer, request_head

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


@dataclass
class Served:
    port: int
    server: uvicorn.Server

    async def lets_go_of_its_connection(self) -> bool:
        """True once the server, having read a request, holds no connection again; False if it
        still holds one after ANSWER_SECONDS, many times the deadlines under test."""
        state = self.server.server_state
        try:
            async with asyncio.timeout(ANSWER_SECONDS):
                while not state.total_requests:  # the kernel accepts before the server reads
                    await asyncio.sleep(0.01)
                while state.connections:
                    await asyncio.sleep(0.05)
        except TimeoutError:
            return False
        return True


@contextlib.asynccontextmanager
async def serving(app: Any, http: str, *, max_connections: int = 10) -> AsyncIterator[Served]:
    """`app` served in-process on a free port with `serve`'s guarded protocol `http`."""
    port = free_port()
    config = uvicorn.Config(
        app,
        port=port,
        log_config=None,
        http=guarded_protocol(HEADER_TIMEOUT_SECONDS, max_connections, http=http),
    )
    server = uvicorn.Server(config)
    task = asyncio.create_task(server.serve())
    try:
        async with asyncio.timeout(ANSWER_SECONDS):
            while not server.started:
                await asyncio.sleep(0.02)
        yield Served(port, server)
    finally:
        server.should_exit = True
        try:  # a connection the server still holds would keep it waiting: then force it
            await asyncio.wait_for(asyncio.shield(task), ANSWER_SECONDS)
        except TimeoutError:
            server.force_exit = True
            await task


def stalled_client(port: int, request: bytes) -> socket.socket:
    """A connection that sends `request` and never reads (a small receive buffer, soon full)."""
    stalled = socket.create_connection(("127.0.0.1", port))
    stalled.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    stalled.sendall(request)
    return stalled


async def read_until_closed(reader: asyncio.StreamReader) -> int:
    """How many bytes arrive before the server ends the connection (bounded by ANSWER_SECONDS)."""
    received = 0
    async with asyncio.timeout(ANSWER_SECONDS):
        while True:
            try:
                data = await reader.read(65536)
            except ConnectionResetError:
                return received
            if not data:
                return received
            received += len(data)


async def echo_body(scope: dict[str, Any], receive: Any, send: Any) -> None:
    """Answers 200 with the size of the request body, once it has all arrived."""
    if scope["type"] != "http":
        return
    size, more = 0, True
    while more:
        message = await receive()
        if message["type"] == "http.disconnect":
            return
        size += len(message.get("body", b""))
        more = message.get("more_body", False)
    body = str(size).encode()
    headers = [(b"content-type", b"text/plain"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": body})


BIG_ANSWER = 8 * 1024 * 1024


async def big_answer(scope: dict[str, Any], receive: Any, send: Any) -> None:
    if scope["type"] != "http":
        return
    headers = [(b"content-length", str(BIG_ANSWER).encode())]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": b"x" * BIG_ANSWER})


@pytest.mark.parametrize("http", ["h11", "httptools"])
async def test_L2_headers_past_the_cap_are_answered_431_and_closed(http: str) -> None:
    """One request's headers are read up to 64 KiB: under httptools, 60 MB of them took the
    process to 1.4 GB, and a million repeats of one header held the event loop for 26 s."""
    lines = b"".join(b"a: b\r\n" for _ in range(200_000))  # 1.2 MB, never ended
    async with serving(echo_body, http) as served:
        reader, writer = await asyncio.open_connection("127.0.0.1", served.port)
        writer.write(b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\n" + lines)
        with contextlib.suppress(ConnectionError):
            await writer.drain()
        async with asyncio.timeout(ANSWER_SECONDS):
            refused = await read_answer(reader)
        assert refused.status == (431 if http == "httptools" else 400)  # h11: its own 16 KiB
        assert await closed_by_server(reader)
        writer.close()


async def refuse_at_once(scope: dict[str, Any], receive: Any, send: Any) -> None:
    """Answers 413 without reading the body, as a route past its body cap does."""
    if scope["type"] != "http":
        return
    headers = [(b"content-length", b"0")]
    await send({"type": "http.response.start", "status": 413, "headers": headers})
    await send({"type": "http.response.body", "body": b""})


@pytest.mark.parametrize("http", ["h11", "httptools"])
async def test_L2_the_rest_of_a_body_answered_early_is_not_taken_for_headers(http: str) -> None:
    """A route may answer before the body has arrived (a 413 past its cap): the rest of that
    body, however long, still arrives and is read as body, not as the next request's headers
    (which have their 64 KiB); the next request on the connection is answered."""
    head = b"POST / HTTP/1.1\r\nHost: 127.0.0.1\r\nTransfer-Encoding: chunked\r\n\r\n"
    piece = chunk(b" " * 16384)
    async with serving(refuse_at_once, http) as served:
        reader, writer = await asyncio.open_connection("127.0.0.1", served.port)
        writer.write(head + piece)
        async with asyncio.timeout(ANSWER_SECONDS):
            assert (await read_answer(reader)).status == 413
        for _ in range(16):  # 256 KiB more of the same body, after its answer
            writer.write(piece)
            await writer.drain()
        writer.write(b"0\r\n\r\n" + b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        async with asyncio.timeout(ANSWER_SECONDS):
            assert (await read_answer(reader)).status == 413  # the next request's answer
        writer.close()


@pytest.mark.parametrize("http", ["h11", "httptools"])
async def test_L2_a_body_that_stops_arriving_is_closed_after_its_deadline(
    http: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A request that declares 1,000 bytes and sends one held its connection for good (a valid
    token's holder could take every connection); a body sent in time is answered."""
    monkeypatch.setattr(serving_module, "BODY_TIMEOUT_SECONDS", 0.5)
    head = b"POST / HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 1000\r\n\r\n"
    async with serving(echo_body, http) as served:
        reader, writer = await asyncio.open_connection("127.0.0.1", served.port)
        writer.write(head + b"x")
        assert await read_until_closed(reader) == 0  # closed without an answer
        writer.close()

        reader, writer = await asyncio.open_connection("127.0.0.1", served.port)
        writer.write(head + b"x" * 500)
        await writer.drain()
        writer.write(b"y" * 500)
        async with asyncio.timeout(ANSWER_SECONDS):
            answered = await read_answer(reader)
        assert (answered.status, answered.body) == (200, b"1000")
        writer.close()


@pytest.mark.parametrize("http", ["h11", "httptools"])
async def test_L2_an_answer_the_client_does_not_read_is_cut_after_its_deadline(
    http: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A client that stops reading held its connection past every timer: once the socket's
    buffer is full, the rest of the answer has its deadline, then the server aborts the
    connection and holds it no more; a client that reads gets the whole answer."""
    monkeypatch.setattr(serving_module, "WRITE_TIMEOUT_SECONDS", 0.5)
    request = b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"
    async with serving(big_answer, http) as served:
        stalled = stalled_client(served.port, request)
        assert await served.lets_go_of_its_connection()
        stalled.close()

        reader, writer = await asyncio.open_connection("127.0.0.1", served.port)
        writer.write(request)
        async with asyncio.timeout(ANSWER_SECONDS):
            whole = await read_answer(reader)
        assert len(whole.body) == BIG_ANSWER
        writer.close()


async def test_L2_a_client_queueing_requests_it_does_not_read_is_cut_off() -> None:
    """httptools queues pipelined requests behind the one being answered: past 8 queued, the
    connection is aborted (a client that never read grew the process by 50 times what it
    sent). Eight are answered in order."""
    request = b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"
    async with serving(big_answer, "httptools") as served:
        stalled = stalled_client(served.port, request * 50)
        assert await served.lets_go_of_its_connection()
        stalled.close()

    async with serving(echo_body, "httptools") as served:
        reader, writer = await asyncio.open_connection("127.0.0.1", served.port)
        writer.write(request * 8)
        async with asyncio.timeout(ANSWER_SECONDS):
            answers = [await read_answer(reader) for _ in range(8)]
        assert [answer.status for answer in answers] == [200] * 8
        writer.close()


@pytest.mark.parametrize("http", ["h11", "httptools"])
async def test_L2_both_uvicorn_protocols_keep_the_deadline_and_the_cap(http: str) -> None:
    """`serve` runs httptools (uvicorn's "auto" when installed); h11 is its fallback. Both,
    in-process with a one-line app: the deadline closes a silent connection, the cap refuses."""
    async with serving(PlainTextResponse("ok"), http, max_connections=1) as served:
        reader, writer = await asyncio.open_connection("127.0.0.1", served.port)
        second_reader, second_writer = await asyncio.open_connection("127.0.0.1", served.port)
        async with asyncio.timeout(ANSWER_SECONDS):
            assert (await read_answer(second_reader)).status == 503
        second_writer.close()
        assert await closed_by_server(reader)
        writer.close()
