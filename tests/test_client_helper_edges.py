"""connect_broker_client and the example sibling at their edges: the MCP client's own name is
sent only as text the broker stores, and the example's configuration never shows its secrets."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any

import pytest

from connect_broker_client.broker import _client_name

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
