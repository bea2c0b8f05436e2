"""The integration API seen by a sibling MCP server (DESIGN.md §3.2, README "Deploy beside MCP
servers"): require, resume, credentials, connections, delete, and the OpenAPI document.

Every answer is asserted on the wire: JSON bodies for outcomes, `application/problem+json` with a
stable `type` for every error (400/403/404/422), the flow and connection rows behind them, and the
connect page the user sees. Flows are completed the way users complete them, in the browser.
The K4 cases (the relayed `requestState`) live here; test_isolation.py carries the K-series notes.
"""

from __future__ import annotations

import hashlib
import json
import re
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any
from urllib.parse import parse_qs, urlsplit

import httpx2
import pytest
import time_machine
from jsonschema import Draft202012Validator
from sqlalchemy import bindparam, text, update
from sqlalchemy.ext.asyncio import AsyncEngine

from app.auth.principal import McpCaller, Principal
from app.connect.request_state import RequestStateCodec
from app.crypto import Keyring, generate_key
from app.integration_api.broker import METHOD
from app.models import Flow

from ..conftest import count_rows, flow_row
from ..support.broker import BrokerProcess, LogWindow, create_service
from ..support.clients import URL_CAPS, Browser, provider_url
from ..support.fake_github import FakeGitHub
from ..support.http import local_client, local_get
from ..support.idp import IdpProcess
from ..support.schema import validate_response

pytestmark = pytest.mark.both_databases

API_KEY = "sk_CANARYKEY_integration_api_1"
RETRY_WAIT_SECONDS = 3  # BrokerConfig default of the session broker
FLOW_TTL_SECONDS = 600  # the broker default; requestState lives as long as its flow
PROBLEM_KEYS = {"type", "title", "status", "detail", "instance"}
MISSING_URL: dict[str, Any] = {"elicitation": {"url": {}}}
ACCEPT = {"action": "accept"}


# ------------------------------------------------------------------------------------------------
# Helpers (also used by test_services.py and test_isolation.py)
# ------------------------------------------------------------------------------------------------


def fresh_user(label: str) -> str:
    """A subject of its own, so row counts see only this test (the session DB is shared)."""
    return f"{label}-{secrets.token_hex(4)}"


def fresh_name(label: str) -> str:
    """A service name of its own (service names are unique per broker)."""
    return f"{label}-{secrets.token_hex(3)}"


@dataclass(frozen=True)
class Registered:
    name: str
    secret: str


def register(broker: BrokerProcess, name: str, providers: tuple[str, ...] = ()) -> Registered:
    """A service of this broker, registered as `connect-broker service create` registers one."""
    return Registered(name, create_service(broker, name, providers))


def require_body(user: dict[str, str], **overrides: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "user": user,
        "client_capabilities": URL_CAPS,
        "client_name": "Claude",
        "request_digest": "call-1",
    }
    body.update(overrides)
    return body


class ServiceApi:
    """One sibling server calling /api/v1 with its own secret."""

    def __init__(self, broker_url: str, service: Registered) -> None:
        self.name = service.name
        self.secret = service.secret
        self.http = local_client(
            base_url=f"{broker_url}/api/v1",
            timeout=30,
            headers={"Authorization": f"Bearer {service.secret}"},
        )

    async def require(
        self, provider: str, user: dict[str, str], **overrides: Any
    ) -> httpx2.Response:
        return await self.http.post(
            f"/connections/{provider}/require", json=require_body(user, **overrides)
        )

    async def resume(
        self,
        provider: str,
        user: dict[str, str],
        state: str,
        answer: dict[str, Any] | None = ACCEPT,
        **overrides: Any,
    ) -> httpx2.Response:
        """The retry; `answer` is the client's inputResponses entry (None: it sent none)."""
        body = require_body(user, request_state=state, input_response=answer, **overrides)
        return await self.http.post(f"/connections/{provider}/resume", json=body)

    async def credential(self, provider: str, user: dict[str, str]) -> httpx2.Response:
        return await self.http.get(f"/credentials/{provider}", params=user)

    async def connections(self, user: dict[str, str]) -> httpx2.Response:
        return await self.http.get("/connections", params=user)

    async def delete(self, provider: str, user: dict[str, str]) -> httpx2.Response:
        return await self.http.delete(f"/connections/{provider}", params=user)

    async def aclose(self) -> None:
        await self.http.aclose()


def ok(response: httpx2.Response) -> dict[str, Any]:
    assert response.status_code == 200, response.text
    assert response.headers["content-type"] == "application/json"
    body: dict[str, Any] = response.json()
    return body


def problem(response: httpx2.Response, status: int, code: str) -> dict[str, Any]:
    """The RFC 9457 body of an error, with its stable type; `instance` (this answer's request
    id) is checked and left out, so the stable part can be compared."""
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == "application/problem+json"
    body: dict[str, Any] = response.json()
    assert set(body) == PROBLEM_KEYS | ({"errors"} if status == 422 else set()), body
    assert body["type"] == f"urn:connect-broker:error:{code}"
    assert body["status"] == status
    instance = body.pop("instance")
    assert re.fullmatch(r"urn:connect-broker:request:[0-9a-f]{16}", instance), instance
    return body


