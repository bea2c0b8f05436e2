"""The Python helper for sibling servers (`connect_broker_client`) against the session broker.

A real `MCPServer` (the sibling: the SDK's own HTTP app, bearer auth and requestState boundary)
is served by uvicorn in a background thread, with the helper's token verifier checking JWTs signed
by the session IdP for the sibling's audience. Its tools call `broker.require`; raw MCP requests
drive the rounds, and the browser emulation finishes flows on the broker's pages. What the helper
sends to the broker is recorded at its HTTP client.
"""

from __future__ import annotations

import hashlib
import json
import secrets
import socket
import threading
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import httpx2
import pytest
import uvicorn
from mcp.server.auth.settings import AuthSettings
from mcp.server.mcpserver import Context, MCPServer, RequestStateSecurity
from pydantic import BaseModel
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from connect_broker_client import BrokerRefused, ConnectBroker, IdpTokenVerifier

from ..conftest import count_rows, flow_row
from ..support.broker import BrokerProcess, cli
from ..support.clients import Browser, flow_id_from, provider_url, request_body, request_headers
from ..support.http import local_client
from ..support.idp import IdpProcess, free_port, generate_rsa_jwk, mint_token
from ..support.schema import validate_response

pytestmark = pytest.mark.both_databases

START_TIMEOUT = 10.0
STOP_TIMEOUT = 5.0
API_KEY = "sk_CANARYKEY_helper_1"
URL_ONLY: dict[str, Any] = {"elicitation": {"url": {}}}


def fingerprint(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()[:16]


def fresh_user(label: str) -> str:
    return f"{label}-{secrets.token_hex(4)}"


class Fingerprint(BaseModel):
    sha256: str


class Both(BaseModel):
    demo_sha256: str
    github_account: str


class Standing(BaseModel):
    connected: bool
    providers: list[str]
    removed: bool | None


class Holding(BaseModel):
    account: str | None
    sha256: str | None
    removed: bool | None
    refused: str | None


@dataclass
class BrokerCalls:
    """What the helper sent to the broker's /api/v1, and what it got back."""

    requests: list[httpx2.Request] = field(default_factory=list)
    answers: list[dict[str, Any]] = field(default_factory=list)

    async def on_request(self, request: httpx2.Request) -> None:
        self.requests.append(request)

    async def on_response(self, response: httpx2.Response) -> None:
        await response.aread()
        self.answers.append(response.json())

    def paths(self) -> list[str]:
        return [f"{r.method} {r.url.path}" for r in self.requests]

    def bodies(self) -> list[dict[str, Any]]:
        return [json.loads(r.content) if r.content else {} for r in self.requests]


class Sibling:
    """The sibling's real Starlette app (auth, transport, request-state boundary) served by
    uvicorn in a background thread on a loopback port; its audience is its own /mcp URL."""

    def __init__(
        self,
        idp: IdpProcess,
        broker_url: str,
        secret: str,
        *,
        state_keys: list[str] | None = None,
        audience: str | None = None,
        user_proof: bool = False,
    ) -> None:
        self.idp = idp
        self.calls = BrokerCalls()
        self._socket = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._socket.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self._socket.getsockname()[1]}"
        self.audience = audience or f"{self.url}/mcp"  # replicas share their public URL
        server = build_sibling(
            idp, broker_url, secret, self.audience, self.calls, state_keys, user_proof=user_proof
        )
        app = server.streamable_http_app(json_response=True, stateless_http=True)
        config = uvicorn.Config(app, log_config=None, log_level="warning", access_log=False)
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(
            target=self._server.run, kwargs={"sockets": [self._socket]}, daemon=True
        )

    def __enter__(self) -> Sibling:
        self._thread.start()
        deadline = time.monotonic() + START_TIMEOUT
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the sibling did not start")
            time.sleep(0.01)
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.should_exit = True
        self._thread.join(STOP_TIMEOUT)

    def token(self, user: str, **overrides: Any) -> str:
        """An access token for this sibling, signed with the session IdP's key."""
        options: dict[str, Any] = {
            "issuer": self.idp.issuer,
            "audience": self.audience,
            "subject": user,
        }
        return mint_token(self.idp.signing_jwk, **(options | overrides))

    async def call(
        self,
        token: str,
        tool: str,
        arguments: dict[str, Any] | None = None,
        *,
        capabilities: dict[str, Any] | None = None,
        input_responses: dict[str, Any] | None = None,
        request_state: str | None = None,
    ) -> httpx2.Response:
        params: dict[str, Any] = {"name": tool, "arguments": arguments or {}}
        if input_responses is not None:
            params["inputResponses"] = input_responses
        if request_state is not None:
            params["requestState"] = request_state
        body = request_body("tools/call", params, capabilities=capabilities)
        async with local_client(timeout=30) as http:
            return await http.post(
                f"{self.url}/mcp", json=body, headers=request_headers(body, token)
            )

    async def answer(
        self, token: str, tool: str, asked: dict[str, Any], action: str = "accept"
    ) -> httpx2.Response:
        """The retry of `tool` that answers the connect request in `asked` (the result that
        held it) with `action`, sending back that result's requestState."""
        key, _ = flow_id_from(asked)
        return await self.call(
            token,
            tool,
            input_responses={key: {"action": action}},
            request_state=asked["requestState"],
        )


