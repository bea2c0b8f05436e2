"""One connect round, decided once (app/connect/require.py, app/connect/rounds.py): the same
scenario on `/mcp` (`connect_account`) and on the integration API (`require` / `resume`) gets the
same decision.

Each surface's answer is read from the wire (schema-checked) into a `Decision`; a test runs its
scenario on both surfaces, each with a user of its own, and compares the two runs with each other
and with the decided behaviour: the scopes a new flow asks for (provider defaults, then those asked
for, then those already granted), scopes asked of an API-key provider (ignored), the audiences read
(`share_from`), too many open links (the same text), a client without URL-mode elicitation (no
flow; a connected user still gets the credential; a retry is not asked the URL again) and the
user who finished in the browser before the client's decline arrived (connected).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import httpx2
import pytest
from sqlalchemy.ext.asyncio import AsyncEngine

from app.connect.require import TOO_MANY_OPEN_FLOWS
from app.connect.service import MAX_OPEN_FLOWS
from app.db import create_engine

from ..conftest import DEMO_PROVIDER, count_rows, flow_row
from ..integration_api.test_api import (
    API_KEY,
    Registered,
    ServiceApi,
    authorize_github,
    fresh_name,
    register,
    submit_api_key,
)
from ..support.broker import BrokerProcess
from ..support.clients import URL_CAPS, Browser, McpHttp, flow_id_from
from ..support.idp import IdpProcess
from ..support.schema import validate_response
from ..support.stack import Stack, running_stack
from . import unique

pytestmark = pytest.mark.both_databases

URL_CAPABILITY: dict[str, Any] = {"elicitation": {"url": {}}}
WITHOUT_URL = [{}, {"elicitation": {}}, {"elicitation": {"form": {}}}]


@dataclass(frozen=True)
class Decision:
    """A surface's answer, in the terms both share. `kind`: connected, elicit,
    needs_url_capability, refused (with `text`) or ended (with `text`, the flow's status)."""

    kind: str
    text: str | None = None
    flow_id: str | None = field(default=None, compare=False)
    retry: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)


CONNECTED = Decision("connected")
ELICIT = Decision("elicit")
NEEDS_URL = Decision("needs_url_capability")


class Surface(Protocol):
    """One way in: a user of its own (with a browser of their own) asks for a provider's
    credential, and retries."""

    subject: str
    browser: Browser

    async def require(
        self,
        provider: str,
        scopes: tuple[str, ...] = (),
        capabilities: Any = URL_CAPS,
        call: str = "",
    ) -> Decision:
        """`call`: names the client's call (its arguments on `/mcp`, the sibling's request
        digest on the API): a repeated call is handed the user's open link of that call."""
        ...

    async def resume(
        self, elicited: Decision, action: str, capabilities: Any = URL_CAPS
    ) -> Decision: ...


class McpSurface:
    """`tools/call connect_account` on the broker's own endpoint."""

    def __init__(self, mcp: McpHttp, token: str, subject: str, browser: Browser) -> None:
        self.mcp, self.token, self.subject, self.browser = mcp, token, subject, browser

    async def require(
        self,
        provider: str,
        scopes: tuple[str, ...] = (),
        capabilities: Any = URL_CAPS,
        call: str = "",
    ) -> Decision:
        arguments: dict[str, Any] = {"provider": provider}
        if scopes:
            arguments["scopes"] = list(scopes)
        if call:  # a scope of its own, which an API-key provider ignores
            arguments["scopes"] = [*scopes, call]
        response = await self.mcp.call_tool(
            self.token, "connect_account", arguments, capabilities=capabilities
        )
        return self._decision(response, arguments)

    async def resume(
        self, elicited: Decision, action: str, capabilities: Any = URL_CAPS
    ) -> Decision:
        response = await self.mcp.call_tool(
            self.token,
            "connect_account",
            elicited.retry["arguments"],
            capabilities=capabilities,
            input_responses={elicited.retry["key"]: {"action": action}},
            request_state=elicited.retry["state"],
        )
        return self._decision(response, elicited.retry["arguments"])

    @staticmethod
    def _decision(response: httpx2.Response, arguments: dict[str, Any]) -> Decision:
        body = response.json()
        validate_response(body)
        if response.status_code == 400:
            assert body["error"]["code"] == -32021, body
            assert body["error"]["data"] == {"requiredCapabilities": URL_CAPABILITY}
            return NEEDS_URL
        assert response.status_code == 200, response.text
        result = body["result"]
        if result["resultType"] == "input_required":
            validate_response(body, "InputRequiredResult")
            key, flow_id = flow_id_from(result)
            retry = {"arguments": arguments, "key": key, "state": result["requestState"]}
            return Decision("elicit", flow_id=flow_id, retry=retry)
        validate_response(body, "CallToolResult")
        structured = result.get("structuredContent") or {}
        if not result.get("isError"):
            assert structured["status"] == "connected", result
            return CONNECTED
        if "status" in structured:
            return Decision("ended", structured["status"])
        return Decision("refused", result["content"][0]["text"])