def input_required(response: httpx2.Response) -> tuple[dict[str, Any], str]:
    """(body, flow id) of an input-required answer, checked as an MCP InputRequiredResult: the
    sibling returns `inputRequests` and `requestState` verbatim, so they must be valid MCP."""
    body = ok(response)
    assert body["status"] == "input_required", body
    assert set(body) == {"status", "inputRequests", "requestState"}
    result = {
        "resultType": "input_required",
        "inputRequests": body["inputRequests"],
        "requestState": body["requestState"],
    }
    validate_response({"jsonrpc": "2.0", "id": 1, "result": result}, "InputRequiredResult")
    ((_, request),) = body["inputRequests"].items()
    return body, request["params"]["url"].rsplit("/", 1)[1]


def connected(response: httpx2.Response) -> dict[str, Any]:
    body = ok(response)
    assert body["status"] == "connected", body
    assert set(body) == {"status", "credential"}
    credential: dict[str, Any] = body["credential"]
    return credential


async def submit_api_key(browser: Browser, user: str, flow_id: str, key: str = API_KEY) -> None:
    """The user logs in at the IdP and submits the API-key form of the flow."""
    await browser.login_as(user, next_path=f"/connect/{flow_id}")
    csrf = await browser.csrf_token(f"/connect/{flow_id}")
    submitted = await browser.post(
        f"/connect/{flow_id}/api-key", data={"csrf": csrf, "api_key": key}
    )
    assert submitted.status_code == 303, submitted.text


async def authorize_github(browser: Browser, user: str, flow_id: str) -> None:
    """The user logs in, presses Continue, approves at the fake GitHub; the callback completes."""
    await browser.login_as(user, next_path=f"/connect/{flow_id}")
    csrf = await browser.csrf_token(f"/connect/{flow_id}")
    started = await browser.post(f"/connect/{flow_id}/start", data={"csrf": csrf})
    approved = await browser.http.get(provider_url(started))
    location = urlsplit(approved.headers["location"])
    query = {key: values[0] for key, values in parse_qs(location.query).items()}
    callback = await browser.get(location.path, params=query)
    assert callback.headers.get("location") == f"/connect/{flow_id}", callback.text


async def connect_demo(
    api: ServiceApi, browser: Browser, user: dict[str, str], key: str = API_KEY
) -> str:
    """The whole round for the demo API-key provider; returns the flow id."""
    first, flow_id = input_required(await api.require("demo", user))
    await submit_api_key(browser, user["subject"], flow_id, key)
    assert connected(await api.resume("demo", user, first["requestState"]))["secret"] == key
    return flow_id


async def flows_of(db: AsyncEngine, subject: str) -> list[dict[str, Any]]:
    async with db.connect() as connection:
        rows = await connection.execute(
            text("SELECT * FROM flows WHERE subject = :s ORDER BY created_at"), {"s": subject}
        )
        return [dict(row) for row in rows.mappings()]


async def snapshot(db: AsyncEngine, *subjects: str) -> list[list[dict[str, Any]]]:
    """Every flow and connection row of `subjects`, for "nothing changed" assertions."""
    tables = []
    async with db.connect() as connection:
        for table in ("flows", "connections"):
            query = text(f"SELECT * FROM {table} WHERE subject IN :s ORDER BY id")
            rows = await connection.execute(
                query.bindparams(bindparam("s", expanding=True)), {"s": list(subjects)}
            )
            tables.append([dict(row) for row in rows.mappings()])
    return tables


# ------------------------------------------------------------------------------------------------
# Fixtures: two registered services on the session broker, one API client each
# ------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def alpha(broker: BrokerProcess) -> Registered:
    return register(broker, fresh_name("alpha"))


@pytest.fixture(scope="module")
def beta(broker: BrokerProcess) -> Registered:
    return register(broker, fresh_name("beta"))


@pytest.fixture
async def api(broker: BrokerProcess, alpha: Registered) -> Any:
    client = ServiceApi(broker.url, alpha)
    yield client
    await client.aclose()


@pytest.fixture
async def other_api(broker: BrokerProcess, beta: Registered) -> Any:
    client = ServiceApi(broker.url, beta)
    yield client
    await client.aclose()


@pytest.fixture
def user_of(idp: IdpProcess) -> Any:
    """`user_of("label")`: a fresh user of the broker's IdP as the API names users."""

    def make(label: str) -> dict[str, str]:
        return {"issuer": idp.issuer, "subject": fresh_user(label)}

    return make


# ------------------------------------------------------------------------------------------------
# Requests the API refuses: unknown provider, foreign issuer, malformed bodies
# ------------------------------------------------------------------------------------------------

ENDPOINTS = ["require", "resume", "credential", "delete"]


async def call(api: ServiceApi, endpoint: str, provider: str, user: dict[str, str]) -> Any:
    if endpoint == "require":
        return await api.require(provider, user)
    if endpoint == "resume":
        return await api.resume(provider, user, "not-a-state")
    if endpoint == "credential":
        return await api.credential(provider, user)
    if endpoint == "connections":
        return await api.connections(user)
    return await api.delete(provider, user)


async def test_a_path_or_method_the_api_does_not_have_is_a_problem(
    api: ServiceApi, user_of: Any
) -> None:
    """Routing misses under /api/ answer problem JSON like the rest of the API (not Starlette's
    `{"detail": …}`), before any service secret is looked at; a 405 names the allowed methods."""
    missing = await api.http.get("/no-such-endpoint")
    problem(missing, 404, "no_such_endpoint")

    wrong_method = await api.http.put("/credentials/demo", params=user_of("wrong-method"))
    problem(wrong_method, 405, "method_not_allowed")
    assert wrong_method.headers["allow"] == "GET"

    anonymous = await api.http.get("/no-such-endpoint", headers={"Authorization": ""})
    problem(anonymous, 404, "no_such_endpoint")