def build_sibling(
    idp: IdpProcess,
    broker_url: str,
    secret: str,
    audience: str,
    calls: BrokerCalls,
    state_keys: list[str] | None,
    *,
    user_proof: bool = False,
) -> MCPServer[Any]:
    recorded = local_client(
        timeout=30,
        event_hooks={"request": [calls.on_request], "response": [calls.on_response]},
    )
    broker = ConnectBroker(broker_url, secret, http=recorded, user_proof=user_proof)
    verifier = IdpTokenVerifier(idp.issuer, audience)

    @asynccontextmanager
    async def lifespan(_: MCPServer[Any]) -> AsyncIterator[dict[str, Any]]:
        try:
            yield {}
        finally:
            await recorded.aclose()
            await verifier.aclose()

    server: MCPServer[Any] = MCPServer(
        "helper-test-sibling",
        version="1.0.0",
        lifespan=lifespan,
        token_verifier=verifier,
        auth=AuthSettings(
            issuer_url=idp.issuer, resource_server_url=audience, validate_token_resource=True
        ),
        request_state_security=RequestStateSecurity(keys=state_keys) if state_keys else None,
    )
    broker.install(server)

    @server.tool()
    async def demo_fingerprint(ctx: Context[Any, Any], note: str = "") -> Fingerprint:
        return Fingerprint(sha256=fingerprint(await broker.require(ctx, "demo")))

    @server.tool()
    async def demo_and_github(ctx: Context[Any, Any]) -> Both:
        demo = await broker.require(ctx, "demo")
        github = await broker.require_credential(ctx, "github")
        return Both(demo_sha256=fingerprint(demo), github_account=github.account or "")

    @server.tool()
    async def demo_standing(ctx: Context[Any, Any], disconnect: bool = False) -> Standing:
        found = await broker.credential(ctx, "demo")
        listed = await broker.connections(ctx)
        removed = await broker.disconnect(ctx, "demo") if disconnect else None
        providers = sorted(item["provider"] for item in listed)
        return Standing(connected=found is not None, providers=providers, removed=removed)

    @server.tool()
    async def github_holding(
        ctx: Context[Any, Any], account: str | None = None, disconnect: bool = False
    ) -> Holding:
        """The GitHub account read (`account`, else the default), then disconnected if asked;
        the broker's refusal of the disconnect answered by its code (test_several_accounts.py)."""
        found = await broker.credential(ctx, "github", account=account)
        removed, refused = None, None
        if disconnect:
            try:
                removed = await broker.disconnect(ctx, "github", account=account)
            except BrokerRefused as refusal:
                refused = refusal.code
        return Holding(
            account=found.account if found is not None else None,
            sha256=fingerprint(found.secret) if found is not None else None,
            removed=removed,
            refused=refused,
        )

    @server.tool()
    async def github_add_account(ctx: Context[Any, Any]) -> Holding:
        """Connect another GitHub account even though one is held (test_several_accounts.py)."""
        added = await broker.require_credential(ctx, "github", new_account=True)
        return Holding(
            account=added.account, sha256=fingerprint(added.secret), removed=None, refused=None
        )

    return server


