"""A webhook receiver: records every POST it is sent (headers and body) and answers `status`.

Served by the standard library's threading HTTP server on 127.0.0.1, on a port of its own that
stays the receiver's across `stop` and `start` (a receiver that is down, then back).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from .idp import free_port

WAIT_SECONDS = 15.0


@dataclass(frozen=True)
class Delivery:
    headers: dict[str, str]  # names lower-cased
    body: bytes

    @property
    def event(self) -> dict[str, Any]:
        decoded: dict[str, Any] = json.loads(self.body)
        return decoded


@dataclass
class Receiver:
    port: int = field(default_factory=free_port)
    status: int = 204  # a 3xx also sends `Location:` back to the same URL
    delay: float = 0.0  # seconds before answering
    deliveries: list[Delivery] = field(default_factory=list)  # the 2xx answered
    requests: int = 0  # every POST received
    _server: ThreadingHTTPServer | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/hooks/broker?team=ops"

    def events(self, where: Callable[[dict[str, Any]], bool] = lambda _: True) -> list[Delivery]:
        """The deliveries so far whose event matches `where`, in the order they arrived."""
        with self._lock:
            return [delivery for delivery in self.deliveries if where(delivery.event)]

    async def wait_for(
        self, count: int, where: Callable[[dict[str, Any]], bool] = lambda _: True
    ) -> list[Delivery]:
        """The matching deliveries once there are `count` of them (or after WAIT_SECONDS)."""
        deadline = time.monotonic() + WAIT_SECONDS
        while len(found := self.events(where)) < count and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        return found

    def start(self) -> None:
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length)
                headers = {name.lower(): value for name, value in self.headers.items()}
                status = receiver.status
                with receiver._lock:
                    receiver.requests += 1
                    if 200 <= status < 300:
                        receiver.deliveries.append(Delivery(headers, body))
                time.sleep(receiver.delay)
                with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                    self.send_response(status)  # the broker may have given up waiting
                    if 300 <= status < 400:
                        self.send_header("Location", receiver.url)
                    self.send_header("Content-Length", "2")
                    self.end_headers()
                    self.wfile.write(b"ok")

            def log_message(self, format: str, *args: Any) -> None:
                return

        server = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        server.block_on_close = False  # a stop does not wait for a slow answer
        server.daemon_threads = True
        threading.Thread(target=server.serve_forever, name="webhook-receiver", daemon=True).start()
        self._server = server

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None


@contextmanager
def running_receiver() -> Iterator[Receiver]:
    receiver = Receiver()
    receiver.start()
    try:
        yield receiver
    finally:
        receiver.stop()