@pytest.mark.parametrize("endpoint", ENDPOINTS)
async def test_unknown_provider_is_a_404_problem(
    endpoint: str, api: ServiceApi, user_of: Any, db: AsyncEngine
) -> None:
    """A provider the broker does not configure is 404 `unknown_provider` on every endpoint that
    names one, before the user or the requestState is looked at."""
    user = user_of("unknown-provider")

    response = await call(api, endpoint, "nope", user)

    problem(response, 404, "unknown_provider")
    assert await count_rows(db, "flows", subject=user["subject"]) == 0


@pytest.mark.parametrize("endpoint", [*ENDPOINTS, "connections"])
async def test_k3_user_of_another_issuer_is_a_400_problem(
    endpoint: str, api: ServiceApi, idp: IdpProcess, db: AsyncEngine
) -> None:
    """K3. The broker believes the user a sibling names only for its own IdP: another issuer is
    400 `unknown_issuer` everywhere and starts nothing."""
    subject = fresh_user("k3-issuer")
    user = {"issuer": "https://evil.example", "subject": subject}

    response = await call(api, endpoint, "demo", user)

    problem(response, 400, "unknown_issuer")
    assert await count_rows(db, "flows", subject=subject) == 0


@pytest.mark.parametrize(
    "issuer_of",
    [
        pytest.param(lambda issuer: issuer + "/", id="trailing-slash"),
        pytest.param(lambda issuer: issuer.upper(), id="upper-case"),
        pytest.param(lambda issuer: issuer.replace("http://", "https://"), id="https"),
    ],
)
async def test_k3_issuer_is_compared_exactly(
    issuer_of: Any, api: ServiceApi, idp: IdpProcess, db: AsyncEngine
) -> None:
    """K3. Identity is (iss, sub) compared exactly (SECURITY.md §0.2): look-alike issuers of the
    broker's own IdP are refused too."""
    subject = fresh_user("k3-near")

    response = await api.require("demo", {"issuer": issuer_of(idp.issuer), "subject": subject})

    problem(response, 400, "unknown_issuer")
    assert await count_rows(db, "flows", subject=subject) == 0


INVALID_REQUESTS: dict[str, tuple[str, Callable[[Any], Any], list[str]]] = {
    "extra-field": (
        "require",
        lambda user: require_body(user, surprise="sk_CANARYKEY_echoed_back"),
        ["body", "surprise"],
    ),
    "extra-user-field": (
        "require",
        lambda user: require_body({**user, "email": "sk_CANARYKEY_echoed_back"}),
        ["body", "user", "email"],
    ),
    "scopes-not-a-list": (
        "require",
        lambda user: require_body(user, scopes="sk_CANARYKEY_echoed_back"),
        ["body", "scopes"],
    ),
    "capabilities-not-an-object": (
        "require",
        lambda user: require_body(user, client_capabilities=["sk_CANARYKEY_echoed_back"]),
        ["body", "client_capabilities"],
    ),
    "user-missing": ("require", lambda user: {"client_capabilities": URL_CAPS}, ["body", "user"]),
    "empty-subject": (
        "require",
        lambda user: require_body({**user, "subject": ""}),
        ["body", "user", "subject"],
    ),
    "digest-too-long": (
        "require",
        lambda user: require_body(user, request_digest="x" * 129),
        ["body", "request_digest"],
    ),
    "body-an-array": ("require", lambda user: [require_body(user)], ["body"]),
    "state-missing": ("resume", lambda user: require_body(user), ["body", "request_state"]),
    "state-not-a-string": (
        "resume",
        lambda user: require_body(user, request_state=42),
        ["body", "request_state"],
    ),
    "state-too-long": (
        "resume",
        lambda user: require_body(user, request_state="s" * 8193),
        ["body", "request_state"],
    ),
    "input-response-not-an-object": (
        "resume",
        lambda user: require_body(user, request_state="x", input_response="accept"),
        ["body", "input_response"],
    ),
}


@pytest.mark.parametrize("case", INVALID_REQUESTS)
async def test_request_not_matching_the_schema_is_a_422_problem_without_echo(
    case: str, api: ServiceApi, user_of: Any, db: AsyncEngine
) -> None:
    """Extra fields and wrong types are 422 `invalid_request` as problem JSON (not FastAPI's plain
    JSON), saying where (`loc`) but never echoing the offending value back."""
    endpoint, make_body, location = INVALID_REQUESTS[case]
    user = user_of("invalid")

    response = await api.http.post(f"/connections/demo/{endpoint}", json=make_body(user))

    body = problem(response, 422, "invalid_request")
    assert location in [error["loc"] for error in body["errors"]], body
    assert all(set(error) == {"loc", "msg", "type"} for error in body["errors"])
    assert "CANARYKEY" not in response.text
    assert "s" * 100 not in response.text
    assert await count_rows(db, "flows", subject=user["subject"]) == 0


@pytest.mark.parametrize(
    ("method", "path", "params"),
    [
        ("POST", "/connections/demo/require", None),
        ("GET", "/credentials/demo", {"issuer": "x"}),
        ("GET", "/connections", {"subject": "x"}),
        ("DELETE", "/connections/demo", {"issuer": "x", "subject": ""}),
    ],
    ids=["malformed-json", "subject-missing", "issuer-missing", "subject-empty"],
)
async def test_malformed_json_and_bad_query_are_422_problems(
    method: str, path: str, params: dict[str, str] | None, api: ServiceApi
) -> None:
    """The same problem shape for a body that is not JSON and for missing or empty query values."""
    response = await api.http.request(
        method,
        path,
        params=params,
        content=b'{"user": ' if params is None else None,
        headers={"Content-Type": "application/json"},
    )

    body = problem(response, 422, "invalid_request")
    assert body["errors"], body