@pytest.fixture(scope="module")
def service(broker: BrokerProcess) -> tuple[str, str]:
    """A sibling registered for demo and github: (name, secret)."""
    name = f"helper-{secrets.token_hex(3)}"
    created = cli(
        "service", "create", name, "--providers", "demo,github", config_path=broker.config_path
    )
    assert created.returncode == 0, created.stderr
    return name, created.stdout.strip()


@pytest.fixture(scope="module")
def shared_sibling(
    idp: IdpProcess, broker: BrokerProcess, service: tuple[str, str]
) -> Iterator[Sibling]:
    with Sibling(idp, broker.url, service[1]) as running:
        yield running


@pytest.fixture
def sibling(shared_sibling: Sibling) -> Sibling:
    """The module's sibling, with a fresh record of its calls to the broker."""
    shared_sibling.calls.requests.clear()
    shared_sibling.calls.answers.clear()
    return shared_sibling


def result_of(response: httpx2.Response, kind: str | None = None) -> dict[str, Any]:
    assert response.status_code == 200, response.text
    body = response.json()
    validate_response(body, kind)
    result: dict[str, Any] = body["result"]
    return result


async def enter_key(browser: Browser, user: str, flow_id: str) -> str:
    """Sign in as `user` on the flow's page, save the API key; the page the user saw first."""
    await browser.login_as(user, next_path=f"/connect/{flow_id}")
    page = await browser.get(f"/connect/{flow_id}")
    csrf = await browser.csrf_token(f"/connect/{flow_id}")
    saved = await browser.post(
        f"/connect/{flow_id}/api-key", data={"csrf": csrf, "api_key": API_KEY}
    )
    assert saved.status_code == 303, saved.text
    return page.text


async def approve_at_github(browser: Browser, flow_id: str) -> str:
    """Press Continue, let the fake GitHub approve, follow the callback; the landing page."""
    csrf = await browser.csrf_token(f"/connect/{flow_id}")
    started = await browser.post(f"/connect/{flow_id}/start", data={"csrf": csrf})
    approved = await browser.http.get(provider_url(started))
    callback = urlsplit(approved.headers["location"])
    landed = await browser.get(f"{callback.path}?{callback.query}")
    assert landed.status_code == 303, landed.text
    return (await browser.get(landed.headers["location"])).text


async def connect_demo(sibling: Sibling, browser: Browser, token: str, user: str) -> None:
    first = result_of(await sibling.call(token, "demo_fingerprint"))
    _, flow_id = flow_id_from(first)
    await enter_key(browser, user, flow_id)
    done = result_of(await sibling.answer(token, "demo_fingerprint", first))
    assert done["structuredContent"] == {"sha256": fingerprint(API_KEY)}


async def test_tool_answers_the_brokers_elicitation_then_the_credential_on_the_retry(
    sibling: Sibling,
    browser: Browser,
    broker: BrokerProcess,
    idp: IdpProcess,
    service: tuple[str, str],
    db: AsyncEngine,
) -> None:
    """DESIGN §3.2: the sibling returns the broker's input request verbatim; the retry resumes."""
    name, secret = service
    user = fresh_user("helper-main")
    token = sibling.token(user)

    first = result_of(await sibling.call(token, "demo_fingerprint"), "InputRequiredResult")
    key, flow_id = flow_id_from(first)
    page = await enter_key(browser, user, flow_id)
    second = result_of(
        await sibling.answer(token, "demo_fingerprint", first),
        "CallToolResult",
    )

    required, resumed = sibling.calls.answers
    assert sibling.calls.paths() == [
        "POST /api/v1/connections/demo/require",
        "POST /api/v1/connections/demo/resume",
    ]
    assert first["inputRequests"] == required["inputRequests"]  # verbatim
    assert first["_meta"] == {
        "io.modelcontextprotocol/serverInfo": {"name": "helper-test-sibling", "version": "1.0.0"}
    }
    assert first["inputRequests"][key]["params"]["url"] == f"{broker.url}/connect/{flow_id}"
    # The SDK seals its envelope around the broker's state, which returns to the broker intact.
    assert required["requestState"] not in first["requestState"]
    require_body, resume_body = sibling.calls.bodies()
    assert resume_body["request_state"] == required["requestState"]
    assert resume_body["input_response"] == {"action": "accept"}
    assert require_body["user"] == resume_body["user"] == {"issuer": idp.issuer, "subject": user}
    assert require_body["request_digest"] == resume_body["request_digest"]
    assert require_body["client_capabilities"]["elicitation"]["url"] == {}
    assert f"<strong>{name}</strong> (via a client that calls itself “test-client”)" in page
    assert resumed["status"] == "connected"
    assert second["structuredContent"] == {"sha256": fingerprint(API_KEY)}
    assert second["isError"] is False
    assert API_KEY not in json.dumps(second)
    for request in sibling.calls.requests:
        assert request.headers["authorization"] == f"Bearer {secret}"
        assert token not in request.content.decode() + str(request.url)
    flow = await flow_row(db, flow_id) or {}
    assert (flow["status"], flow["client_id"], flow["subject"]) == (
        "consumed",
        f"service:{name}",
        user,
    )


