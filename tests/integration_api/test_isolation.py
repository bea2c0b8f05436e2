"""Audience isolation of the integration API, and the K series: threat-model addendum for sibling
MCP servers (SECURITY.md §7 question 8; DESIGN.md §2 "Sibling MCP servers", §3.2).

A sibling server calls /api/v1 as itself and names the user it has verified; the broker keeps each
connection under the *audience* whose flow made it: the service's name, or "mcp" for the broker's
own endpoint. The threats and where each is tested:

K1 Service authentication (test_services.py, `test_k1_*`). Anyone who reaches /api/v1 could try
   to pass as a sibling. Each service has its own 256-bit `cbs_` secret, printed once by
   `service create`; the table keeps only an HMAC digest under a subkey of the signing keys, so a
   DB dump yields nothing usable. Missing, unknown, malformed, near-miss, wrongly presented and
   revoked secrets all get one identical 401 problem (`invalid_service_credentials`, no oracle, the
   value never logged), on every operation, before the request's fields are validated (only a
   body that is not JSON at all is refused as such first: FastAPI parses it before dependencies).
   `--providers` confines a secret to some providers (403 `provider_not_allowed`).

K2 Audience isolation (this file, `test_k2_*`). A connection made for one sibling must not leak
   to another, nor to the broker's own tools, nor the other way round (a user who connected GitHub
   for an issue bot did not hand it to the deploy bot). Reads see the service's own audience plus
   those `[services.<name>] share_from` names (operator configuration, one-way, "mcp" included);
   writes (DELETE) touch only the service's own. A service without a visible connection gets a
   new flow of its own audience, never another audience's credential.

K3 Asserted-user trust (test_api.py and this file, `test_k3_*`). The broker cannot verify the user
   a sibling names: it never sees the sibling's MCP token (by design it must not be forwarded).
   So a service secret is worth "any user of our IdP" within the audiences that service reads: a
   leaked secret or a dishonest sibling can read every credential stored under its own (and
   shared) audiences for any subject it names, and can start flows naming anyone. What limits
   that: the issuer must be the broker's own IdP, compared exactly (400 `unknown_issuer`); reads
   never reach audiences the operator did not share (K2), so the blast radius of one sibling is
   its own connections; and a sibling can never *make* a connection for someone: a flow completes
   only in a browser logged in at the IdP as the very user named, on a page that names the
   registered service first ("<service> (via <client>)", the relayed client name escaped). Hence:
   share sparingly, guard service secrets like the credentials they unlock, register a service
   per sibling (never one shared secret), and revoke on suspicion. There is no in-place rotation
   yet: a revoked name stays taken, so the replacement is a new service, a new audience, and its
   users connect again.

K4 Relayed requestState binding (test_api.py, `test_k4_*`). The state comes back through the MCP
   client (untrusted) and the sibling. It is signed and bound to the service (as the client id),
   the user (keyed digest), the provider, the sibling's `request_digest` and the flow TTL; an
   edited, forged, aged, or rebound state is 400 `invalid_request_state` even on a completed flow,
   nothing is consumed or changed, and `request_state.invalid` is logged without the blob.

The sharing cases run on a dedicated broker (its own IdP, which knows its login callback) whose
configuration has `[services.b] share_from = ["a"]` and `[services.c] share_from = ["mcp"]`.
Every flow is completed through the real connect page.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx2
import pytest
from sqlalchemy.ext.asyncio import AsyncEngine

from app.db import create_engine

from ..conftest import DEMO_PROVIDER, count_rows, flow_row
from ..support.broker import BrokerProcess, LogWindow
from ..support.clients import Browser, McpHttp, flow_id_from
from ..support.idp import (
    IdpProcess,
    mint_token,
)
from ..support.schema import validate_response
from ..support.stack import running_stack
from .test_api import (
    API_KEY,
    Registered,
    ServiceApi,
    connect_demo,
    connected,
    fresh_name,
    fresh_user,
    input_required,
    ok,
    problem,
    register,
    submit_api_key,
)

pytestmark = pytest.mark.both_databases

MCP_KEY = "sk_CANARYKEY_isolation_mcp_1"
DEMO = {"provider": "demo"}


def tool_result(response: httpx2.Response) -> dict[str, Any]:
    assert response.status_code == 200, response.text
    body = response.json()
    validate_response(body, "CallToolResult")
    result: dict[str, Any] = body["result"]
    return result


async def elicits(mcp: McpHttp, token: str) -> str:
    """connect_account over MCP answers a URL elicitation; returns its flow id."""
    response = await mcp.call_tool(token, "connect_account", DEMO)
    assert response.status_code == 200, response.text
    body = response.json()
    validate_response(body, "InputRequiredResult")
    return flow_id_from(body["result"])[1]


async def connect_via_mcp(mcp: McpHttp, browser: Browser, token: str, subject: str) -> None:
    """The broker's own round: connect_account, the API-key page, the retry (audience "mcp")."""
    response = await mcp.call_tool(token, "connect_account", DEMO)
    result = response.json()["result"]
    key, flow_id = flow_id_from(result)
    await submit_api_key(browser, subject, flow_id, MCP_KEY)
    done = await mcp.call_tool(
        token,
        "connect_account",
        DEMO,
        input_responses={key: {"action": "accept"}},
        request_state=result["requestState"],
    )
    assert tool_result(done)["structuredContent"]["status"] == "connected"