def raw_body(user: dict[str, str], capability: str, encoding: str = "utf-8") -> bytes:
    """A require body whose `client_capabilities` string is `capability`, in `encoding` with
    surrogates written as they are (bytes that are no UTF-8, or UTF-16 code units)."""
    text = json.dumps(require_body(user, client_capabilities={"x": "CAPABILITY"}))
    return text.replace("CAPABILITY", capability).encode(encoding, "surrogatepass")


RAW_BODIES: dict[str, Callable[[dict[str, str]], bytes]] = {
    # ED A0 80: stdlib json.loads(bytes) decodes it (surrogatepass) into a lone \ud800
    "raw-lone-surrogate": lambda user: raw_body(user, "a\ud800b"),
    "raw-surrogate-pair": lambda user: raw_body(user, "a\ud83d\ude00b"),
    "not-utf-8": lambda user: raw_body(user, "a").replace(b'"a"', b'"a\xff"'),
    # valid UTF-8 bytes (ASCII, NULs and U+0600), which json.loads reads as UTF-16: a lone \ud800
    "utf-16-lone-surrogate": lambda user: raw_body(user, "a\ud800\u0080", "utf-16-le"),
    "utf-16": lambda user: raw_body(user, "a", "utf-16-le"),
}


@pytest.mark.parametrize("case", RAW_BODIES)
async def test_a_body_that_is_not_utf_8_json_is_a_422_problem(
    case: str, api: ServiceApi, user_of: Any, db: AsyncEngine
) -> None:
    """Only UTF-8 is read (RFC 8259): surrogates as raw bytes, other bytes that are no UTF-8, and
    JSON in another encoding are refused like a body that is not JSON, before any flow starts."""
    user = user_of("raw-body")

    response = await api.http.post(
        "/connections/demo/require",
        content=RAW_BODIES[case](user),
        headers={"Content-Type": "application/json"},
    )

    body = problem(response, 422, "invalid_request")
    assert [error["type"] for error in body["errors"]] == ["json_invalid"], body
    assert await count_rows(db, "flows", subject=user["subject"]) == 0


# ------------------------------------------------------------------------------------------------
# require
# ------------------------------------------------------------------------------------------------


async def test_require_starts_a_flow_owned_by_the_service_and_the_page_names_it(
    api: ServiceApi, browser: Browser, broker: BrokerProcess, user_of: Any, db: AsyncEngine
) -> None:
    """Not connected, URL mode declared: a URL-mode elicitation for a new flow whose audience is
    the service; the connect page names "<service> (via <client>)"."""
    user = user_of("require")

    body, flow_id = input_required(await api.require("demo", user))
    await browser.login_as(user["subject"], next_path=f"/connect/{flow_id}")
    page = await browser.get(f"/connect/{flow_id}")

    assert body["inputRequests"] == {
        "connect_demo": {
            "method": "elicitation/create",
            "params": {
                "mode": "url",
                "message": "Connect your Demo account to continue.",
                "url": f"{broker.url}/connect/{flow_id}",
            },
        }
    }
    row = await flow_row(db, flow_id) or {}
    assert row["audience"] == api.name
    assert row["client_id"] == f"service:{api.name}"
    assert row["client_name"] == f"{api.name} (via Claude)"
    assert row["status"] == "pending"
    assert (row["issuer"], row["subject"], row["provider"]) == (
        user["issuer"],
        user["subject"],
        "demo",
    )
    assert page.status_code == 200
    assert (
        f"<strong>{api.name}</strong> (via a client that calls itself “Claude”) asks to use your "
        "Demo API key" in page.text
    )


async def test_k3_client_name_is_shown_escaped_after_the_service_name(
    api: ServiceApi, browser: Browser, user_of: Any
) -> None:
    """K3. `client_name` is the MCP client's self-description, relayed by the sibling: the page
    always leads with the registered service name and shows the relayed text as text."""
    user = user_of("k3-client-name")

    _, flow_id = input_required(
        await api.require("demo", user, client_name='<img src=x onerror="alert(1)">Other')
    )
    await browser.login_as(user["subject"], next_path=f"/connect/{flow_id}")
    page = await browser.get(f"/connect/{flow_id}")

    assert (
        f"<strong>{api.name}</strong> (via a client that calls itself “&lt;img src=x onerror="
        in (page.text)
    )
    assert "<img src=x" not in page.text


async def test_require_without_client_name_names_only_the_service(
    api: ServiceApi, user_of: Any, db: AsyncEngine
) -> None:
    user = user_of("no-client-name")

    _, flow_id = input_required(await api.require("demo", user, client_name=None))

    assert (await flow_row(db, flow_id) or {})["client_name"] == api.name


@pytest.mark.parametrize(
    "capabilities",
    [{}, {"elicitation": {}}, {"elicitation": {"form": {}}}, {"elicitation": {"url": True}}],
    ids=["none", "elicitation-empty", "form-only", "url-not-an-object"],
)
async def test_require_without_url_elicitation_is_missing_capability_and_starts_no_flow(
    capabilities: dict[str, Any], api: ServiceApi, user_of: Any, db: AsyncEngine
) -> None:
    """SECURITY.md T22 through a sibling: without `elicitation.url` the answer is the data of a
    -32021 for the sibling to return, and no flow exists."""
    user = user_of("no-url")

    response = await api.require("demo", user, client_capabilities=capabilities)

    assert ok(response) == {"status": "missing_capability", "requiredCapabilities": MISSING_URL}
    assert await count_rows(db, "flows", subject=user["subject"]) == 0