class ApiSurface:
    """`POST /api/v1/connections/{provider}/require` and `…/resume` of a sibling service."""

    def __init__(self, api: ServiceApi, issuer: str, subject: str, browser: Browser) -> None:
        self.api, self.subject, self.browser = api, subject, browser
        self.user = {"issuer": issuer, "subject": subject}

    async def require(
        self,
        provider: str,
        scopes: tuple[str, ...] = (),
        capabilities: Any = URL_CAPS,
        call: str = "",
    ) -> Decision:
        response = await self.api.require(
            provider,
            self.user,
            scopes=list(scopes),
            client_capabilities=capabilities,
            **({"request_digest": call} if call else {}),
        )
        return self._decision(response, provider, scopes, call)

    async def resume(
        self, elicited: Decision, action: str, capabilities: Any = URL_CAPS
    ) -> Decision:
        provider, scopes = elicited.retry["provider"], elicited.retry["scopes"]
        call = elicited.retry["call"]
        response = await self.api.resume(
            provider,
            self.user,
            elicited.retry["state"],
            {"action": action},
            scopes=list(scopes),
            client_capabilities=capabilities,
            **({"request_digest": call} if call else {}),
        )
        return self._decision(response, provider, scopes, call)

    @staticmethod
    def _decision(
        response: httpx2.Response, provider: str, scopes: tuple[str, ...], call: str
    ) -> Decision:
        assert response.status_code == 200, response.text
        body = response.json()
        status = body["status"]
        if status == "connected":
            assert set(body) == {"status", "credential"}
            assert body["credential"]["provider"] == provider
            return CONNECTED
        if status == "input_required":
            assert set(body) == {"status", "inputRequests", "requestState"}
            result = {key: body[key] for key in ("inputRequests", "requestState")}
            wire = {"jsonrpc": "2.0", "id": 1, "result": {"resultType": status, **result}}
            validate_response(wire, "InputRequiredResult")
            _, flow_id = flow_id_from(result)
            state = body["requestState"]
            retry = {"provider": provider, "scopes": scopes, "call": call, "state": state}
            return Decision("elicit", flow_id=flow_id, retry=retry)
        if status == "missing_capability":
            assert body == {"status": status, "requiredCapabilities": URL_CAPABILITY}
            return NEEDS_URL
        if "message" in body:
            assert body == {"status": "failed", "message": body["message"]}
            return Decision("refused", body["message"])
        assert set(body) == {"status"}, body
        return Decision("ended", status)


MakeSurfaces = Callable[[str], Awaitable[tuple[Surface, Surface]]]


@pytest.fixture(scope="module")
def service(broker: BrokerProcess) -> Registered:
    return register(broker, fresh_name("one-round"))


@pytest.fixture
async def surfaces(
    broker: BrokerProcess, service: Registered, idp: IdpProcess, mcp: McpHttp, token_for: Any
) -> AsyncIterator[MakeSurfaces]:
    """`await surfaces("label")`: (the `/mcp` surface, the API surface), each with a fresh user
    of the session broker."""
    api = ServiceApi(broker.url, service)
    browsers: list[Browser] = []

    async def make(label: str) -> tuple[Surface, Surface]:
        on_mcp, on_api = unique(f"{label}-mcp"), unique(f"{label}-api")
        browsers.extend((Browser(broker.url), Browser(broker.url)))
        return (
            McpSurface(mcp, token_for(on_mcp), on_mcp, browsers[-2]),
            ApiSurface(api, idp.issuer, on_api, browsers[-1]),
        )

    yield make
    await api.aclose()
    for browser in browsers:
        await browser.aclose()


async def scopes_of(db: AsyncEngine, decision: Decision) -> str:
    assert decision.kind == "elicit", decision
    scopes: str = (await flow_row(db, decision.flow_id or "") or {})["scopes"]
    return scopes


# ------------------------------------------------------------------------------------------------
# Scopes
# ------------------------------------------------------------------------------------------------


async def test_a_step_up_asks_for_defaults_then_the_new_scopes_then_the_granted_ones(
    surfaces: MakeSurfaces, db: AsyncEngine
) -> None:
    """The user holds GitHub with `read:user repo`; a call needing `workflow gist` starts a flow
    asking for the provider default, the scopes asked for in their order, then the granted
    ones, each once: the same on both surfaces."""
    runs = []
    for surface in await surfaces("step-up"):
        first = await surface.require("github", ("repo",))
        first_scopes = await scopes_of(db, first)
        await authorize_github(surface.browser, surface.subject, first.flow_id or "")
        done = await surface.resume(first, "accept")
        stepped = await surface.require("github", ("workflow", "gist"))
        runs.append((first_scopes, done, await scopes_of(db, stepped)))

    assert runs[0] == runs[1] == ("read:user repo", CONNECTED, "read:user workflow gist repo")


