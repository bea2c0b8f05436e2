"""The HTTP protocol `serve` runs: uvicorn's, with deadlines and caps on what a client may hold.

uvicorn (0.54, httptools and h11 alike) arms no timer on a connection until a request's headers
are complete: its keep-alive timer starts after an answer. A client that opens a connection, or
sends part of its headers, and then nothing, holds the connection and its descriptor for as long
as it likes, and about a thousand of them exhaust a process limited to 1,024 descriptors.
`limit_concurrency` does not help: it answers 503 once headers are complete, which these never
are; `h11_max_incomplete_event_size` bounds the size of headers under h11 only.

So, whatever the protocol:
- each connection gets `header_timeout` seconds from its opening, and from the first byte of
  each later request, to complete its headers, and MAX_HEADER_BYTES for them (431 past it:
  under httptools one request's 60 MB of headers took 1.4 GB of memory);
- a request's body, once its headers are complete, has BODY_TIMEOUT_SECONDS to arrive (a valid
  token sending one byte of a declared 1,000 held its connection for good);
- an answer the client does not read has WRITE_TIMEOUT_SECONDS to leave once the socket's buffer
  is full, and a client may queue at most MAX_PIPELINED requests behind the one being answered
  (a client that pipelined requests and never read held its connection past every timer and
  grew the process by fifty times what it sent);
- a process holds at most `max_connections`: one more is answered 503 and closed at once.
Past a deadline the connection is closed (aborted when its answer cannot leave).
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
HEADERS_TOO_LARGE = (
    b"HTTP/1.1 431 Request Header Fields Too Large\r\n"
    b"content-type: text/plain; charset=utf-8\r\nconnection: close\r\ncontent-length: 35\r\n\r\n"
    b"The request headers are too large.\n"
)
MAX_HEADER_BYTES = 64 * 1024
BODY_TIMEOUT_SECONDS = 30.0
WRITE_TIMEOUT_SECONDS = 30.0
MAX_PIPELINED = 8
_last_full_log = 0.0


class _Guard:
    """Mixed in before a uvicorn HTTP protocol class (which sets `connections`, `transport`,
    `cycle` and `loop`, and for httptools `pipeline`)."""

    connections: set[Any]
    transport: asyncio.Transport
    cycle: Any
    loop: asyncio.AbstractEventLoop

    def __init__(self, *args: Any, header_timeout: float, max_connections: int, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._header_timeout = header_timeout
        self._max_connections = max_connections
        self._header_timer: asyncio.TimerHandle | None = None
        self._header_bytes = 0  # received for the request whose headers are arriving
        self._body_timer: asyncio.TimerHandle | None = None
        self._write_timer: asyncio.TimerHandle | None = None

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
        if self.transport.is_closing():
            return
        if not self._headers_arriving():
            self._header_bytes = 0
        elif self._too_many_header_bytes(len(data)):
            return
        if self._header_timer is not None:
            if not self._between_requests():
                self._header_timer.cancel()  # the headers are complete
                self._header_timer = None
        elif starts_request and self._between_requests():
            self._arm()
        if self._queued() > MAX_PIPELINED:
            self.transport.abort()  # requests queued faster than their answers are read
            return
        self._watch_body()

    def pause_writing(self) -> None:
        """The socket's buffer is full (the client reads no more for now): what is left of the
        answer has WRITE_TIMEOUT_SECONDS to leave."""
        super().pause_writing()  # type: ignore[misc]
        if self._write_timer is None:
            self._write_timer = self.loop.call_later(WRITE_TIMEOUT_SECONDS, self._abort)

    def resume_writing(self) -> None:
        super().resume_writing()  # type: ignore[misc]
        if self._write_timer is not None:
            self._write_timer.cancel()
            self._write_timer = None

    def connection_lost(self, exc: Exception | None) -> None:
        for timer in (self._header_timer, self._body_timer, self._write_timer):
            if timer is not None:
                timer.cancel()
        self._header_timer = self._body_timer = self._write_timer = None
        super().connection_lost(exc)  # type: ignore[misc]

    def _headers_arriving(self) -> bool:
        """Whether a request's headers have begun and are not complete. h11 bounds their size
        itself (16 KiB, then 400): only httptools needs counting (GuardedHttpToolsProtocol)."""
        return False

    def _queued(self) -> int:
        """Requests parsed and waiting behind the one being answered. h11 parses one at a time
        (the rest stays unread): only httptools queues them (GuardedHttpToolsProtocol)."""
        return 0

    def _too_many_header_bytes(self, received: int) -> bool:
        """Count `received` bytes towards the arriving headers; past MAX_HEADER_BYTES answer
        431 and close (the parser holds at most the cap and one read more)."""
        self._header_bytes += received
        if self._header_bytes <= MAX_HEADER_BYTES:
            return False
        self.transport.write(HEADERS_TOO_LARGE)
        self.transport.close()
        return True

    def _watch_body(self) -> None:
        """A body still arriving after its headers gets BODY_TIMEOUT_SECONDS in all."""
        cycle = self.cycle
        arriving = cycle is not None and cycle.more_body and not cycle.response_complete
        if arriving and self._body_timer is None:
            self._body_timer = self.loop.call_later(BODY_TIMEOUT_SECONDS, self._abort)
        elif not arriving and self._body_timer is not None:
            self._body_timer.cancel()
            self._body_timer = None

    def _abort(self) -> None:
        self._body_timer = self._write_timer = None
        self.transport.abort()

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
        """Knows from the parser's own events when a request's headers are arriving: after an
        early answer (a 413) the rest of that request's body still arrives, and is no
        headers."""

        _reading_headers = False

        def on_message_begin(self) -> None:
            super().on_message_begin()
            self._reading_headers = True

        def on_headers_complete(self) -> None:
            self._reading_headers = False
            super().on_headers_complete()

        def _headers_arriving(self) -> bool:
            return self._reading_headers

        def _queued(self) -> int:
            return len(self.pipeline)


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
