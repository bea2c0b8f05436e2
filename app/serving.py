"""The HTTP protocol `serve` runs: uvicorn's, with a header deadline and a connection cap.

uvicorn (0.54, httptools and h11 alike) arms no timer on a connection until a request's headers
are complete: its keep-alive timer starts after an answer. A client that opens a connection, or
sends part of its headers, and then nothing, holds the connection and its descriptor for as long
as it likes, and about a thousand of them exhaust a process limited to 1,024 descriptors.
`limit_concurrency` does not help: it answers 503 once headers are complete, which these never
are; `h11_max_incomplete_event_size` bounds the size of headers, not the time they take.

So each connection gets `header_timeout` seconds from its opening, and from the first byte of
each later request, to complete its headers; past it the connection is closed. And a process
holds at most `max_connections`: one more is answered 503 and closed at once. The time a body
takes to arrive, after its headers, is bounded by the routes' own body caps, not by a deadline.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from typing import Any, cast

from uvicorn.protocols.http.h11_impl import H11Protocol

logger = logging.getLogger("broker")
FULL_LOG_INTERVAL_SECONDS = 60  # a process at its connection cap says so at most this often
FULL = (
    b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: text/plain; charset=utf-8\r\n"
    b"retry-after: 1\r\nconnection: close\r\ncontent-length: 42\r\n\r\n"
    b"Too many open connections; retry shortly.\n"
)
_last_full_log = 0.0


class _Guard:
    """Mixed in before a uvicorn HTTP protocol class (which sets `connections`, `transport`,
    `cycle` and `loop`)."""

    connections: set[Any]
    transport: asyncio.Transport
    cycle: Any
    loop: asyncio.AbstractEventLoop

    def __init__(self, *args: Any, header_timeout: float, max_connections: int, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._header_timeout = header_timeout
        self._max_connections = max_connections
        self._header_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)  # type: ignore[misc]
        if len(self.connections) > self._max_connections:
            _log_full(self._max_connections)
            self.transport.write(FULL)
            self.transport.close()
            return
        self._arm()

    def data_received(self, data: bytes) -> None:
        """A request after an answer gets its deadline from its first bytes, armed only when
        those bytes leave its headers incomplete: a whole request in one read (the usual case on
        a kept-alive connection) then costs no timer."""
        starts_request = self._header_timer is None and self._between_requests()
        super().data_received(data)  # type: ignore[misc]
        if self._header_timer is not None:
            if not self._between_requests():
                self._header_timer.cancel()  # the headers are complete
                self._header_timer = None
        elif starts_request and self._between_requests():
            self._arm()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None
        super().connection_lost(exc)  # type: ignore[misc]

    def _between_requests(self) -> bool:
        return self.cycle is None or bool(self.cycle.response_complete)

    def _arm(self) -> None:
        self._header_timer = self.loop.call_later(self._header_timeout, self._headers_late)

    def _headers_late(self) -> None:
        self._header_timer = None
        if not self.transport.is_closing():
            self.transport.close()


def _log_full(limit: int) -> None:
    global _last_full_log
    now = time.monotonic()
    if now - _last_full_log >= FULL_LOG_INTERVAL_SECONDS:
        _last_full_log = now
        logger.warning("serve.connections_full max_connections=%d: refusing new ones", limit)


class GuardedH11Protocol(_Guard, H11Protocol):
    pass


try:
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
except ImportError:  # httptools is optional: uvicorn then runs h11, and so do we
    HttpToolsProtocol = None  # type: ignore[assignment,misc]

if HttpToolsProtocol is not None:

    class GuardedHttpToolsProtocol(_Guard, HttpToolsProtocol):
        pass


def guarded_protocol(
    header_timeout: float, max_connections: int, *, http: str = "auto"
) -> type[asyncio.Protocol]:
    """What `uvicorn.run(http=...)` takes: the protocol uvicorn's `http` ("auto": httptools if
    installed, else h11) would run, guarded. A partial, not a class built here: `--workers`
    pickles it into each worker."""
    use_h11 = http == "h11" or HttpToolsProtocol is None
    base: type[_Guard] = GuardedH11Protocol if use_h11 else GuardedHttpToolsProtocol
    bound = functools.partial(base, header_timeout=header_timeout, max_connections=max_connections)
    return cast(type[asyncio.Protocol], bound)
