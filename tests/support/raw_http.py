"""HTTP/1.1 on a bare socket, for what an HTTP client library will not send: a body that never
ends, a Content-Length nothing follows, headers left half-written."""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from dataclasses import dataclass

ANSWER_SECONDS = 10.0  # a bound on waiting for an answer; the answers expected come at once


@dataclass(frozen=True)
class RawAnswer:
    status: int
    headers: dict[str, str]  # lower-case names; the last of repeated headers
    body: bytes


def request_head(method: str, path: str, port: int, headers: dict[str, str]) -> bytes:
    lines = [f"{method} {path} HTTP/1.1", f"Host: 127.0.0.1:{port}"]
    lines += [f"{name}: {value}" for name, value in headers.items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


def chunk(data: bytes) -> bytes:
    """One chunk of a `Transfer-Encoding: chunked` body."""
    return f"{len(data):x}\r\n".encode() + data + b"\r\n"


async def exchange(port: int, head: bytes, body: Iterable[bytes] = ()) -> RawAnswer:
    """Send `head` and the parts of `body`, then wait for the answer without sending more: a
    server that waits for the rest of the body (a Content-Length not met, no last chunk) never
    answers, and the bound `ANSWER_SECONDS` fails the test."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(head)
        for part in body:
            writer.write(part)
            await writer.drain()
        async with asyncio.timeout(ANSWER_SECONDS):
            return await read_answer(reader)
    finally:
        writer.close()


async def read_answer(reader: asyncio.StreamReader) -> RawAnswer:
    head = await reader.readuntil(b"\r\n\r\n")
    status_line, *header_lines = head.decode("latin-1").split("\r\n")
    headers = {}
    for line in header_lines:
        if line:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
    body = await reader.readexactly(int(headers.get("content-length", "0")))
    return RawAnswer(int(status_line.split()[1]), headers, body)
