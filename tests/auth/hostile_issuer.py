"""An OpenID issuer on loopback whose discovery document each test writes (tests of
app/auth/jwks.py `check_metadata` and of the document's reading).

Every path but discovery answers the issuer's key set, so a URL the broker should never have
followed (a `jwks_uri` on another host that still reaches this server, as `http://0.0.0.0:PORT`
does on Linux) would hand it working keys: the hits per path show what it fetched. Discovery may
instead answer raw bytes, streamed without a length, and the bytes the broker took are counted.
"""

from __future__ import annotations

import json
import threading
from collections import Counter
from collections.abc import Callable
from typing import Any

from ..support.idp import public_jwk
from ..support.local_http import LocalServer, QuietHandler

DISCOVERY = "/.well-known/openid-configuration"
# Never bound: a URL host that is not loopback by its name, which Linux connects to loopback.
ANY_ADDRESS = "0.0.0.0"  # noqa: S104


def via_any_address(url: str) -> str:
    """`url` (of a server on 127.0.0.1) with a host the URL rule refuses that still reaches it:
    following it would get an answer, so the server's hits show whether it was followed."""
    return url.replace("127.0.0.1", ANY_ADDRESS)


class HostileIssuer:
    """`document(url)` makes the discovery document from this server's URL (default: a valid
    one); `raw`, when set, is streamed as the discovery answer instead, repeated until
    `raw_size` bytes, and `sent` counts what reached the broker's socket. POSTs are counted and
    refused (a token endpoint)."""

    def __init__(self, jwk: dict[str, Any]) -> None:
        self.jwk = jwk
        self.document: Callable[[str], dict[str, Any]] = self.valid_document
        self.raw: bytes | None = None
        self.raw_size = 0
        self.sent = 0
        self.hits: Counter[str] = Counter()
        self._lock = threading.Lock()
        self._server = LocalServer(self._handler(), name="hostile-issuer")

    @property
    def port(self) -> int:
        return self._server.port

    @property
    def url(self) -> str:
        return self._server.url

    def valid_document(self, url: str) -> dict[str, Any]:
        return {
            "issuer": url,
            "jwks_uri": f"{url}/jwks",
            "authorization_endpoint": f"{url}/auth",
            "token_endpoint": f"{url}/token",
        }

    def serve(self, document: Callable[[str], dict[str, Any]]) -> None:
        """Answer `document` from now on, with fresh counters."""
        with self._lock:
            self.document, self.raw, self.sent = document, None, 0
            self.hits.clear()

    def serve_raw(self, raw: bytes, size: int) -> None:
        with self._lock:
            self.raw, self.raw_size, self.sent = raw, size, 0
            self.hits.clear()

    def _handler(self) -> type[QuietHandler]:
        issuer = self

        class Handler(QuietHandler):
            def do_GET(self) -> None:
                with issuer._lock:
                    issuer.hits[self.path] += 1
                if self.path == DISCOVERY and issuer.raw is not None:
                    self._stream(issuer.raw, issuer.raw_size)
                    return
                if self.path == DISCOVERY:
                    document = issuer.document(issuer.url)
                else:
                    document = {"keys": [public_jwk(issuer.jwk)]}
                payload = json.dumps(document).encode()
                self.answer(200, payload, content_type="application/json")

            def do_POST(self) -> None:
                with issuer._lock:
                    issuer.hits[self.path] += 1
                self.send_error(400)

            def _stream(self, raw: bytes, size: int) -> None:
                """HTTP/1.0 without a length: the body ends when the connection does."""
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.end_headers()
                written = 0
                try:
                    while written < size:
                        self.wfile.write(raw)
                        written += len(raw)
                        with issuer._lock:
                            issuer.sent = written
                except OSError:
                    pass  # the broker stopped reading and closed the connection

        return Handler

    def __enter__(self) -> HostileIssuer:
        self._server.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.stop()
