"""One IdP + broker stack: the IdP knows the broker (its login client, its /mcp resource and a
public MCP client), the broker trusts the IdP.

The session stack (tests/conftest.py) builds its IdP config here too; a module that needs a broker
configured differently builds its own with `stack_fixture` (module scope) or `running_stack`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from .broker import BrokerConfig, BrokerProcess, running_broker
from .idp import IdpConfig, IdpProcess, client_metadata, free_port, mint_token, running_idp

LOGIN_SECRET = "broker-login-secret"  # BrokerConfig's default login_client_secret
MCP_CLIENT_REDIRECT = "http://127.0.0.1:9/callback"  # nothing listens there


@dataclass(frozen=True)
class Stack:
    idp: IdpProcess
    broker: BrokerProcess

    def token(self, user: str, **overrides: Any) -> str:
        """An access token for this broker, signed with this IdP's key."""
        options: dict[str, Any] = {
            "issuer": self.idp.issuer,
            "audience": self.broker.mcp_url,
            "subject": user,
        }
        return mint_token(self.idp.signing_jwk, **(options | overrides))


def broker_idp_config(
    public_url: str,
    *,
    resources: Sequence[str] = (),
    login_secret: str = LOGIN_SECRET,
    mcp_client_redirect: str = MCP_CLIENT_REDIRECT,
    **idp_options: Any,
) -> IdpConfig:
    """An IdP that knows the broker at `public_url`: its login client (with `login_secret`), its
    /mcp resource (and `resources`) and the public client `mcp-client`."""
    return IdpConfig(
        resources=[f"{public_url}/mcp", *resources],
        clients=[
            client_metadata(
                "broker-login", [f"{public_url}/login/callback"], client_secret=login_secret
            ),
            client_metadata("mcp-client", [mcp_client_redirect]),
        ],
        **idp_options,
    )


@contextlib.contextmanager
def running_stack(
    workdir: Path,
    name: str,
    *,
    port: int = 0,
    public_url: str | None = None,
    idp: dict[str, Any] | None = None,
    **broker_options: Any,
) -> Iterator[Stack]:
    """Start the IdP, then the broker on `port` (a free one by default), each stopped on exit and
    the broker's database dropped. `public_url` (default: the broker's own address) is the URL
    the IdP knows, for a broker behind a relay; `idp` holds `broker_idp_config` options;
    `broker_options` are BrokerConfig fields."""
    port = port or free_port()
    url = public_url or f"http://127.0.0.1:{port}"
    if public_url is not None:
        extra = broker_options.setdefault("extra", {})
        extra["server"] = {"public_url": public_url, **extra.get("server", {})}
    with running_idp(broker_idp_config(url, **(idp or {})), workdir) as idp_process:
        config = BrokerConfig(issuer=idp_process.issuer, port=port, **broker_options)
        with running_broker(config, workdir, name=name) as broker:
            yield Stack(idp_process, broker)


def stack_fixture(name: str, **options: Any) -> Callable[..., Iterator[Stack]]:
    """A module-scoped fixture yielding a `running_stack(workdir, name, **options)`:
    `slow_stack = stack_fixture("slow", retry_wait_seconds=15)` in a test module."""

    @pytest.fixture(scope="module")
    def fixture(workdir: Path) -> Iterator[Stack]:
        with running_stack(workdir, name, **options) as stack:
            yield stack

    return fixture