async def test_require_when_connected_returns_the_credential_without_elicitation(
    api: ServiceApi, browser: Browser, user_of: Any, db: AsyncEngine
) -> None:
    """Once connected, require is the credential itself, even for a client without URL mode."""
    user = user_of("require-connected")
    await connect_demo(api, browser, user)

    response = await api.require("demo", user, client_capabilities={}, request_digest="call-2")

    assert connected(response) == {
        "provider": "demo",
        "kind": "api_key",
        "secret": API_KEY,
        "scopes": [],
    }
    assert await count_rows(db, "flows", subject=user["subject"]) == 1


# ------------------------------------------------------------------------------------------------
# resume
# ------------------------------------------------------------------------------------------------


async def test_resume_after_completion_returns_the_credential_and_consumes_the_flow(
    api: ServiceApi, browser: Browser, user_of: Any, db: AsyncEngine
) -> None:
    """The client's retry after the browser finished: the credential; the flow is consumed and
    an identical second retry gets the same answer (MRTR retries may repeat)."""
    user = user_of("resume")
    first, flow_id = input_required(await api.require("demo", user))
    await submit_api_key(browser, user["subject"], flow_id)

    once = connected(await api.resume("demo", user, first["requestState"]))
    twice = connected(await api.resume("demo", user, first["requestState"]))

    assert once == twice
    assert once["secret"] == API_KEY
    assert (await flow_row(db, flow_id) or {})["status"] == "consumed"
    assert await count_rows(db, "connections", subject=user["subject"], audience=api.name) == 1


async def test_resume_accept_before_completion_repeats_the_url_with_a_fresh_state(
    api: ServiceApi, browser: Browser, user_of: Any, db: AsyncEngine
) -> None:
    """DESIGN §3.1 step 5 via a sibling: `accept` on a pending flow waits the bounded
    retry_wait_seconds, then answers the same URL with a fresh requestState, which works."""
    user = user_of("resume-pending")
    first, flow_id = input_required(await api.require("demo", user))
    started = time.monotonic()

    again, again_flow = input_required(await api.resume("demo", user, first["requestState"]))
    waited = time.monotonic() - started
    await submit_api_key(browser, user["subject"], flow_id)
    final = connected(await api.resume("demo", user, again["requestState"]))

    assert RETRY_WAIT_SECONDS - 0.5 <= waited < RETRY_WAIT_SECONDS + 5
    assert again_flow == flow_id
    assert again["inputRequests"] == first["inputRequests"]
    assert again["requestState"] != first["requestState"]
    assert final["secret"] == API_KEY
    assert await count_rows(db, "flows", subject=user["subject"]) == 1


async def test_resume_without_an_answer_repeats_the_url_at_once(
    api: ServiceApi, user_of: Any
) -> None:
    """No inputResponses entry (the client has not answered): no waiting, the same URL again."""
    user = user_of("resume-unanswered")
    first, flow_id = input_required(await api.require("demo", user))
    started = time.monotonic()

    response = await api.resume("demo", user, first["requestState"], None)

    again, again_flow = input_required(response)
    assert time.monotonic() - started < RETRY_WAIT_SECONDS - 1
    assert again_flow == flow_id
    assert again["inputRequests"] == first["inputRequests"]


@pytest.mark.parametrize(("action", "status"), [("decline", "declined"), ("cancel", "cancelled")])
async def test_resume_decline_or_cancel_ends_the_flow(
    action: str,
    status: str,
    api: ServiceApi,
    browser: Browser,
    user_of: Any,
    db: AsyncEngine,
) -> None:
    """The client's decline/cancel ends the flow: the outcome is the status, the page no longer
    takes a key, and a later accept gets the same ended outcome at once."""
    user = user_of(action)
    first, flow_id = input_required(await api.require("demo", user))

    ended = ok(await api.resume("demo", user, first["requestState"], {"action": action}))
    started = time.monotonic()
    later = ok(await api.resume("demo", user, first["requestState"]))
    waited = time.monotonic() - started
    await browser.login_as(user["subject"], next_path=f"/connect/{flow_id}")
    page = await browser.get(f"/connect/{flow_id}")

    assert ended == {"status": status}
    assert later == {"status": status}
    assert waited < RETRY_WAIT_SECONDS - 1
    assert (await flow_row(db, flow_id) or {})["status"] == status
    assert 'name="api_key"' not in page.text
    assert await count_rows(db, "connections", subject=user["subject"]) == 0


@pytest.mark.parametrize("action", ["decline", "cancel"])
async def test_resume_decline_after_the_user_connected_returns_the_credential(
    action: str, api: ServiceApi, browser: Browser, user_of: Any, db: AsyncEngine
) -> None:
    """The user finished in the browser before the client's decline or cancel arrived: the
    connection exists, so the outcome is `connected`, as `/mcp` answers the same race
    (tests/mcp/test_retry.py); the flow is consumed, not declined."""
    user = user_of(f"late-{action}")
    first, flow_id = input_required(await api.require("demo", user))
    await submit_api_key(browser, user["subject"], flow_id)

    late = connected(await api.resume("demo", user, first["requestState"], {"action": action}))

    assert late["secret"] == API_KEY
    assert (await flow_row(db, flow_id) or {})["status"] == "consumed"