async def test_scopes_asked_of_an_api_key_provider_are_ignored(
    surfaces: MakeSurfaces, db: AsyncEngine
) -> None:
    """An API key has no scopes: the flow asks for none, and the key serves any scopes."""
    runs = []
    for surface in await surfaces("key-scopes"):
        first = await surface.require("demo", ("admin",))
        first_scopes = await scopes_of(db, first)
        await submit_api_key(surface.browser, surface.subject, first.flow_id or "")
        done = await surface.resume(first, "accept")
        again = await surface.require("demo", ("admin", "write"))
        flows = await count_rows(db, "flows", subject=surface.subject)
        runs.append((first_scopes, done, again, flows))

    assert runs[0] == runs[1] == ("", CONNECTED, CONNECTED, 1)


# ------------------------------------------------------------------------------------------------
# Capabilities, limits, races
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("capabilities", WITHOUT_URL, ids=["none", "empty", "form-only"])
async def test_without_url_elicitation_no_flow_starts_but_a_connected_user_is_served(
    capabilities: dict[str, Any], surfaces: MakeSurfaces, db: AsyncEngine
) -> None:
    """URL mode only for a client that declared it in this request: no flow is started for
    another; once connected, the credential needs no elicitation, so the same client gets it."""
    runs = []
    for surface in await surfaces("no-url"):
        refused = await surface.require("demo", capabilities=capabilities)
        flows_before = await count_rows(db, "flows", subject=surface.subject)
        first = await surface.require("demo")
        await submit_api_key(surface.browser, surface.subject, first.flow_id or "")
        await surface.resume(first, "accept")
        runs.append(
            (refused, flows_before, await surface.require("demo", capabilities=capabilities))
        )

    assert runs[0] == runs[1] == (NEEDS_URL, 0, CONNECTED)


@pytest.mark.parametrize("capabilities", WITHOUT_URL, ids=["none", "empty", "form-only"])
async def test_a_retry_without_url_elicitation_is_not_asked_the_url_again(
    capabilities: dict[str, Any], surfaces: MakeSurfaces, db: AsyncEngine
) -> None:
    """The capability is this request's: a retry that no longer declares URL mode is not
    elicited again while the flow is open (the flow stays open); once the user has finished,
    the same retry is connected, which asks nothing."""
    runs = []
    for surface in await surfaces("retry-no-url"):
        first = await surface.require("demo")
        refused = await surface.resume(first, "accept", capabilities)
        status = (await flow_row(db, first.flow_id or "") or {})["status"]
        await submit_api_key(surface.browser, surface.subject, first.flow_id or "")
        runs.append((refused, status, await surface.resume(first, "accept", capabilities)))

    assert runs[0] == runs[1] == (NEEDS_URL, "pending", CONNECTED)


async def test_too_many_open_links_is_refused_with_the_same_text(
    surfaces: MakeSurfaces, db: AsyncEngine
) -> None:
    """A user with the maximum of unfinished links gets no new one, told the same thing; a
    call already open still gets its link."""
    runs = []
    for surface in await surfaces("too-many"):
        opened = [await surface.require("demo", call=f"call-{n}") for n in range(MAX_OPEN_FLOWS)]
        refused = await surface.require("demo", call="one-more")
        again = await surface.require("demo", call="call-0")  # a call already open
        flows = await count_rows(db, "flows", subject=surface.subject)
        same_link = again.flow_id == opened[0].flow_id
        runs.append(({decision.kind for decision in opened}, refused, same_link, flows))

    expected = ({"elicit"}, Decision("refused", TOO_MANY_OPEN_FLOWS), True, MAX_OPEN_FLOWS)
    assert runs[0] == runs[1] == expected


async def test_a_repeated_call_is_handed_the_same_link(
    surfaces: MakeSurfaces, db: AsyncEngine
) -> None:
    """The same call again while its link is open gets that link (one flow, one URL), with a
    state of its own that resumes it; another call gets a link of its own."""
    runs = []
    for surface in await surfaces("same-call"):
        first = await surface.require("demo", call="list-issues")
        again = await surface.require("demo", call="list-issues")
        other = await surface.require("demo", call="list-pulls")
        await submit_api_key(surface.browser, surface.subject, first.flow_id or "")
        resumed = await surface.resume(again, "accept")
        flows = await count_rows(db, "flows", subject=surface.subject)
        runs.append(
            (again.flow_id == first.flow_id, other.flow_id != first.flow_id, resumed, flows)
        )

    assert runs[0] == runs[1] == (True, True, CONNECTED, 2)


