"""GET /api/v1/credentials/{provider} with a provider the broker does not configure
(app/integration_api/credential_route.py).

The path's provider is request input: one not in the configuration never reaches the statement
that reads the service with its connection (SECURITY.md L6). The service is then authenticated
by its secret's digest alone, so a wrong secret is still 401 (and counted against the address,
up to 429) ahead of the 404 `unknown_provider` its holder gets. On PostgreSQL a NUL in the path
(`%00`) used to fail that statement: a 500 with a traceback, and a failed authentication not
counted.
"""

from __future__ import annotations

import secrets
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx2
import pytest

from app.integration_api.services import SECRET_PREFIX

from ..conftest import DEMO_PROVIDER
from ..support.broker import BrokerConfig, BrokerProcess, LogWindow, running_broker
from ..support.http import local_client
from ..support.idp import IdpProcess
from .test_api import Registered, fresh_name, fresh_user, problem, register

pytestmark = pytest.mark.both_databases

UNKNOWN = ["%00", "nope", "de%00mo", "%ED%A0%80", "x" * 300]  # path segments, as sent
UNKNOWN_IDS = ["nul", "unconfigured", "nul-inside-a-known-name", "surrogate-bytes", "long"]


def wrong_secret() -> str:
    """Well-formed (so its digest is looked up), registered nowhere."""
    return SECRET_PREFIX + secrets.token_urlsafe(32)


def client(broker: BrokerProcess, secret: str) -> httpx2.AsyncClient:
    return local_client(
        base_url=f"{broker.url}/api/v1", timeout=30, headers={"Authorization": f"Bearer {secret}"}
    )


def user_query(idp: IdpProcess) -> dict[str, str]:
    return {"issuer": idp.issuer, "subject": fresh_user("fetch")}


def assert_no_error_logged(window: LogWindow) -> None:
    log = window.text()
    assert " ERROR " not in log and "Traceback" not in log, log


@pytest.fixture(scope="module")
def fetcher(broker: BrokerProcess) -> Registered:
    return register(broker, fresh_name("unknown-fetch"))


@pytest.mark.parametrize("provider", UNKNOWN, ids=UNKNOWN_IDS)
async def test_a_wrong_secret_is_401_whatever_provider_the_path_names(
    provider: str, broker: BrokerProcess, idp: IdpProcess
) -> None:
    window = LogWindow(broker)
    async with client(broker, wrong_secret()) as http:
        answer = await http.get(f"/credentials/{provider}", params=user_query(idp))

    problem(answer, 401, "invalid_service_credentials")
    assert_no_error_logged(window)


@pytest.mark.parametrize("provider", UNKNOWN, ids=UNKNOWN_IDS)
async def test_the_secrets_holder_gets_404_unknown_provider(
    provider: str, broker: BrokerProcess, idp: IdpProcess, fetcher: Registered
) -> None:
    window = LogWindow(broker)
    async with client(broker, fetcher.secret) as http:
        answer = await http.get(f"/credentials/{provider}", params=user_query(idp))
        known = await http.get("/credentials/demo", params=user_query(idp))

    problem(answer, 404, "unknown_provider")
    problem(known, 404, "not_connected")  # a configured provider is read as before
    assert_no_error_logged(window)


async def test_a_bad_query_is_still_422_before_the_provider_is_looked_at(
    broker: BrokerProcess, fetcher: Registered
) -> None:
    async with client(broker, fetcher.secret) as http:
        answer = await http.get("/credentials/%00", params={"issuer": "i"})

    problem(answer, 422, "invalid_request")


# ------------------------------------------------------------------------------------------------
# Counted: an address that keeps trying wrong secrets on unknown providers is refused
# ------------------------------------------------------------------------------------------------

BURST = 3


@pytest.fixture(scope="module")
def strict_broker(idp: IdpProcess, workdir: Path) -> Iterator[BrokerProcess]:
    """Lets an address fail BURST times, then refuses it for a minute."""
    config = BrokerConfig(
        issuer=idp.issuer,
        providers={"demo": DEMO_PROVIDER},
        extra={"limits": {"failed_auths_per_minute": 1, "failed_auth_burst": BURST}},
    )
    with running_broker(config, workdir, name="unknown-provider-strict") as process:
        yield process


@pytest.fixture
async def strict_http(strict_broker: BrokerProcess) -> AsyncIterator[httpx2.AsyncClient]:
    async with client(strict_broker, wrong_secret()) as http:
        yield http


async def test_wrong_secrets_on_unknown_providers_spend_the_address_budget(
    strict_broker: BrokerProcess, strict_http: httpx2.AsyncClient, idp: IdpProcess
) -> None:
    registered = register(strict_broker, fresh_name("strict"))
    window = LogWindow(strict_broker)

    answers = [
        await strict_http.get(f"/credentials/{provider}", params=user_query(idp))
        for provider in ["%00", "nope", "%00"]
    ]
    spent = await strict_http.get("/credentials/%00", params=user_query(idp))
    async with client(strict_broker, registered.secret) as http:
        # a secret this process never verified: refused too, not looked up
        unverified = await http.get("/credentials/demo", params=user_query(idp))

    for answer in answers:
        problem(answer, 401, "invalid_service_credentials")
    problem(spent, 429, "too_many_failed_authentications")
    problem(unverified, 429, "too_many_failed_authentications")
    assert await window.shows("auth.failed_auth_limit_reached")
    assert_no_error_logged(window)