async def mcp_connections(mcp: McpHttp, token: str) -> list[dict[str, Any]]:
    items: list[dict[str, Any]] = tool_result(await mcp.call_tool(token, "list_connections"))[
        "structuredContent"
    ]["connections"]
    return items


# ------------------------------------------------------------------------------------------------
# The session broker: services without sharing
# ------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def first_service(broker: BrokerProcess) -> Registered:
    return register(broker, fresh_name("iso-a"))


@pytest.fixture(scope="module")
def second_service(broker: BrokerProcess) -> Registered:
    return register(broker, fresh_name("iso-b"))


@pytest.fixture
async def apis(
    broker: BrokerProcess, first_service: Registered, second_service: Registered
) -> AsyncIterator[tuple[ServiceApi, ServiceApi]]:
    first, second = ServiceApi(broker.url, first_service), ServiceApi(broker.url, second_service)
    yield first, second
    await first.aclose()
    await second.aclose()


async def test_k2_a_services_connection_is_invisible_to_another_service(
    apis: tuple[ServiceApi, ServiceApi], browser: Browser, idp: IdpProcess, db: AsyncEngine
) -> None:
    """K2. B sees nothing of what the user connected through A: credentials 404, an empty list,
    a DELETE that finds nothing (and leaves A's alone), and require elicits a NEW flow of B's."""
    a, b = apis
    user = {"issuer": idp.issuer, "subject": fresh_user("k2-services")}
    a_flow = await connect_demo(a, browser, user)

    fetched = await b.credential("demo", user)
    listed = await b.connections(user)
    deleted = await b.delete("demo", user)
    required = await b.require("demo", user)

    problem(fetched, 404, "not_connected")
    assert ok(listed) == {"connections": []}
    problem(deleted, 404, "not_connected")
    _, b_flow = input_required(required)
    assert b_flow != a_flow
    assert (await flow_row(db, b_flow) or {})["audience"] == b.name
    assert connected(await a.require("demo", user))["secret"] == API_KEY
    assert API_KEY not in fetched.text + listed.text + required.text


async def test_k2_a_services_connection_is_invisible_to_the_brokers_own_tools(
    apis: tuple[ServiceApi, ServiceApi],
    browser: Browser,
    mcp: McpHttp,
    token_for: Any,
    idp: IdpProcess,
    db: AsyncEngine,
) -> None:
    """K2. After connecting through service A, the broker's own MCP tools still see nothing:
    list_connections is empty and connect_account elicits a flow of audience "mcp"."""
    a, _ = apis
    subject = fresh_user("k2-tools")
    user = {"issuer": idp.issuer, "subject": subject}
    await connect_demo(a, browser, user)
    token = token_for(subject)

    listed = await mcp_connections(mcp, token)
    flow_id = await elicits(mcp, token)

    assert listed == []
    assert (await flow_row(db, flow_id) or {})["audience"] == "mcp"


async def test_k2_the_brokers_own_connection_is_invisible_to_a_service(
    apis: tuple[ServiceApi, ServiceApi],
    browser: Browser,
    mcp: McpHttp,
    token_for: Any,
    idp: IdpProcess,
    db: AsyncEngine,
) -> None:
    """K2. A connection made through the broker's own connect_account (audience "mcp") is not
    readable, listable or deletable by a service; require elicits the service's own flow."""
    a, _ = apis
    subject = fresh_user("k2-mcp")
    user = {"issuer": idp.issuer, "subject": subject}
    await connect_via_mcp(mcp, browser, token_for(subject), subject)

    fetched = await a.credential("demo", user)
    listed = await a.connections(user)
    deleted = await a.delete("demo", user)
    required = await a.require("demo", user)

    problem(fetched, 404, "not_connected")
    assert ok(listed) == {"connections": []}
    problem(deleted, 404, "not_connected")
    _, flow_id = input_required(required)
    assert (await flow_row(db, flow_id) or {})["audience"] == a.name
    assert await count_rows(db, "connections", subject=subject, audience="mcp") == 1
    assert MCP_KEY not in fetched.text + listed.text + required.text


