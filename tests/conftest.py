"""Shared fixtures: one real IdP (node oidc-provider) and one broker process per test session.

Run the suite once per database: `BROKER_TEST_DB=sqlite` (default) or `BROKER_TEST_DB=postgresql`.
"""

from __future__ import annotations

import asyncio
import collections
import os
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from app.db import create_engine

from .support import canary
from .support.broker import (
    BrokerConfig,
    BrokerProcess,
    drop_database,
    fresh_database,
    migrate,
    running_broker,
)
from .support.clients import Browser, McpHttp
from .support.fake_github import FakeGitHub
from .support.fake_slack import FakeSlack, running_fake_slack
from .support.idp import IdpConfig, IdpProcess, client_metadata, free_port, mint_token, running_idp
from .support.stack import broker_idp_config

SWEEP_SINCE = pytest.StashKey[float]()
SWEEP_PROBLEMS = pytest.StashKey[list[str] | None]()
ARTIFACTS = Path(os.environ.get("BROKER_TEST_ARTIFACTS", "test-artifacts")).resolve()

DEMO_PROVIDER: dict[str, Any] = {
    "kind": "api_key",
    "display_name": "Demo",
    "label": "API key",
    "pattern": r"^sk_[A-Za-z0-9_]{8,200}$",
}


@pytest.fixture(scope="session")
def workdir() -> Path:
    """This run's files: one directory per database, and per pytest-xdist worker (`gw0`, …)."""
    path = ARTIFACTS / os.environ.get("BROKER_TEST_DB", "sqlite")
    path /= os.environ.get("PYTEST_XDIST_WORKER", "main")
    path.mkdir(parents=True, exist_ok=True)
    return path


@pytest.fixture(scope="session")
def broker_port() -> int:
    return free_port()


@pytest.fixture(scope="session")
def idp(workdir: Path, broker_port: int) -> Iterator[IdpProcess]:
    """The MCP identity provider; knows the main broker's login client and /mcp resource."""
    config = broker_idp_config(f"http://127.0.0.1:{broker_port}")
    with running_idp(config, workdir) as process:
        yield process


@pytest.fixture(scope="session")
def fake_github(broker_port: int) -> Iterator[FakeGitHub]:
    """The third-party boundary for the GitHub preset (tests/support/fake_github.py)."""
    with FakeGitHub(redirect_uri=f"http://127.0.0.1:{broker_port}/oauth/github/callback") as fake:
        yield fake


@pytest.fixture(scope="session")
def fake_slack(broker_port: int) -> Iterator[FakeSlack]:
    """The third-party boundary for the Slack preset (tests/support/fake_slack.py)."""
    with running_fake_slack(f"http://127.0.0.1:{broker_port}/oauth/slack/callback") as fake:
        yield fake


@pytest.fixture(scope="session")
def provider_idp(workdir: Path, broker_port: int) -> Iterator[IdpProcess]:
    """A second, unrelated oidc-provider playing a generic OpenID provider ("acme")."""
    config = IdpConfig(
        cookie_prefix="acme",
        clients=[
            client_metadata(
                "broker-acme",
                [f"http://127.0.0.1:{broker_port}/oauth/acme/callback"],
                client_secret="acme-client-secret",
            )
        ],
    )
    with running_idp(config, workdir) as process:
        yield process


def github_provider(fake: FakeGitHub) -> dict[str, Any]:
    return {
        "kind": "oauth2",
        "preset": "github",
        "client_id": fake.client_id,
        "client_secret": fake.client_secret,
        "authorize_url": fake.authorize_url,
        "token_url": fake.token_url,
        "userinfo_url": f"{fake.url}/user",
        "api_base_url": fake.url,
    }


def slack_provider(fake: FakeSlack) -> dict[str, Any]:
    return {
        "kind": "oauth2",
        "preset": "slack",
        "client_id": fake.client_id,
        "client_secret": fake.client_secret,
        "authorize_url": fake.authorize_url,
        "token_url": fake.token_url,
        "revocation_url": fake.revocation_url,
    }


def acme_provider(provider_idp: IdpProcess) -> dict[str, Any]:
    return {
        "kind": "oidc",
        "display_name": "Acme",
        "issuer": provider_idp.issuer,
        "client_id": "broker-acme",
        "client_secret": "acme-client-secret",
        "client_auth_method": "client_secret_basic",
        "scopes": ["openid", "profile"],
        "userinfo_url": f"{provider_idp.issuer}/me",
        "account_label_claim": "sub",
    }