async def test_a_connected_user_gets_the_result_without_being_asked(
    sibling: Sibling, browser: Browser
) -> None:
    """The broker answers "connected" on the first round: one call to the broker, no prompt."""
    user = fresh_user("helper-again")
    token = sibling.token(user)
    await connect_demo(sibling, browser, token, user)
    sibling.calls.requests.clear()
    sibling.calls.answers.clear()

    again = result_of(await sibling.call(token, "demo_fingerprint", {"note": "second"}))

    assert again["resultType"] == "complete"
    assert again["structuredContent"] == {"sha256": fingerprint(API_KEY)}
    assert sibling.calls.paths() == ["POST /api/v1/connections/demo/require"]
    assert [answer["status"] for answer in sibling.calls.answers] == ["connected"]


async def test_the_user_is_the_token_subject_whatever_the_arguments_say(
    sibling: Sibling, browser: Browser, db: AsyncEngine
) -> None:
    """DESIGN §2: the sibling names the user it verified; alice's key never serves bob."""
    alice, bob = fresh_user("helper-alice"), fresh_user("helper-bob")
    await connect_demo(sibling, browser, sibling.token(alice), alice)
    sibling.calls.requests.clear()

    asked = result_of(await sibling.call(sibling.token(bob), "demo_fingerprint", {"note": alice}))

    assert asked["resultType"] == "input_required"
    (body,) = sibling.calls.bodies()
    assert body["user"]["subject"] == bob
    _, flow_id = flow_id_from(asked)
    assert (await flow_row(db, flow_id) or {})["subject"] == bob


async def test_client_without_url_elicitation_gets_missing_capability_and_no_flow(
    sibling: Sibling, db: AsyncEngine
) -> None:
    """SECURITY §0.6: no URL elicitation for a client that did not declare it; -32021, HTTP 400."""
    user = fresh_user("helper-formonly")

    response = await sibling.call(
        sibling.token(user), "demo_fingerprint", capabilities={"elicitation": {"form": {}}}
    )

    assert response.status_code == 400
    body = response.json()
    validate_response(body)
    assert body["error"]["code"] == -32021
    assert body["error"]["data"] == {"requiredCapabilities": URL_ONLY}
    assert await count_rows(db, "flows", subject=user) == 0


@pytest.mark.parametrize(("action", "status"), [("decline", "declined"), ("cancel", "cancelled")])
async def test_decline_or_cancel_on_the_retry_is_an_error_result_and_ends_the_flow(
    sibling: Sibling, db: AsyncEngine, action: str, status: str
) -> None:
    """DESIGN §3.1 step 5 through the helper: an isError result, never a new prompt."""
    user = fresh_user(f"helper-{action}")
    token = sibling.token(user)
    first = result_of(await sibling.call(token, "demo_fingerprint"))
    _, flow_id = flow_id_from(first)

    ended = result_of(
        await sibling.answer(token, "demo_fingerprint", first, action),
        "CallToolResult",
    )

    assert ended["isError"] is True
    assert status in ended["content"][0]["text"]
    assert (await flow_row(db, flow_id) or {})["status"] == status