async def test_k2_delete_by_a_service_leaves_the_brokers_own_connection(
    apis: tuple[ServiceApi, ServiceApi],
    browser: Browser,
    mcp: McpHttp,
    token_for: Any,
    idp: IdpProcess,
    db: AsyncEngine,
) -> None:
    """K2. One user, two connections to the same provider (through A and through the broker's
    own tools): A's DELETE removes exactly A's; the broker's still works over MCP."""
    a, _ = apis
    subject = fresh_user("k2-delete")
    user = {"issuer": idp.issuer, "subject": subject}
    token = token_for(subject)
    await connect_via_mcp(mcp, browser, token, subject)
    await connect_demo(a, browser, user)

    deleted = await a.delete("demo", user)

    assert ok(deleted)["status"] == "disconnected"
    assert await count_rows(db, "connections", subject=subject, audience=a.name) == 0
    assert await count_rows(db, "connections", subject=subject, audience="mcp") == 1
    assert [item["provider"] for item in await mcp_connections(mcp, token)] == ["demo"]


async def test_k3_a_flow_for_an_asserted_user_completes_only_in_that_users_browser(
    apis: tuple[ServiceApi, ServiceApi],
    browser: Browser,
    second_browser: Browser,
    broker: BrokerProcess,
    idp: IdpProcess,
    db: AsyncEngine,
) -> None:
    """K3. The user a sibling asserts is bound into the flow: another account's browser gets the
    "different account" refusal (logged, flow untouched, no key form), and only the named user's
    login completes it."""
    a, _ = apis
    victim = {"issuer": idp.issuer, "subject": fresh_user("k3-named")}
    first, flow_id = input_required(await a.require("demo", victim))
    log = LogWindow(broker)

    await second_browser.login_as(fresh_user("k3-other"), next_path=f"/connect/{flow_id}")
    refused = await second_browser.get(f"/connect/{flow_id}")
    untouched = await flow_row(db, flow_id) or {}
    await submit_api_key(browser, victim["subject"], flow_id)
    resumed = await a.resume("demo", victim, first["requestState"])

    assert refused.status_code == 403
    assert "different account" in refused.text
    assert 'name="api_key"' not in refused.text
    assert await log.shows("connect.identity_mismatch")
    assert untouched["status"] == "pending"
    assert connected(resumed)["secret"] == API_KEY


# ------------------------------------------------------------------------------------------------
# A dedicated broker that shares: b reads a's connections, c reads the broker's own ("mcp")
# ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Sharing:
    idp: IdpProcess
    broker: BrokerProcess
    services: dict[str, Registered]

    def user(self, label: str) -> dict[str, str]:
        return {"issuer": self.idp.issuer, "subject": fresh_user(label)}

    def token(self, subject: str) -> str:
        return mint_token(
            self.idp.signing_jwk,
            issuer=self.idp.issuer,
            audience=self.broker.mcp_url,
            subject=subject,
        )


@pytest.fixture(scope="module")
def sharing(workdir: Path) -> Iterator[Sharing]:
    """A broker whose config shares a's connections with b and the broker's own with c; its own
    IdP knows its login callback and /mcp resource."""
    services = {
        "b": {"share_from": ["a"], "display_name": "Beta Tools"},
        "c": {"share_from": ["mcp"]},
    }
    with running_stack(
        workdir, "sharing", providers={"demo": DEMO_PROVIDER}, services=services
    ) as stack:
        registered = {name: register(stack.broker, name) for name in ("a", "b", "c")}
        yield Sharing(stack.idp, stack.broker, registered)


@dataclass
class SharingClients:
    apis: dict[str, ServiceApi]
    browser: Browser
    mcp: McpHttp
    db: AsyncEngine


@pytest.fixture
async def shared(sharing: Sharing) -> AsyncIterator[SharingClients]:
    broker = sharing.broker
    clients = SharingClients(
        apis={name: ServiceApi(broker.url, service) for name, service in sharing.services.items()},
        browser=Browser(broker.url),
        mcp=McpHttp(broker.mcp_url),
        db=create_engine(broker.database_url, pool_size=1),
    )
    yield clients
    for api in clients.apis.values():
        await api.aclose()
    await clients.browser.aclose()
    await clients.mcp.aclose()
    await clients.db.dispose()


