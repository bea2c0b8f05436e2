"""A request refused with 421 (unknown Host) is logged with the Host it had and the hosts the
broker accepts, so a wrong `server.public_url` can be found; the response says neither. A hostile
Host is logged escaped and cut short."""

from __future__ import annotations

import asyncio

from .support.broker import BrokerProcess, LogWindow
from .support.http import local_client


async def raw_request(broker: BrokerProcess, host: bytes) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", broker.config.port)
    writer.write(b"GET /connections HTTP/1.1\r\nHost: " + host + b"\r\nConnection: close\r\n\r\n")
    await writer.drain()
    answer = await reader.read()
    writer.close()
    await writer.wait_closed()
    return answer


async def test_a_refused_host_is_logged_with_the_accepted_ones(broker: BrokerProcess) -> None:
    window = LogWindow(broker)

    async with local_client() as http:
        response = await http.get(f"{broker.url}/connections", headers={"Host": "other.example"})

    log = await window.wait_for("host.refused")
    accepted = f"127.0.0.1:{broker.config.port}"
    assert response.status_code == 421
    assert (
        f"host.refused host='other.example' accepted={accepted}: the Host is not that of "
        "server.public_url or server.allowed_origins; if clients reach the broker by this name, "
        "set server.public_url to it"
    ) in log
    assert "other.example" not in response.text and accepted not in response.text


async def test_a_hostile_host_is_logged_escaped_and_cut(broker: BrokerProcess) -> None:
    window = LogWindow(broker)
    hostile = b"evil\xe9'\"" + b"x" * 500

    answer = await raw_request(broker, hostile)

    log = await window.wait_for("host.refused")
    assert answer.startswith(b"HTTP/1.1 421 ")
    assert "host='evil\\xe9\\'\"" + "x" * 93 + "'... accepted=" in log
    assert "x" * 94 not in log


async def test_the_refusal_is_never_sniffed_cached_or_framed(broker: BrokerProcess) -> None:
    """The 421 is sent before any route, so without the page headers: it names its own."""
    async with local_client() as http:
        response = await http.get(f"{broker.url}/connections", headers={"Host": "other.example"})

    assert response.status_code == 421
    assert response.headers["content-type"] == "text/plain; charset=utf-8"
    assert response.headers.get("x-content-type-options") == "nosniff"
    assert response.headers.get("cache-control") == "no-store"
    assert response.headers.get("x-frame-options") == "DENY"