async def test_retry_of_an_expired_flow_is_an_error_result(
    sibling: Sibling, db: AsyncEngine
) -> None:
    """A flow the sweeper expired answers "expired" (call again for a new link), not a prompt."""
    user = fresh_user("helper-expired")
    token = sibling.token(user)
    first = result_of(await sibling.call(token, "demo_fingerprint"))
    _, flow_id = flow_id_from(first)
    async with db.begin() as connection:
        await connection.execute(
            text("UPDATE flows SET status = 'expired' WHERE id = :id"), {"id": flow_id}
        )

    ended = result_of(
        await sibling.answer(token, "demo_fingerprint", first),
        "CallToolResult",
    )

    assert ended["isError"] is True
    assert "expired" in ended["content"][0]["text"]
    assert [answer["status"] for answer in sibling.calls.answers] == ["input_required", "expired"]


async def test_another_users_state_is_refused_before_the_broker_is_asked(sibling: Sibling) -> None:
    """MRTR: state is bound to the principal; the SDK's envelope refuses it with -32602."""
    alice, bob = fresh_user("helper-owner"), fresh_user("helper-thief")
    first = result_of(await sibling.call(sibling.token(alice), "demo_fingerprint"))

    stolen = await sibling.answer(sibling.token(bob), "demo_fingerprint", first)

    body = stolen.json()
    validate_response(body)
    assert body["error"]["code"] == -32602
    assert sibling.calls.paths() == ["POST /api/v1/connections/demo/require"]


async def test_a_retry_may_land_on_another_instance_that_shares_the_state_keys(
    idp: IdpProcess, broker: BrokerProcess, service: tuple[str, str], browser: Browser
) -> None:
    """Stateless siblings: with RequestStateSecurity(keys=...) any instance resumes the flow."""
    keys, public = [secrets.token_hex(32)], "http://127.0.0.1:8200/mcp"
    user = fresh_user("helper-replica")
    with (
        Sibling(idp, broker.url, service[1], state_keys=keys, audience=public) as one,
        Sibling(idp, broker.url, service[1], state_keys=keys, audience=public) as other,
    ):
        token = one.token(user)
        first = result_of(await one.call(token, "demo_fingerprint"))
        _, flow_id = flow_id_from(first)
        await enter_key(browser, user, flow_id)

        done = result_of(await other.answer(token, "demo_fingerprint", first))

    assert one.url != other.url
    assert done["structuredContent"] == {"sha256": fingerprint(API_KEY)}
    assert [f"{r.method} {r.url.path}" for r in other.calls.requests] == [
        "POST /api/v1/connections/demo/resume"
    ]


async def test_one_call_connects_two_providers_in_turn(
    sibling: Sibling, browser: Browser, fake_github: Any
) -> None:
    """The requestState names its provider, so a second `require` in the same tool resumes its
    own flow while the first one, now connected, answers at once."""
    user = fresh_user("helper-two")
    token = sibling.token(user)
    first = result_of(await sibling.call(token, "demo_and_github"))
    demo_key, demo_flow = flow_id_from(first)
    await enter_key(browser, user, demo_flow)

    second = result_of(await sibling.answer(token, "demo_and_github", first))
    github_key, github_flow = flow_id_from(second)
    landed = await approve_at_github(browser, github_flow)
    third = result_of(await sibling.answer(token, "demo_and_github", second))

    assert (demo_key, github_key) == ("connect_demo", "connect_github")
    assert "Connected as <strong>@octocat</strong>" in landed
    assert third["structuredContent"] == {
        "demo_sha256": fingerprint(API_KEY),
        "github_account": "@octocat",
    }
    assert [p.rsplit("/", 2)[-2:] for p in sibling.calls.paths()] == [
        ["demo", "require"],
        ["demo", "resume"],
        ["github", "require"],
        ["demo", "require"],
        ["github", "resume"],
    ]


