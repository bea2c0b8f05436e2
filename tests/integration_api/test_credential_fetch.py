"""GET /api/v1/credentials/{provider} (app/integration_api/credential_route.py): a plain
Starlette route that reads its query and serialises its answer itself, so each of those is
checked here against what FastAPI would have done, and every answer is checked whole."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import httpx2
import pytest
from fastapi.exceptions import RequestValidationError
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession
from starlette.datastructures import QueryParams

from app import credentials
from app.auth.principal import Principal
from app.credentials import Credential
from app.crypto import Keyring
from app.integration_api.broker import UsableCredential
from app.integration_api.credential_route import read_user
from connect_broker_client.broker import _credential

from ..support.broker import BrokerProcess
from ..support.clients import Browser
from ..support.http import local_client
from ..support.idp import IdpProcess
from .test_api import (
    API_KEY,
    Registered,
    ServiceApi,
    connect_demo,
    fresh_name,
    fresh_user,
    problem,
    register,
)

pytestmark = pytest.mark.both_databases


@pytest.fixture(scope="module")
def service(broker: BrokerProcess) -> Registered:
    return register(broker, fresh_name("fetch"))


@pytest.fixture
async def api(broker: BrokerProcess, service: Registered) -> Any:
    client = ServiceApi(broker.url, service)
    yield client
    await client.aclose()


@pytest.mark.parametrize(
    "query",
    [
        b"issuer=https%3A%2F%2Fidp.example%2F&subject=al+ice",
        b"subject=alice&issuer=i",
        b"issuer=%E2%9C%93&subject=%zz%2",  # UTF-8, and percent signs that escape nothing
        b"issuer=i&subject=%ff%fe",  # not UTF-8: replacement characters, as Starlette decodes
        b"issuer=a%26b&subject=c%3Dd",  # an escaped & and = inside values
        b"subject=%20x%20&issuer=i",
        b"issuer=i&subject=" + b"a" * 255,
        b"&issuer=i&&subject=s&",  # empty fields are skipped
        b"issuer=" + b"%41" * 255 + b"&subject=s",  # longer escaped than any value decoded
    ],
)
def test_the_query_is_read_as_starlette_reads_it(query: bytes) -> None:
    expected = QueryParams(query.decode("latin-1"))
    assert read_user(query) == (expected["issuer"], expected["subject"])


@pytest.mark.parametrize(
    ("query", "faults"),
    [
        (b"issuer=i", [("subject", "missing")]),
        (b"", [("issuer", "missing"), ("subject", "missing")]),
        (b"issuer=i&subject=alice&x=1", [("x", "extra_forbidden")]),
        (b"=x&issuer=i&subject=alice", [("", "extra_forbidden")]),
        (b"issuer=i&subj%65ct+=alice", [("subject ", "extra_forbidden"), ("subject", "missing")]),
        (b"issuer=i&issuer=j&subject=alice", [("issuer", "duplicate")]),
        (b"issuer=&subject=alice", [("issuer", "string_too_short")]),
        (b"issuer=i&subject", [("subject", "string_too_short")]),
        (b"issuer=i&subject=" + b"a" * 256, [("subject", "string_too_long")]),
        (b"issuer=i&subject=al%00ice", [("subject", "value_error")]),
        (b"issuer=i%00&subject=", [("issuer", "value_error"), ("subject", "string_too_short")]),
    ],
)
def test_a_query_other_than_issuer_and_subject_is_refused_naming_each_fault(
    query: bytes, faults: list[tuple[str, str]]
) -> None:
    with pytest.raises(RequestValidationError) as refused:
        read_user(query)
    errors = refused.value.errors()
    assert [(error["loc"], error["type"]) for error in errors] == [
        (("query", name), kind) for name, kind in faults
    ]
    assert all(error["msg"] for error in errors)


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
def test_the_answer_is_the_documented_models_json_byte_for_byte(credential: Credential) -> None:
    """The route encodes the credential itself (UsableCredential.document): the bytes pydantic
    would make of the model the OpenAPI document gives (`CredentialView`, without nulls)."""
    for usable in (UsableCredential("api_key", credential), UsableCredential("oauth2", credential)):
        assert usable.document() == usable.view().model_dump_json(exclude_none=True).encode()


async def fetch(
    http: httpx2.AsyncClient, provider: str, user: dict[str, str], secret: str | None
) -> httpx2.Response:
    headers = {"Authorization": f"Bearer {secret}"} if secret is not None else {}
    return await http.get(f"/credentials/{provider}", params=user, headers=headers)


def refused(response: httpx2.Response, status: int, code: str) -> None:
    """A problem answer, with no `Cache-Control` (it carries no credential), naming the scheme
    only on a 401."""
    problem(response, status, code)
    assert "cache-control" not in response.headers
    expected = 'Bearer realm="connect-broker"' if status == 401 else None
    assert response.headers.get("www-authenticate") == expected
    assert "retry-after" not in response.headers


async def test_each_answer_of_the_credential_route(
    broker: BrokerProcess, api: ServiceApi, browser: Browser, idp: IdpProcess
) -> None:
    user = {"issuer": idp.issuer, "subject": fresh_user("fetch")}
    limited = register(broker, fresh_name("only-github"), ("github",))
    async with local_client(base_url=f"{broker.url}/api/v1", timeout=30) as http:
        refused(await fetch(http, "demo", user, api.secret), 404, "not_connected")
        await connect_demo(api, browser, user)
        fetched = await fetch(http, "demo", user, api.secret)
        assert fetched.status_code == 200, fetched.text
        assert fetched.headers["content-type"] == "application/json"
        assert fetched.headers["cache-control"] == "no-store"
        assert "www-authenticate" not in fetched.headers
        assert fetched.json() == {
            "provider": "demo",
            "kind": "api_key",
            "secret": API_KEY,
            "scopes": [],
        }
        refused(await fetch(http, "nope", user, api.secret), 404, "unknown_provider")
        refused(
            await fetch(http, "demo", user, "cbs_not-a-secret"), 401, "invalid_service_credentials"
        )
        refused(await fetch(http, "demo", user, None), 401, "invalid_service_credentials")
        refused(await fetch(http, "demo", user, limited.secret), 403, "provider_not_allowed")
        other = {"issuer": "https://evil.example", "subject": user["subject"]}
        refused(await fetch(http, "demo", other, api.secret), 400, "unknown_issuer")
        extra = {**user, "via": "elsewhere"}
        refused(await fetch(http, "demo", extra, api.secret), 422, "invalid_request")
        posted = await http.post(
            "/credentials/demo", params=user, headers={"Authorization": f"Bearer {api.secret}"}
        )
        refused(posted, 405, "method_not_allowed")
        assert posted.headers["allow"] == "GET"
        head = await http.head(
            "/credentials/demo", params=user, headers={"Authorization": f"Bearer {api.secret}"}
        )
        assert (head.status_code, head.headers["allow"]) == (405, "GET")


async def test_a_value_the_database_refuses_is_answered_before_any_statement(
    broker: BrokerProcess, api: ServiceApi, idp: IdpProcess
) -> None:
    """A NUL in the subject never reaches a statement: with a wrong secret it is an ordinary
    failed authentication (401), with the right one a 422 naming the parameter; never a
    database error (503) nor an ERROR in the log."""
    logged_before = len(broker.log())
    user = {"issuer": idp.issuer, "subject": "kim\x00"}
    async with local_client(base_url=f"{broker.url}/api/v1", timeout=30) as http:
        refused(
            await fetch(http, "demo", user, "cbs_not-a-secret"), 401, "invalid_service_credentials"
        )
        invalid = await fetch(http, "demo", user, api.secret)
        refused(invalid, 422, "invalid_request")
        assert [error["loc"] for error in invalid.json()["errors"]] == [["query", "subject"]]
        assert "NUL" in invalid.json()["errors"][0]["msg"]
        required = await http.post(
            "/connections/demo/require",
            json={"user": user, "client_name": "ok"},
            headers={"Authorization": f"Bearer {api.secret}"},
        )
        assert required.status_code == 422, required.text
    assert " ERROR " not in broker.log()[logged_before:]


async def test_an_oauth_credential_carries_its_expiry(
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
    async with local_client(base_url=f"{broker.url}/api/v1", timeout=30) as http:
        fetched = await fetch(http, "github", user, api.secret)

    assert fetched.status_code == 200, fetched.text
    assert fetched.headers["cache-control"] == "no-store"
    body = fetched.json()
    assert (body["kind"], body["secret"], body["account"]) == ("oauth2", "gho_expiring", "octo")
    assert datetime.fromisoformat(body["expires_at"]) == expires
    assert _credential(body).expires_at == expires  # the sibling helper reads it too
