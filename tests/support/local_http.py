"""A small HTTP server on 127.0.0.1, in a thread of the test process: the third parties the
tests stand up (an identity provider, an OAuth provider, a webhook receiver, Slack)."""

from __future__ import annotations

from collections.abc import Mapping
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from threading import Thread
from types import TracebackType
from typing import Any

STOP_POLL_SECONDS = 0.05


class QuietHandler(BaseHTTPRequestHandler):
    """A request handler that writes no access line to the test's output."""

    def log_message(self, format: str, *args: Any) -> None:
        return

    def answer(
        self,
        status: int,
        body: bytes = b"",
        *,
        content_type: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        """One whole answer: the status, `headers`, the body's type and length, the body."""
        self.send_response(status)
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        if content_type is not None:
            self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


class LocalServer:
    """`handler` served on 127.0.0.1:`port` (0: a free port) from `start()` to `stop()`, or for
    a `with` block. `stop()` does not wait for answers still being written, and the server can
    start again on the same port (a receiver that went down and came back)."""

    def __init__(
        self,
        handler: type[BaseHTTPRequestHandler],
        *,
        port: int = 0,
        server_class: type[ThreadingHTTPServer] = ThreadingHTTPServer,
        name: str = "local-http",
    ) -> None:
        self._handler = handler
        self._server_class = server_class
        self._name = name
        self.port = port
        self.server: ThreadingHTTPServer | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> ThreadingHTTPServer:
        server = self._server_class(("127.0.0.1", self.port), self._handler)
        server.daemon_threads = True
        server.block_on_close = False
        self.port = server.server_address[1]
        # a stop waits for the loop to look again: every 50 ms rather than the default 500
        serve = {"poll_interval": STOP_POLL_SECONDS}
        Thread(target=server.serve_forever, kwargs=serve, name=self._name, daemon=True).start()
        self.server = server
        return server

    def stop(self) -> None:
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()
            self.server = None

    def __enter__(self) -> LocalServer:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.stop()
