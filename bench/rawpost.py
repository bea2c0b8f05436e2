"""Thousands of POSTs at once from one process, cheaply enough that the figures are the server's.

A general HTTP client spends about a millisecond of CPU per request on its own bookkeeping; with
5,000 requests in flight in one process, that client was still sending bodies and reading answers
long after the server had answered (docs/benchmarks.md). Here each request is one connection
with its bytes prepared before the first is sent (`Connection: close`), and its answer is read by
`Content-Length`: the client's cost per request is a connect, one write and two reads.

Only what the broker answers is understood: a status line, headers, and a body of the stated
length. Anything else is a `RawPostError`.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping
from dataclasses import dataclass
from urllib.parse import urlsplit


class RawPostError(Exception):
    """An answer this client does not understand, or none."""


@dataclass(frozen=True)
class Target:
    host: str
    port: int
    path: str

    @classmethod
    def of(cls, url: str) -> Target:
        parts = urlsplit(url)
        if parts.scheme != "http" or parts.hostname is None:
            raise RawPostError(f"only plain http:// URLs are supported, not {url!r}")
        return cls(parts.hostname, parts.port or 80, parts.path or "/")


@dataclass(frozen=True)
class Answer:
    status: int
    body: bytes
    sent_at: float  # time.monotonic() once the request was written
    read_at: float  # time.monotonic() once the whole answer was read


def request_bytes(target: Target, headers: Mapping[str, str], body: bytes) -> bytes:
    lines = [
        f"POST {target.path} HTTP/1.1",
        f"Host: {target.host}:{target.port}",
        "Connection: close",
        f"Content-Length: {len(body)}",
        *(f"{name}: {value}" for name, value in headers.items()),
    ]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body


async def post(target: Target, request: bytes) -> Answer:
    """Send `request` (from `request_bytes`) on a connection of its own; its answer. The caller
    bounds the wait (`asyncio.timeout`)."""
    reader, writer = await asyncio.open_connection(target.host, target.port)
    try:
        writer.write(request)
        await writer.drain()
        sent_at = time.monotonic()
        head = await reader.readuntil(b"\r\n\r\n")
        status, length = _parse_head(head)
        body = await reader.readexactly(length)
        return Answer(status, body, sent_at, time.monotonic())
    finally:
        writer.close()


def _parse_head(head: bytes) -> tuple[int, int]:
    """The status and Content-Length of a response head."""
    status_line, *header_lines = head.decode("latin-1").split("\r\n")
    parts = status_line.split(" ", 2)
    if len(parts) < 2 or not parts[0].startswith("HTTP/1.") or not parts[1].isdigit():
        raise RawPostError(f"not an HTTP/1.x status line: {status_line[:80]!r}")
    for line in header_lines:
        name, _, value = line.partition(":")
        if name.strip().lower() == "content-length" and value.strip().isdigit():
            return int(parts[1]), int(value.strip())
    raise RawPostError(f"HTTP {parts[1]} answer without a Content-Length")