async def test_a_services_open_links_leave_the_users_own_places(
    broker: BrokerProcess, service: Registered, idp: IdpProcess, mcp: McpHttp, token_for: Any
) -> None:
    """The cap counts per audience: a sibling service that leaves the maximum of links open for
    a user refuses its next one, and the user's own client still gets a link."""
    subject = unique("capped-by-service")
    api = ServiceApi(broker.url, service)
    browser = Browser(broker.url)
    try:
        through_service = ApiSurface(api, idp.issuer, subject, browser)
        opened = [
            await through_service.require("demo", call=f"call-{n}") for n in range(MAX_OPEN_FLOWS)
        ]
        refused = await through_service.require("demo", call="one-more")
        own = await McpSurface(mcp, token_for(subject), subject, browser).require("demo")
    finally:
        await api.aclose()
        await browser.aclose()

    assert {decision.kind for decision in opened} == {"elicit"}
    assert refused == Decision("refused", TOO_MANY_OPEN_FLOWS)
    assert own.kind == "elicit"


@pytest.mark.parametrize("action", ["decline", "cancel"])
async def test_a_decline_after_the_user_connected_is_connected(
    action: str, surfaces: MakeSurfaces, db: AsyncEngine
) -> None:
    """The user finished in the browser before the client's decline or cancel arrived: the
    connection exists, so both surfaces answer connected and the flow is consumed."""
    runs = []
    for surface in await surfaces(f"late-{action}"):
        first = await surface.require("demo")
        await submit_api_key(surface.browser, surface.subject, first.flow_id or "")
        late = await surface.resume(first, action)
        status = (await flow_row(db, first.flow_id or "") or {})["status"]
        runs.append((late, status))

    assert runs[0] == runs[1] == (CONNECTED, "consumed")


# ------------------------------------------------------------------------------------------------
# Audiences: a broker whose service "reader" shares from "mcp"
# ------------------------------------------------------------------------------------------------


@dataclass
class Sharing:
    stack: Stack
    reader: Registered
    loner: Registered


@pytest.fixture(scope="module")
def sharing(workdir: Path) -> Iterator[Sharing]:
    with running_stack(
        workdir,
        unique("one-round-sharing"),
        providers={"demo": DEMO_PROVIDER},
        services={"reader": {"share_from": ["mcp"]}},
    ) as stack:
        yield Sharing(stack, register(stack.broker, "reader"), register(stack.broker, "loner"))


async def test_audiences_are_read_in_order_and_a_new_flow_belongs_to_the_first(
    sharing: Sharing,
) -> None:
    """A connection made through `/mcp` serves `/mcp` and a service sharing from "mcp" (no
    flow); a service that does not share starts a flow of its own audience, as `/mcp` does for a
    connection made through a service."""
    broker = sharing.stack.broker
    mcp, browsers = McpHttp(broker.mcp_url), (Browser(broker.url), Browser(broker.url))
    reader, loner = ServiceApi(broker.url, sharing.reader), ServiceApi(broker.url, sharing.loner)
    db = create_engine(broker.database_url, pool_size=1)
    issuer, token = sharing.stack.idp.issuer, sharing.stack.token
    try:
        subject = unique("shares")
        own = McpSurface(mcp, token(subject), subject, browsers[0])
        first = await own.require("demo")
        await submit_api_key(own.browser, subject, first.flow_id or "")
        assert await own.resume(first, "accept") == CONNECTED
        served = [
            await surface.require("demo")
            for surface in (own, ApiSurface(reader, issuer, subject, own.browser))
        ]
        elsewhere = await ApiSurface(loner, issuer, subject, own.browser).require("demo")

        alone = unique("alone")
        through_service = ApiSurface(loner, issuer, alone, browsers[1])
        made = await through_service.require("demo")
        await submit_api_key(through_service.browser, alone, made.flow_id or "", API_KEY)
        assert await through_service.resume(made, "accept") == CONNECTED
        not_shared = [
            await surface.require("demo")
            for surface in (
                McpSurface(mcp, token(alone), alone, browsers[1]),
                ApiSurface(reader, issuer, alone, browsers[1]),
            )
        ]

        assert served == [CONNECTED, CONNECTED]
        assert elsewhere == ELICIT
        assert (await flow_row(db, elsewhere.flow_id or "") or {})["audience"] == "loner"
        assert await count_rows(db, "flows", subject=subject) == 2
        assert not_shared == [ELICIT, ELICIT]
        audiences = [(await flow_row(db, d.flow_id or "") or {})["audience"] for d in not_shared]
        assert audiences == ["mcp", "reader"]
    finally:
        await mcp.aclose()
        for browser in browsers:
            await browser.aclose()
        await reader.aclose()
        await loner.aclose()
        await db.dispose()
