"""connect_broker_client and the example sibling at their edges: the MCP client's own name is
sent only as text the broker stores, the example's configuration never shows its secrets, and the
token verifier takes only what the broker takes, from an IdP it reads with bounds."""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import json
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jwt
import pytest
from cryptography.hazmat.primitives.asymmetric import rsa
from jwt.algorithms import RSAAlgorithm
from mcp.server.auth.provider import AccessToken

from connect_broker_client import IdpTokenVerifier
from connect_broker_client.broker import _client_name

from .support.local_http import LocalServer, QuietHandler

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "sibling_server.py"


def load_example() -> Any:
    """The example as its own script (examples/ is no package: it runs as a file)."""
    spec = importlib.util.spec_from_file_location("sibling_server_example", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up while defined
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(
    ("name", "sent"),
    [
        ("Claude Desktop", "Claude Desktop"),
        ("evil\x00name", "evilname"),
        ("lone \ud800 surrogate", "lone  surrogate"),
        ("\x00", None),
        ("x" * 150, "x" * 100),
    ],
    ids=["plain", "nul", "surrogate", "nothing-left", "long"],
)
def test_the_clients_name_is_sent_as_text_the_broker_stores(name: str, sent: str | None) -> None:
    """A NUL made the broker refuse every require of that client's users (422); a surrogate
    failed the request before it was sent."""
    assert _client_name(name) == sent


def test_the_example_configuration_does_not_show_its_secrets() -> None:
    config = load_example().SiblingConfig(
        broker_url="http://127.0.0.1:1",
        service_secret="cbs_not-for-logs",
        issuer="http://127.0.0.1:2",
        audience="http://127.0.0.1:3/mcp",
        state_keys=("k1:state-key-not-for-logs",),
    )

    assert "not-for-logs" not in repr(config)


# ------------------------------------------------------------------------------------------------
# IdpTokenVerifier: the sibling's own access tokens
# ------------------------------------------------------------------------------------------------

AUDIENCE = "http://127.0.0.1:9/mcp"  # never contacted: only compared with the token's `aud`
SIGNING_KEY = rsa.generate_private_key(public_exponent=65537, key_size=2048)


class Issuer:
    """Discovery and a JWKS for SIGNING_KEY; `jwks_body`, when set, is sent instead of the JWKS,
    and `endless` sends a chunked JSON answer that never ends."""

    def __init__(self) -> None:
        self.jwks_body: bytes | None = None
        self.endless = False
        self.server = LocalServer(self._handler())

    @property
    def url(self) -> str:
        return self.server.url

    def _handler(self) -> type[QuietHandler]:
        issuer = self

        class Handler(QuietHandler):
            def do_GET(self) -> None:
                if self.path == "/.well-known/openid-configuration":
                    body = json.dumps({"issuer": issuer.url, "jwks_uri": f"{issuer.url}/jwks"})
                    self.answer(200, body.encode(), content_type="application/json")
                elif issuer.endless:
                    self._endless()
                elif issuer.jwks_body is not None:
                    self.answer(200, issuer.jwks_body, content_type="application/json")
                else:
                    jwk = RSAAlgorithm.to_jwk(SIGNING_KEY.public_key(), as_dict=True)
                    keys = json.dumps({"keys": [jwk | {"kid": "k1"}]}).encode()
                    self.answer(200, keys, content_type="application/json")

            def _endless(self) -> None:
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Transfer-Encoding", "chunked")
                self.end_headers()
                chunk = b' {"keys": [] ' * 5000
                with contextlib.suppress(OSError):  # the reader hung up: what it should do
                    while True:
                        self.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))

        return Handler


@pytest.fixture(scope="module")
def served_issuer() -> Iterator[Issuer]:
    served = Issuer()
    with served.server:
        yield served


@pytest.fixture
def issuer(served_issuer: Issuer) -> Issuer:
    served_issuer.jwks_body, served_issuer.endless = None, False
    return served_issuer


def signed(issuer: Issuer, **claims: Any) -> str:
    now = int(time.time())
    payload = {"iss": issuer.url, "aud": AUDIENCE, "sub": "alice", "exp": now + 300} | claims
    headers = {"kid": "k1", "typ": "at+jwt"}
    return jwt.encode(payload, SIGNING_KEY, algorithm="RS256", headers=headers)


async def verified(issuer: Issuer, token: str, **options: Any) -> AccessToken | None:
    verifier = IdpTokenVerifier(issuer.url, AUDIENCE, **options)
    try:
        return await asyncio.wait_for(verifier.verify_token(token), timeout=10)
    finally:
        await verifier.aclose()


async def test_a_token_is_taken_with_the_brokers_identity_claim(issuer: Issuer) -> None:
    entra = await verified(issuer, signed(issuer, oid="object-id-1"), identity_claim="oid")

    assert entra is not None and entra.claims is not None
    assert entra.claims["oid"] == "object-id-1"
    assert await verified(issuer, signed(issuer)) is not None


@pytest.mark.parametrize(
    "claims",
    [{}, {"oid": ""}, {"oid": 42}, {"oid": "x" * 256}, {"oid": "a\x00b"}],
    ids=["missing", "empty", "not-text", "too-long", "nul"],
)
async def test_a_token_without_a_name_the_broker_takes_is_refused(
    issuer: Issuer, claims: dict[str, Any]
) -> None:
    """Before, such a token passed and every tool that needed the broker failed with an
    internal error (or the broker refused the name) instead of the client getting its 401."""
    assert await verified(issuer, signed(issuer, **claims), identity_claim="oid") is None


async def test_an_endless_key_set_is_refused_as_it_arrives(issuer: Issuer) -> None:
    """Before, the whole answer was read before its size was checked: an endless one never
    finished (and a large one took the sibling's memory)."""
    issuer.endless = True

    assert await verified(issuer, signed(issuer)) is None


async def test_a_key_set_nested_too_deeply_is_refused(issuer: Issuer) -> None:
    issuer.jwks_body = b"[" * 100_000 + b"]" * 100_000

    assert await verified(issuer, signed(issuer)) is None