async def test_credential_connections_and_disconnect_read_the_services_own_connection(
    sibling: Sibling, browser: Browser
) -> None:
    """The non-eliciting calls: fetch, list and delete this service's connection for the user."""
    user = fresh_user("helper-standing")
    token = sibling.token(user)
    await connect_demo(sibling, browser, token, user)

    before = result_of(await sibling.call(token, "demo_standing", {"disconnect": True}))
    after = result_of(await sibling.call(token, "demo_standing"))

    assert before["structuredContent"] == {
        "connected": True,
        "providers": ["demo"],
        "removed": True,
    }
    assert after["structuredContent"] == {"connected": False, "providers": [], "removed": None}


async def test_an_unreachable_broker_is_an_error_result_without_details(idp: IdpProcess) -> None:
    """A broker outage reaches the model as a retryable isError result, not a stack trace."""
    closed = f"http://127.0.0.1:{free_port()}"
    with Sibling(idp, closed, "cbs_unused") as sibling:
        answer = result_of(await sibling.call(sibling.token("helper-down"), "demo_fingerprint"))

    assert answer["isError"] is True
    assert answer["content"][0]["text"].endswith(
        "Connect Broker is unavailable; try again shortly."
    )
    assert closed not in json.dumps(answer)


async def test_an_unknown_service_secret_is_a_server_error_and_never_a_prompt(
    idp: IdpProcess, broker: BrokerProcess, db: AsyncEngine
) -> None:
    """A deployment error (401 from the broker) is logged by the SDK; the client learns nothing."""
    user = fresh_user("helper-badsecret")
    with Sibling(idp, broker.url, "cbs_not_registered") as sibling:
        answer = result_of(await sibling.call(sibling.token(user), "demo_fingerprint"))

    assert answer["isError"] is True
    assert answer["content"] == [{"type": "text", "text": "Error executing tool demo_fingerprint"}]
    assert [a.get("type") for a in sibling.calls.answers] == [
        "urn:connect-broker:error:invalid_service_credentials"
    ]
    assert await count_rows(db, "flows", subject=user) == 0


@pytest.mark.parametrize(
    "overrides",
    [
        pytest.param({"audience": "http://127.0.0.1:9/mcp"}, id="another-audience"),
        pytest.param({"issuer": "http://127.0.0.1:9"}, id="another-issuer"),
        pytest.param({"lifetime": -120}, id="expired"),
        pytest.param({"header": {"typ": "JWT"}}, id="not-an-access-token"),
        pytest.param({"jwk": generate_rsa_jwk("foreign")}, id="foreign-key"),
    ],
)
async def test_the_siblings_verifier_refuses_tokens_not_issued_for_it(
    sibling: Sibling, idp: IdpProcess, overrides: dict[str, Any]
) -> None:
    """The sibling validates its own tokens (audience = its /mcp URL); a bad one is a 401."""
    options = {"issuer": idp.issuer, "audience": sibling.audience, "subject": "helper-x"}
    jwk = overrides.pop("jwk", idp.signing_jwk)
    token = mint_token(jwk, **(options | overrides))

    response = await sibling.call(token, "demo_fingerprint")

    assert response.status_code == 401
    assert response.headers["www-authenticate"].startswith('Bearer error="invalid_token"')
    assert sibling.calls.requests == []


async def test_a_client_before_2026_gets_an_error_result_and_no_flow(
    sibling: Sibling, db: AsyncEngine
) -> None:
    """Before 2026-07-28 there is no InputRequiredResult: a plain isError result, no dead link."""
    user = fresh_user("helper-legacy")
    body = {
        "jsonrpc": "2.0",
        "id": 1,
        "method": "tools/call",
        "params": {"name": "demo_fingerprint", "arguments": {}},
    }
    headers = {
        "Authorization": f"Bearer {sibling.token(user)}",
        "Accept": "application/json, text/event-stream",
        "MCP-Protocol-Version": "2025-11-25",
    }

    async with local_client(timeout=30) as http:
        response = await http.post(f"{sibling.url}/mcp", json=body, headers=headers)

    assert response.status_code == 200
    result = response.json()["result"]
    assert result["isError"] is True
    assert result["content"][0]["text"].endswith(
        "needs an MCP client that speaks protocol 2026-07-28."
    )
    assert [answer["status"] for answer in sibling.calls.answers] == ["missing_capability"]
    assert await count_rows(db, "flows", subject=user) == 0