async def test_resume_of_an_expired_flow_is_expired(
    api: ServiceApi, user_of: Any, db: AsyncEngine
) -> None:
    """A flow past its expiry (the sweeper has not run yet) answers `expired`, without waiting."""
    user = user_of("expired")
    first, flow_id = input_required(await api.require("demo", user))
    async with db.begin() as connection:
        await connection.execute(
            update(Flow)
            .where(Flow.id == flow_id)
            .values(expires_at=datetime.now(UTC) - timedelta(seconds=1))
        )
    started = time.monotonic()

    response = await api.resume("demo", user, first["requestState"])

    assert ok(response) == {"status": "expired"}
    assert time.monotonic() - started < RETRY_WAIT_SECONDS - 1


@pytest.mark.parametrize("action", ["maybe", 5, "ACCEPT"], ids=["maybe", "number", "upper-case"])
async def test_resume_with_an_unknown_action_is_a_400_problem(
    action: Any, api: ServiceApi, user_of: Any, db: AsyncEngine
) -> None:
    """An action other than accept/decline/cancel is 400 `invalid_input_response`; the flow is
    left as it was (pending), so a correct retry still works."""
    user = user_of("maybe")
    first, flow_id = input_required(await api.require("demo", user))
    before = await flows_of(db, user["subject"])

    response = await api.resume("demo", user, first["requestState"], {"action": action})

    problem(response, 400, "invalid_input_response")
    assert await flows_of(db, user["subject"]) == before
    assert (await flow_row(db, flow_id) or {})["status"] == "pending"


# ------------------------------------------------------------------------------------------------
# K4: the relayed requestState is bound to service, user, provider and request
# ------------------------------------------------------------------------------------------------


def binding(provider: str, request_digest: str) -> str:
    """The broker's request binding of a sibling's state (app/integration_api/broker.py)."""
    return hashlib.sha256(f"{provider}|{request_digest}".encode()).hexdigest()


def forge_state(
    signing: list[str], service: str, user: dict[str, str], flow_id: str, provider: str = "demo"
) -> str:
    """A state with the exact structure the broker issues, under the given signing keys."""
    codec = RequestStateCodec(Keyring.parse(tuple(signing)), max_age=FLOW_TTL_SECONDS)
    caller = McpCaller(
        Principal(user["issuer"], user["subject"]),
        client_id=f"service:{service}",
        scopes=frozenset(),
    )
    return codec.issue(
        caller,
        method=METHOD,
        name=provider,
        arguments_digest=binding(provider, "call-1"),
        flow_id=flow_id,
        input_key=f"connect_{provider}",
    )


def flip_signature_byte(state: str) -> str:
    head, signature = state.rsplit(".", 1)
    return f"{head}.{'B' if signature[0] != 'B' else 'C'}{signature[1:]}"


STATE_ATTACKS = {
    "appended": "invalid",
    "signature-flipped": "invalid",
    "other-signing-key": "invalid",
    "older-than-ttl": "expired",
    "other-user": "principal_mismatch",
    "other-service": "request_mismatch",
    "other-request-digest": "request_mismatch",
    "other-provider": "request_mismatch",
}


@pytest.mark.parametrize("attack", STATE_ATTACKS)
async def test_k4_tampered_or_rebound_request_state_is_a_400_problem_and_changes_nothing(
    attack: str,
    api: ServiceApi,
    other_api: ServiceApi,
    browser: Browser,
    broker: BrokerProcess,
    user_of: Any,
    db: AsyncEngine,
) -> None:
    """K4. The sibling relays the client's requestState. On a flow that is already completed (so
    any slip would hand out the key), a state that was edited, forged, aged past the TTL, or is
    presented for another user, service, request or provider is 400 `invalid_request_state`:
    no credential, the flow not consumed, no row changed, `request_state.invalid` logged."""
    user, other_user = user_of("k4"), user_of("k4-other")
    first, flow_id = input_required(await api.require("demo", user))
    await submit_api_key(browser, user["subject"], flow_id)
    state, caller, provider, who = first["requestState"], api, "demo", user
    overrides: dict[str, Any] = {}
    if attack == "appended":
        state += "-TAMPERED"
    elif attack == "signature-flipped":
        state = flip_signature_byte(state)
    elif attack == "other-signing-key":
        key_id = broker.config.signing[0].split(":", 1)[0]
        state = forge_state([generate_key(key_id)], api.name, user, flow_id)
    elif attack == "older-than-ttl":
        with time_machine.travel(time.time() - FLOW_TTL_SECONDS - 1, tick=False):
            state = forge_state(broker.config.signing, api.name, user, flow_id)
    elif attack == "other-user":
        who = other_user
    elif attack == "other-service":
        caller = other_api
    elif attack == "other-request-digest":
        overrides = {"request_digest": "call-2"}
    else:
        provider = "github"
    before = await snapshot(db, user["subject"], other_user["subject"])
    log = LogWindow(broker)

    response = await caller.resume(provider, who, state, **overrides)

    problem(response, 400, "invalid_request_state")
    assert API_KEY not in response.text
    assert await snapshot(db, user["subject"], other_user["subject"]) == before
    assert (await flow_row(db, flow_id) or {})["status"] == "completed"
    logged = await log.wait_for(f"request_state.invalid reason={STATE_ATTACKS[attack]}")
    assert f"request_state.invalid reason={STATE_ATTACKS[attack]}" in logged
    assert state not in logged