async def test_k2_share_from_lets_b_read_as_connection_but_not_delete_it(
    sharing: Sharing, shared: SharingClients
) -> None:
    """K2. With share_from = ["a"], B reads the user's connection made through A (credential,
    require without any flow, list with owner "a"), but its DELETE is 404: A's stays intact."""
    a, b = shared.apis["a"], shared.apis["b"]
    user = sharing.user("k2-shared")
    await connect_demo(a, shared.browser, user)

    fetched = await b.credential("demo", user)
    required = await b.require("demo", user, client_capabilities={})
    listed = ok(await b.connections(user))["connections"]
    deleted = await b.delete("demo", user)

    assert ok(fetched)["secret"] == API_KEY
    assert connected(required)["secret"] == API_KEY
    assert [(item["provider"], item["owner"]) for item in listed] == [("demo", "a")]
    problem(deleted, 404, "not_connected")
    assert connected(await a.require("demo", user))["secret"] == API_KEY
    assert await count_rows(shared.db, "connections", subject=user["subject"], audience="a") == 1
    assert await count_rows(shared.db, "flows", subject=user["subject"]) == 1


async def test_k2_share_from_is_one_way(sharing: Sharing, shared: SharingClients) -> None:
    """K2. B reading A's does not let A read B's: a connection made through B stays B's alone
    (and C, sharing only "mcp", sees neither)."""
    a, b, c = shared.apis["a"], shared.apis["b"], shared.apis["c"]
    user = sharing.user("k2-one-way")
    await connect_demo(b, shared.browser, user)

    from_a = await a.credential("demo", user)
    from_c = await c.credential("demo", user)
    listed_by_b = ok(await b.connections(user))["connections"]

    problem(from_a, 404, "not_connected")
    problem(from_c, 404, "not_connected")
    assert [(item["provider"], item["owner"]) for item in listed_by_b] == [("demo", "b")]


async def test_k2_share_from_mcp_lets_c_read_the_brokers_connection_but_not_delete_it(
    sharing: Sharing, shared: SharingClients
) -> None:
    """K2. With share_from = ["mcp"], C reads what the user connected through the broker's own
    connect_account (owner "mcp"), cannot delete it, and A (no sharing) still sees nothing."""
    a, c = shared.apis["a"], shared.apis["c"]
    user = sharing.user("k2-mcp-shared")
    token = sharing.token(user["subject"])
    await connect_via_mcp(shared.mcp, shared.browser, token, user["subject"])

    fetched = await c.credential("demo", user)
    listed = ok(await c.connections(user))["connections"]
    deleted = await c.delete("demo", user)
    from_a = await a.credential("demo", user)

    assert ok(fetched)["secret"] == MCP_KEY
    assert [(item["provider"], item["owner"]) for item in listed] == [("demo", "mcp")]
    problem(deleted, 404, "not_connected")
    problem(from_a, 404, "not_connected")
    assert [item["provider"] for item in await mcp_connections(shared.mcp, token)] == ["demo"]


async def test_shared_and_own_connections_are_listed_with_their_owners(
    sharing: Sharing, shared: SharingClients
) -> None:
    """B's list shows its own connection and the one it shares from A, each with its owner; its
    credential read prefers its own."""
    a, b = shared.apis["a"], shared.apis["b"]
    user = sharing.user("both")
    own = "sk_CANARYKEY_isolation_own_b"
    await connect_demo(b, shared.browser, user, own)
    await connect_demo(a, shared.browser, user)

    listed = ok(await b.connections(user))["connections"]
    fetched = ok(await b.credential("demo", user))

    assert [(item["provider"], item["owner"]) for item in listed] == [("demo", "b"), ("demo", "a")]
    assert fetched["secret"] == own


async def test_display_name_names_the_service_on_the_connect_page(
    sharing: Sharing, shared: SharingClients
) -> None:
    """`[services.b] display_name` is how the page names the sibling, before the client's name."""
    b = shared.apis["b"]
    user = sharing.user("display")
    _, flow_id = input_required(await b.require("demo", user))

    await shared.browser.login_as(user["subject"], next_path=f"/connect/{flow_id}")
    page = await shared.browser.get(f"/connect/{flow_id}")

    assert (
        "<strong>Beta Tools</strong> (via a client that calls itself “Claude”) asks to use your "
        "Demo API key" in page.text
    )
    assert (await flow_row(shared.db, flow_id) or {})["audience"] == "b"
