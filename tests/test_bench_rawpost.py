"""bench/rawpost.py, the waiting scenario's client: what it sends, what it reads, and what it
refuses to guess about, against a local server that answers a canned response."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest

from bench.rawpost import RawPostError, Target, post, request_bytes


@asynccontextmanager
async def answering(response: bytes) -> AsyncIterator[tuple[Target, list[bytes]]]:
    """A server on 127.0.0.1 that reads one request (head and Content-Length body), writes
    `response` and closes; the requests it read."""
    received: list[bytes] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        length = next(
            int(line.split(b":", 1)[1])
            for line in head.split(b"\r\n")
            if line.lower().startswith(b"content-length:")
        )
        received.append(head + await reader.readexactly(length))
        writer.write(response)
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    async with server:
        yield Target.of(f"http://127.0.0.1:{port}/mcp"), received


async def test_a_post_sends_its_headers_and_body_and_reads_the_answer_by_its_length() -> None:
    response = (
        b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 11\r\n\r\n"
        b'{"ok":true}'
    )
    async with answering(response) as (target, received):
        request = request_bytes(target, {"Authorization": "Bearer t"}, b'{"id":1}')
        answer = await post(target, request)

    assert (answer.status, answer.body) == (200, b'{"ok":true}')
    assert answer.sent_at <= answer.read_at
    assert received == [request]
    head, body = request.split(b"\r\n\r\n")
    assert body == b'{"id":1}'
    assert head.split(b"\r\n") == [
        b"POST /mcp HTTP/1.1",
        f"Host: 127.0.0.1:{target.port}".encode(),
        b"Connection: close",
        b"Content-Length: 8",
        b"Authorization: Bearer t",
    ]


@pytest.mark.parametrize(
    ("response", "message"),
    [
        (
            b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n0\r\n\r\n",
            "without a Content-Length",
        ),
        (b"SSH-2.0-OpenSSH\r\n\r\n", "not an HTTP/1.x status line"),
    ],
)
async def test_an_answer_not_read_by_length_is_an_error(response: bytes, message: str) -> None:
    async with answering(response) as (target, _received):
        with pytest.raises(RawPostError, match=message):
            await post(target, request_bytes(target, {}, b"{}"))


async def test_an_answer_cut_short_is_an_error() -> None:
    async with answering(b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\n{}") as (target, _):
        with pytest.raises(asyncio.IncompleteReadError):
            await post(target, request_bytes(target, {}, b"{}"))


@pytest.mark.parametrize("url", ["https://127.0.0.1/mcp", "127.0.0.1:8000/mcp"])
def test_only_plain_http_urls_are_taken(url: str) -> None:
    with pytest.raises(RawPostError, match="only plain http://"):
        Target.of(url)