async def test_k4_state_forged_with_the_brokers_key_inside_its_ttl_is_accepted(
    api: ServiceApi, browser: Browser, broker: BrokerProcess, user_of: Any
) -> None:
    """K4 control: the forging above reproduces the broker's own states (30 s before the TTL
    ends it verifies), so each refusal there is for the one thing each case changed."""
    user = user_of("k4-control")
    _, flow_id = input_required(await api.require("demo", user))
    await submit_api_key(browser, user["subject"], flow_id)
    with time_machine.travel(time.time() - FLOW_TTL_SECONDS + 30, tick=False):
        aged = forge_state(broker.config.signing, api.name, user, flow_id)

    response = await api.resume("demo", user, aged)

    assert connected(response)["secret"] == API_KEY


# ------------------------------------------------------------------------------------------------
# credentials, connections, delete
# ------------------------------------------------------------------------------------------------


async def test_credentials_is_404_not_connected_until_the_user_connects(
    api: ServiceApi, browser: Browser, user_of: Any
) -> None:
    user = user_of("credentials")

    before = await api.credential("demo", user)
    await connect_demo(api, browser, user)
    after = await api.credential("demo", user)

    problem(before, 404, "not_connected")
    assert ok(after) == {"provider": "demo", "kind": "api_key", "secret": API_KEY, "scopes": []}


async def test_connections_lists_the_services_own_connections_with_their_owner(
    api: ServiceApi, browser: Browser, user_of: Any
) -> None:
    """{connections: [{provider, account, status, owner, connected_at}]}; nothing secret."""
    user = user_of("list")

    empty = ok(await api.connections(user))
    await connect_demo(api, browser, user)
    response = await api.connections(user)

    assert empty == {"connections": []}
    ((item,),) = [ok(response)["connections"]]
    assert item["provider"] == "demo"
    assert item["owner"] == api.name
    assert item["status"] == "active"
    assert datetime.fromisoformat(item["connected_at"]).tzinfo is not None
    assert API_KEY not in response.text


async def test_delete_revokes_github_upstream_and_removes_the_services_connection(
    api: ServiceApi, browser: Browser, fake_github: FakeGitHub, user_of: Any, db: AsyncEngine
) -> None:
    """DELETE revokes at the provider where it can (GitHub: DELETE /applications/…/grant),
    deletes the sealed credential, and a second DELETE is 404 `not_connected` with no second
    revocation."""
    user = user_of("delete-github")
    first, flow_id = input_required(await api.require("github", user))
    await authorize_github(browser, user["subject"], flow_id)
    token = connected(await api.resume("github", user, first["requestState"]))["secret"]
    revocations = fake_github.revocations

    deleted = await api.delete("github", user)
    afterwards = await api.credential("github", user)
    again = await api.delete("github", user)

    assert token.startswith("gho_")
    assert ok(deleted) == {
        "provider": "github",
        "status": "disconnected",
        "revoked_upstream": True,
        "upstream_failed": False,
    }
    problem(afterwards, 404, "not_connected")
    problem(again, 404, "not_connected")
    assert fake_github.revocations == revocations + 1
    assert await count_rows(db, "connections", subject=user["subject"]) == 0
    assert token not in deleted.text


async def test_delete_of_an_api_key_connection_removes_it_without_upstream_call(
    api: ServiceApi, browser: Browser, fake_github: FakeGitHub, user_of: Any, db: AsyncEngine
) -> None:
    user = user_of("delete-demo")
    await connect_demo(api, browser, user)
    revocations = fake_github.revocations

    deleted = ok(await api.delete("demo", user))

    assert deleted == {
        "provider": "demo",
        "status": "disconnected",
        "revoked_upstream": False,
        "upstream_failed": False,
    }
    assert fake_github.revocations == revocations
    assert await count_rows(db, "connections", subject=user["subject"]) == 0


# ------------------------------------------------------------------------------------------------
# OpenAPI
# ------------------------------------------------------------------------------------------------

API_OPERATIONS = {
    ("/api/v1/connections/{provider}/require", "post"),
    ("/api/v1/connections/{provider}/resume", "post"),
    ("/api/v1/credentials/{provider}", "get"),
    ("/api/v1/connections", "get"),
    ("/api/v1/connections/{provider}", "delete"),
}
TOKEN_OPERATION = ("/api/v1/token", "post")  # RFC 8693: OAuth errors, not problem JSON
QUERY_USER_OPERATIONS = {
    ("/api/v1/connections", "get"),
    ("/api/v1/connections/{provider}", "delete"),
}


@pytest.fixture(scope="module")
def openapi(broker: BrokerProcess) -> dict[str, Any]:
    response = local_get(f"{broker.url}/api/v1/openapi.json", timeout=10)
    assert response.status_code == 200, response.text
    document: dict[str, Any] = response.json()
    return document


def conforms(document: dict[str, Any], path: str, method: str, response: httpx2.Response) -> None:
    """Validate a live response against the schema the document gives for its status."""
    media = response.headers["content-type"]
    documented = document["paths"][path][method]["responses"][str(response.status_code)]
    schema = documented["content"][media]["schema"]
    root = {**schema, "components": document["components"]}
    Draft202012Validator(root).validate(response.json())


