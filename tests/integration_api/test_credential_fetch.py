"""GET /api/v1/credentials/{provider} is served two ways (app/integration_api/credential_fetch.py):
a well-formed request skips FastAPI, anything else goes through the FastAPI route. Both must give
the same answer, so each case is sent both ways: plain, and with an extra query parameter that
FastAPI ignores but that sends the request down the FastAPI route."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import httpx2
import pytest
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession
from starlette.datastructures import QueryParams

from app import credentials
from app.auth.principal import Principal
from app.credentials import Credential
from app.crypto import Keyring
from app.integration_api.broker import UsableCredential
from app.integration_api.credential_fetch import user_query
from connect_broker_client.broker import _credential

from ..support.broker import BrokerProcess
from ..support.clients import Browser
from ..support.idp import IdpProcess
from .test_api import (
    API_KEY,
    Registered,
    ServiceApi,
    connect_demo,
    fresh_name,
    fresh_user,
    register,
)

pytestmark = pytest.mark.both_databases


@pytest.fixture(scope="module")
def service(broker: BrokerProcess) -> Registered:
    return register(broker, fresh_name("fast"))


@pytest.fixture
async def api(broker: BrokerProcess, service: Registered) -> Any:
    client = ServiceApi(broker.url, service)
    yield client
    await client.aclose()


def scope(path: str, query: bytes, method: str = "GET") -> dict[str, Any]:
    return {"type": "http", "method": method, "path": path, "query_string": query}


@pytest.mark.parametrize(
    ("path", "query", "method", "expected"),
    [
        ("/api/v1/credentials/demo", b"issuer=https%3A%2F%2Fidp&subject=al+ice", "GET", True),
        ("/api/v1/credentials/demo", b"subject=alice&issuer=i", "GET", True),
        ("/api/v1/credentials/demo", b"issuer=i&subject=alice", "POST", False),
        ("/api/v1/credentials/demo", b"issuer=i", "GET", False),
        ("/api/v1/credentials/demo", b"issuer=i&subject=alice&x=1", "GET", False),
        ("/api/v1/credentials/demo", b"issuer=i&issuer=j", "GET", False),
        ("/api/v1/credentials/demo", b"issuer=&subject=alice", "GET", False),
        ("/api/v1/credentials/demo", b"issuer=i&subject=" + b"a" * 256, "GET", False),
        ("/api/v1/credentials/demo", b"issuer=i&subject", "GET", False),
        ("/api/v1/credentials/", b"issuer=i&subject=alice", "GET", False),
        ("/api/v1/credentials/demo/x", b"issuer=i&subject=alice", "GET", False),
        ("/api/v1/credentials/demo", b"issuer=i&subject=al%00ice", "GET", False),
        ("/api/v1/credentials/demo", b"issuer=i%00&subject=alice", "GET", False),
    ],
)
def test_only_well_formed_fetches_take_the_fast_path(
    path: str, query: bytes, method: str, expected: bool
) -> None:
    assert (user_query(scope(path, query, method)) is not None) is expected


@pytest.mark.parametrize(
    "query",
    [
        b"issuer=https%3A%2F%2Fidp.example%2F&subject=al+ice",
        b"issuer=%E2%9C%93&subject=%zz%2",  # UTF-8, and percent signs that escape nothing
        b"issuer=i&subject=%ff%fe",  # not UTF-8: replacement characters, as Starlette decodes
        b"issuer=a%26b&subject=c%3Dd",  # an escaped & and = inside values
        b"subject=%20x%20&issuer=i",
    ],
)
def test_the_fast_path_reads_the_query_as_starlette_does(query: bytes) -> None:
    found = user_query(scope("/api/v1/credentials/demo", query))
    expected = QueryParams(query.decode("latin-1"))
    assert found == (expected["issuer"], expected["subject"])


@pytest.mark.parametrize(
    "credential",
    [
        Credential("demo", "sk_live_1", None, frozenset()),
        Credential("github", "gho_x", "octo", frozenset({"repo", "read:org"})),
        Credential(
            "github", "gho_x", "Zoë ✓", frozenset({"b", "a"}), datetime(2031, 1, 2, tzinfo=UTC)
        ),
        Credential(
            "github", 't"q\\', "", frozenset(), datetime(2031, 1, 2, 3, 4, 5, 60, tzinfo=UTC)
        ),
        Credential(
            "slack", "xoxb", None, frozenset(), datetime(2031, 1, 2, 3, 4, 5, 123456, tzinfo=UTC)
        ),
    ],
)
def test_the_fast_path_document_is_the_routes_json_byte_for_byte(credential: Credential) -> None:
    """The fast path encodes the credential itself (UsableCredential.document); FastAPI's route
    has pydantic serialize the same credential (`response_model_exclude_none`)."""
    for usable in (UsableCredential("api_key", credential), UsableCredential("oauth2", credential)):
        assert usable.document() == usable.view().model_dump_json(exclude_none=True).encode()


async def both_ways(
    http: httpx2.AsyncClient, provider: str, user: dict[str, str], secret: str | None
) -> tuple[httpx2.Response, httpx2.Response]:
    headers = {"Authorization": f"Bearer {secret}"} if secret is not None else {}
    fast = await http.get(f"/credentials/{provider}", params=user, headers=headers)
    routed = await http.get(
        f"/credentials/{provider}", params={**user, "via": "fastapi"}, headers=headers
    )
    return fast, routed


def same_answer(fast: httpx2.Response, routed: httpx2.Response, status: int) -> None:
    assert fast.status_code == routed.status_code == status, (fast.text, routed.text)
    for header in ("content-type", "www-authenticate", "retry-after"):
        assert fast.headers.get(header) == routed.headers.get(header), header
    fast_body, routed_body = fast.json(), routed.json()
    if "instance" in fast_body or "instance" in routed_body:  # a problem: each names its request
        assert fast_body.pop("instance") != routed_body.pop("instance")
    assert fast_body == routed_body


async def test_fast_path_and_fastapi_route_give_the_same_answers(
    broker: BrokerProcess, api: ServiceApi, browser: Browser, idp: IdpProcess
) -> None:
    user = {"issuer": idp.issuer, "subject": fresh_user("fast-path")}
    limited = register(broker, fresh_name("only-github"), "--providers", "github")
    async with httpx2.AsyncClient(
        base_url=f"{broker.url}/api/v1", trust_env=False, timeout=30
    ) as http:
        same_answer(*await both_ways(http, "demo", user, api.secret), 404)  # not connected
        await connect_demo(api, browser, user)
        fast, routed = await both_ways(http, "demo", user, api.secret)
        same_answer(fast, routed, 200)
        assert fast.json()["secret"] == API_KEY
        same_answer(*await both_ways(http, "nope", user, api.secret), 404)
        same_answer(*await both_ways(http, "demo", user, "cbs_not-a-secret"), 401)
        same_answer(*await both_ways(http, "demo", user, None), 401)
        same_answer(*await both_ways(http, "demo", user, limited.secret), 403)
        other = {"issuer": "https://evil.example", "subject": user["subject"]}
        same_answer(*await both_ways(http, "demo", other, api.secret), 400)


async def test_a_value_the_database_refuses_is_answered_before_any_statement(
    broker: BrokerProcess, api: ServiceApi, idp: IdpProcess
) -> None:
    """A NUL in the subject never reaches a statement: with a wrong secret it is an ordinary
    failed authentication (401), with the right one a 422 naming the parameter; never a
    database error (503) nor an ERROR in the log."""
    logged_before = len(broker.log())
    user = {"issuer": idp.issuer, "subject": "kim\x00"}
    async with httpx2.AsyncClient(
        base_url=f"{broker.url}/api/v1", trust_env=False, timeout=30
    ) as http:
        fast, routed = await both_ways(http, "demo", user, "cbs_not-a-secret")
        same_answer(fast, routed, 401)
        fast, routed = await both_ways(http, "demo", user, api.secret)
        same_answer(fast, routed, 422)
        assert [error["loc"] for error in fast.json()["errors"]] == [["query", "subject"]]
        assert "NUL" in fast.json()["errors"][0]["msg"]
        required = await http.post(
            "/connections/demo/require",
            json={"user": user, "client_name": "ok"},
            headers={"Authorization": f"Bearer {api.secret}"},
        )
        assert required.status_code == 422, required.text
    assert " ERROR " not in broker.log()[logged_before:]


async def test_an_oauth_credential_carries_its_expiry_both_ways(
    broker: BrokerProcess, api: ServiceApi, idp: IdpProcess, db: AsyncEngine
) -> None:
    """An OAuth access token's expiry reaches the sibling (`expires_at`), so it knows when to
    fetch again; an API key has none (see the test above: no `expires_at` key at all)."""
    user = {"issuer": idp.issuer, "subject": fresh_user("expiry")}
    expires = datetime.now(UTC).replace(microsecond=0) + timedelta(hours=2)
    async with AsyncSession(db) as session, session.begin():
        await credentials.store(
            session,
            keys=Keyring.parse(tuple(broker.config.encryption)),
            principal=Principal(idp.issuer, user["subject"]),
            provider="github",
            audience=api.name,
            secret={"access_token": "gho_expiring", "refresh_token": "ghr_expiring"},
            scopes=frozenset({"repo"}),
            account_label="octo",
            expires_at=expires,
        )
    async with httpx2.AsyncClient(
        base_url=f"{broker.url}/api/v1", trust_env=False, timeout=30
    ) as http:
        fast, routed = await both_ways(http, "github", user, api.secret)

    same_answer(fast, routed, 200)
    body = fast.json()
    assert (body["kind"], body["secret"], body["account"]) == ("oauth2", "gho_expiring", "octo")
    assert datetime.fromisoformat(body["expires_at"]) == expires
    assert _credential(body).expires_at == expires  # the sibling helper reads it too