@pytest.fixture(scope="session")
def broker_config(
    idp: IdpProcess,
    broker_port: int,
    fake_github: FakeGitHub,
    fake_slack: FakeSlack,
    provider_idp: IdpProcess,
) -> BrokerConfig:
    return BrokerConfig(
        issuer=idp.issuer,
        port=broker_port,
        providers={
            "demo": DEMO_PROVIDER,
            "github": github_provider(fake_github),
            "acme": acme_provider(provider_idp),
            "slack": slack_provider(fake_slack),
        },
    )


@pytest.fixture(scope="session")
def broker(broker_config: BrokerConfig, workdir: Path) -> Iterator[BrokerProcess]:
    with running_broker(broker_config, workdir) as process:
        yield process
        canary.write_dump(process.database_url, workdir / canary.DUMP_NAME)


@pytest.fixture
def token_for(idp: IdpProcess, broker: BrokerProcess) -> Any:
    """Mint an access token signed with the IdP's own key (edge cases are overridable)."""

    def mint(user: str, **overrides: Any) -> str:
        options: dict[str, Any] = {
            "issuer": idp.issuer,
            "audience": broker.mcp_url,
            "subject": user,
        }
        options.update(overrides)
        return mint_token(idp.signing_jwk, **options)

    return mint


@pytest.fixture
async def mcp(broker: BrokerProcess) -> AsyncIterator[McpHttp]:
    client = McpHttp(broker.mcp_url)
    yield client
    await client.aclose()


@pytest.fixture
async def browser(broker: BrokerProcess) -> AsyncIterator[Browser]:
    client = Browser(broker.url)
    yield client
    await client.aclose()


@pytest.fixture
async def second_browser(broker: BrokerProcess) -> AsyncIterator[Browser]:
    client = Browser(broker.url)
    yield client
    await client.aclose()


@pytest.fixture(scope="session")
async def db(broker: BrokerProcess) -> AsyncIterator[AsyncEngine]:
    """Direct access to the broker's database, for asserting what was (not) stored."""
    engine = create_engine(broker.database_url, pool_size=2)
    yield engine
    await engine.dispose()


@pytest.fixture
async def unserved_db(workdir: Path) -> AsyncIterator[AsyncEngine]:
    """A migrated database of the run's kind that no broker serves. A broker's housekeeping
    sweeps its own database every minute (flows, audit events, revocations), so a test that
    counts what its own sweep finds uses this one: the rows and the counts are the test's."""
    url = fresh_database(workdir, "unserved")
    await asyncio.to_thread(migrate, url)
    engine = create_engine(url, pool_size=2)
    try:
        yield engine
    finally:
        await engine.dispose()
        await asyncio.to_thread(drop_database, url)


async def flow_row(db: AsyncEngine, flow_id: str) -> dict[str, Any] | None:
    async with db.connect() as connection:
        row = (
            (await connection.execute(text("SELECT * FROM flows WHERE id = :id"), {"id": flow_id}))
            .mappings()
            .first()
        )
    return dict(row) if row else None


async def count_rows(db: AsyncEngine, table: str, **where: Any) -> int:
    clause = " AND ".join(f"{key} = :{key}" for key in where) or "1=1"
    async with db.connect() as connection:
        value = await connection.scalar(text(f"SELECT count(*) FROM {table} WHERE {clause}"), where)
    return int(value or 0)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Modules holding a `slow` test first, then the others by their number of tests (most
    first): pytest-xdist hands out whole modules in this order (scripts/test.sh:
    `--dist loadfile --no-loadscope-reorder`), so the long ones start at once and the short ones
    fill the workers around them, instead of a long module running alone at the end."""
    slow = {item.path for item in items if item.get_closest_marker("slow") is not None}
    sizes = collections.Counter(item.path for item in items)
    items.sort(key=lambda item: (item.path not in slow, -sizes[item.path]))


def pytest_sessionstart(session: pytest.Session) -> None:
    session.config.stash[SWEEP_SINCE] = time.time()


def pytest_sessionfinish(session: pytest.Session) -> None:
    """I1: once every test ran (on every pytest-xdist worker), sweep logs and database dumps for
    canaries; a leak fails the run. The workers leave the sweep to the process that started them."""
    if "PYTEST_XDIST_WORKER" in os.environ:
        return
    problems = canary.sweep(ARTIFACTS, session.config.stash[SWEEP_SINCE])
    session.config.stash[SWEEP_PROBLEMS] = problems
    if problems:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    problems = terminalreporter.config.stash.get(SWEEP_PROBLEMS, None)
    if problems is None:
        return
    if problems:
        terminalreporter.section("I1 canary sweep: FAILED", red=True)
        for problem in problems:
            terminalreporter.line(problem)
    else:
        terminalreporter.line("I1 canary sweep: no canary in any log or the database")