def request_schema(document: dict[str, Any], path: str) -> dict[str, Any]:
    ref = document["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
    schema: dict[str, Any] = document["components"]["schemas"][ref["$ref"].rsplit("/", 1)[1]]
    return schema


async def test_openapi_documents_the_six_integration_operations(openapi: dict[str, Any]) -> None:
    """GET /api/v1/openapi.json: exactly the six /api/v1 operations (nothing of the pages or
    /mcp), each behind the bearer service secret, with typed bodies and problem responses (the
    token exchange: RFC 6749 errors)."""
    operations = {
        (path, method) for path, methods in openapi["paths"].items() for method in methods
    }
    require = request_schema(openapi, "/api/v1/connections/{provider}/require")
    resume = request_schema(openapi, "/api/v1/connections/{provider}/resume")
    schemes = openapi["components"]["securitySchemes"]

    assert operations == API_OPERATIONS | {TOKEN_OPERATION}
    assert require["additionalProperties"] is False
    assert set(require["properties"]) == {
        "user",
        "subject_token",
        "scopes",
        "client_capabilities",
        "client_name",
        "request_digest",
        "account",  # "new": another account
    }
    assert "required" not in require  # `user`, or `subject_token` for a user_proof service
    assert set(resume["properties"]) == set(require["properties"]) | {
        "request_state",
        "input_response",
    }
    assert "request_state" in resume["required"]
    assert schemes == {
        "ServiceSecret": {
            "type": "http",
            "scheme": "bearer",
            "description": schemes["ServiceSecret"]["description"],
        }
    }
    for path, method in API_OPERATIONS:
        operation = openapi["paths"][path][method]
        assert operation["security"] == [{"ServiceSecret": []}], path
        assert "application/json" in operation["responses"]["200"]["content"], path
        for status in ("401", "422"):
            assert set(operation["responses"][status]["content"]) == {"application/problem+json"}, (
                path,
                status,
            )
    exchange = openapi["paths"][TOKEN_OPERATION[0]][TOKEN_OPERATION[1]]
    assert exchange["security"] == [{"ServiceSecret": []}]
    assert set(exchange["requestBody"]["content"]) == {"application/x-www-form-urlencoded"}
    assert exchange["responses"]["200"]["content"]["application/json"]["schema"] == {
        "$ref": "#/components/schemas/IssuedCredential"
    }
    for status in ("400", "401", "429"):
        assert exchange["responses"][status]["content"]["application/json"]["schema"] == {
            "$ref": "#/components/schemas/TokenError"
        }
    for path, method in QUERY_USER_OPERATIONS:
        parameters = {
            (parameter["in"], parameter["name"]): parameter
            for parameter in openapi["paths"][path][method]["parameters"]
        }
        # the user named in the query, or (user_proof = "token") their token in a header; a
        # deletion may name one of several accounts
        account = {("query", "account")} if method == "delete" else set()
        assert {key for key in parameters if key[0] != "path"} == {
            ("query", "issuer"),
            ("query", "subject"),
            ("header", "Subject-Token"),
            *account,
        }, path
        for key in (("query", "issuer"), ("query", "subject"), ("header", "Subject-Token")):
            assert parameters[key]["required"] is False, (path, key)
        assert "Subject-Token" in parameters["query", "issuer"]["description"], path
    credential_query = {
        parameter["name"]
        for parameter in openapi["paths"]["/api/v1/credentials/{provider}"]["get"]["parameters"]
        if parameter["in"] != "path"
    }
    # a user_proof service uses /token; `account` names one of several accounts
    assert credential_query == {"issuer", "subject", "account"}
    outcome = openapi["components"]["schemas"]["ConnectOutcome"]
    assert set(outcome["properties"]["status"]["enum"]) == {
        "connected",
        "input_required",
        "missing_capability",
        "declined",
        "cancelled",
        "expired",
        "failed",
    }


async def test_live_responses_match_the_openapi_schemas(
    openapi: dict[str, Any], api: ServiceApi, browser: Browser, user_of: Any
) -> None:
    """Each operation's real answers, success and problem, validate against the document."""
    user = user_of("openapi")
    require = "/api/v1/connections/{provider}/require"
    resume = "/api/v1/connections/{provider}/resume"
    credentials = "/api/v1/credentials/{provider}"
    connections = "/api/v1/connections"
    delete = "/api/v1/connections/{provider}"

    missing = await api.require("demo", user, client_capabilities={})
    first = await api.require("demo", user)
    pending = await api.resume("demo", user, first.json()["requestState"], None)
    not_connected = await api.credential("demo", user)
    _, flow_id = input_required(first)
    await submit_api_key(browser, user["subject"], flow_id)
    done = await api.resume("demo", user, first.json()["requestState"])
    bad_state = await api.resume("demo", user, "tampered")
    listed = await api.connections(user)
    fetched = await api.credential("demo", user)
    deleted = await api.delete("demo", user)
    invalid = await api.http.post("/connections/demo/require", json={"user": 1})
    unauthenticated = await api.http.get(
        "/connections", params=user, headers={"Authorization": "Bearer cbs_unknown"}
    )
    forbidden_issuer = await api.connections({**user, "issuer": "https://evil.example"})

    checks = [
        (require, "post", missing),
        (require, "post", first),
        (resume, "post", pending),
        (resume, "post", done),
        (resume, "post", bad_state),
        (credentials, "get", not_connected),
        (credentials, "get", fetched),
        (connections, "get", listed),
        (connections, "get", unauthenticated),
        (connections, "get", forbidden_issuer),
        (delete, "delete", deleted),
        (require, "post", invalid),
    ]
    assert [response.status_code for *_, response in checks] == [
        200, 200, 200, 200, 400, 404, 200, 200, 401, 400, 200, 422,
    ]  # fmt: skip
    for path, method, response in checks:
        conforms(openapi, path, method, response)
