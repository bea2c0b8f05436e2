"""connect_broker_client and the example sibling at their edges: the MCP client's own name is
sent only as text the broker stores, and the example's configuration never shows its secrets."""

from __future__ import annotations

import pytest

from connect_broker_client.broker import _client_name
from examples.sibling_server import SiblingConfig


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
    config = SiblingConfig(
        broker_url="http://127.0.0.1:1",
        service_secret="cbs_not-for-logs",
        issuer="http://127.0.0.1:2",
        audience="http://127.0.0.1:3/mcp",
        state_keys=("k1:state-key-not-for-logs",),
    )

    assert "not-for-logs" not in repr(config)
