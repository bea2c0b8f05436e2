"""A webhook receiver: records every POST it is sent (headers and body) and answers `status`.

Served by a LocalServer (tests/support/local_http.py) on 127.0.0.1, on a port of its own that
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
from typing import Any

from .idp import free_port
from .local_http import LocalServer, QuietHandler

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
    _server: LocalServer | None = None  # made at the first `start`, on `port`
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
        if self._server is None:
            self._server = LocalServer(self._handler(), port=self.port, name="webhook-receiver")
        self._server.start()

    def stop(self) -> None:
        if self._server is not None:
            self._server.stop()

    def _handler(self) -> type[QuietHandler]:
        receiver = self

        class Handler(QuietHandler):
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
                    # the broker may have given up waiting
                    moved = {"Location": receiver.url} if 300 <= status < 400 else {}
                    self.answer(status, b"ok", headers=moved)

        return Handler


@contextmanager
def running_receiver() -> Iterator[Receiver]:
    receiver = Receiver()
    receiver.start()
    try:
        yield receiver
    finally:
        receiver.stop()
