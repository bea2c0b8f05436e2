"""R4 (SECURITY.md), DESIGN §3.1 step 5: two broker processes on one PostgreSQL database behind a
round-robin balancer, sharing one public URL, with every connection going to the other replica
from the one before (the clients open a new connection per request).

Nothing a flow needs may live in one process: the login's pre-login cookie (sealed with the
configured keys), the browser session and the flow (database), CSRF tokens (derived from the
keys), the OAuth state and PKCE verifier (database), and the wake-up of a waiting retry, which
must come from the replica that completed the flow (LISTEN/NOTIFY).

SQLite is served by one process by design: these tests run on PostgreSQL only.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import httpx2
import pytest

from .conftest import DEMO_PROVIDER, github_provider
from .mcp.test_retry import API_KEY, retry, round_one, tool_result
from .oauth.helpers import approve_at_provider, arm, deliver, retry_connect, unique
from .support.broker import (
    BrokerProcess,
    database_kind,
    serve_replica,
)
from .support.clients import Browser, McpHttp
from .support.fake_github import FakeGitHub
from .support.http import local_client
from .support.idp import IdpProcess, free_port, mint_token
from .support.relay import TcpRelay
from .support.stack import running_stack

pytestmark = [
    pytest.mark.both_databases,
    pytest.mark.skipif(
        database_kind() != "postgresql", reason="replicas share PostgreSQL; SQLite is one process"
    ),
]

RETRY_WAIT_SECONDS = 15.0
# The waiter also reads the flow again every 2 s in case a notification was lost: the retry is
# held past the first of those reads, so only a notification can answer it within WAKE_SECONDS.
HOLD_SECONDS = 2.25
WAKE_SECONDS = 1.0  # completion on one replica to the answer on the other; measured ~0.1 s


@dataclass(frozen=True)
class Replicas:
    idp: IdpProcess
    relay: TcpRelay
    brokers: tuple[BrokerProcess, BrokerProcess]
    fake: FakeGitHub

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.relay.port}"

    def token(self, user: str) -> str:
        return mint_token(
            self.idp.signing_jwk, issuer=self.idp.issuer, audience=f"{self.url}/mcp", subject=user
        )

    def replica_of_last(self, count: int = 1) -> list[int]:
        """Which broker (0 or 1) took each of the last `count` connections."""
        ports = [broker.config.port for broker in self.brokers]
        return [ports.index(port) for port in self.relay.assigned[-count:]]


@pytest.fixture
async def replicas(workdir: Path) -> AsyncIterator[Replicas]:
    url = f"http://127.0.0.1:{free_port()}"
    with (
        FakeGitHub(redirect_uri=f"{url}/oauth/github/callback") as fake,
        running_stack(
            workdir,
            "replica-a",
            public_url=url,
            retry_wait_seconds=RETRY_WAIT_SECONDS,
            providers={"demo": DEMO_PROVIDER, "github": github_provider(fake)},
        ) as stack,
    ):
        first = stack.broker
        second = serve_replica(first, name="replica-b")
        relay = TcpRelay(first.config.port, second.config.port, port=int(url.rsplit(":", 1)[1]))
        await relay.start()
        try:
            yield Replicas(stack.idp, relay, (first, second), fake)
        finally:
            await relay.cut()
            second.stop()


def one_request_per_connection() -> httpx2.AsyncClient:
    """A client that opens a new connection for every request, so the balancer alternates."""
    return local_client(
        timeout=60,
        follow_redirects=False,
        limits=httpx2.Limits(max_keepalive_connections=0),
    )


@pytest.fixture
async def clients(replicas: Replicas) -> AsyncIterator[tuple[McpHttp, Browser]]:
    mcp, browser = McpHttp(f"{replicas.url}/mcp"), Browser(replicas.url)
    for client in (mcp, browser):
        await client.http.aclose()
        client.http = one_request_per_connection()
    yield mcp, browser
    await mcp.aclose()
    await browser.aclose()


async def test_r4_api_key_flow_across_replicas_and_a_retry_woken_by_the_other_one(
    replicas: Replicas, clients: tuple[McpHttp, Browser]
) -> None:
    mcp, browser = clients
    user = unique("r4-key")
    token = replicas.token(user)
    first, _, flow_id = await round_one(mcp, token)
    await browser.login_as(user, next_path=f"/connect/{flow_id}")
    csrf = await browser.csrf_token(f"/connect/{flow_id}")

    before = len(replicas.relay.assigned)
    waiting = asyncio.create_task(retry(mcp, token, first["requestState"]))
    while len(replicas.relay.assigned) == before:  # until the retry's connection is made
        await asyncio.sleep(0.02)
    done, _ = await asyncio.wait({waiting}, timeout=HOLD_SECONDS)
    assert not done, "the retry returned while its flow was still pending"
    submitted = await browser.post(
        f"/connect/{flow_id}/api-key", data={"csrf": csrf, "api_key": API_KEY}
    )
    submitted_at = asyncio.get_running_loop().time()
    answer = await asyncio.wait_for(waiting, timeout=RETRY_WAIT_SECONDS + 10)
    woken_after = asyncio.get_running_loop().time() - submitted_at

    waiter, submitter = replicas.replica_of_last(2)
    assert waiter != submitter  # the retry waited on one replica, the key went to the other
    assert submitted.status_code == 303, submitted.text
    assert tool_result(answer)["structuredContent"]["status"] == "connected"
    assert woken_after < WAKE_SECONDS


async def test_r4_oauth_flow_with_each_step_on_the_other_replica(
    replicas: Replicas, clients: tuple[McpHttp, Browser]
) -> None:
    mcp, browser = clients
    user = unique("r4-gh")
    token = replicas.token(user)
    armed = await arm(mcp, browser, token, user, provider="github")
    back = await approve_at_provider(browser.http, armed.authorize_url)
    callback = await deliver(browser, back)
    answer = await retry_connect(mcp, token, armed.opened)

    assert callback.status_code == 303, callback.text
    assert tool_result(answer)["structuredContent"]["status"] == "connected"
    assert replicas.fake.token_calls == 1
    # round 1, /login, its callback, the consent page, start, the provider's callback, the retry:
    # each on a connection of its own, so the replicas took turns
    steps = replicas.replica_of_last(len(replicas.relay.assigned))
    assert len(steps) >= 7 and set(steps) == {0, 1}, steps
