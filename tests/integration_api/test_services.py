"""Registering sibling MCP servers (`connect-broker service create|list|revoke`) and K1, how the
integration API authenticates them: a secret shown once, only its keyed digest stored, and every
unknown, malformed, missing or revoked secret refused with the same 401 problem.
"""

from __future__ import annotations

import base64
import hashlib
import re
import secrets
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

import httpx2
import pytest
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from ..conftest import count_rows
from ..support.broker import BrokerProcess, LogWindow, cli
from ..support.http import local_client
from ..support.idp import IdpProcess
from .test_api import (
    Registered,
    ServiceApi,
    fresh_name,
    fresh_user,
    input_required,
    ok,
    problem,
    register,
    require_body,
)

pytestmark = pytest.mark.both_databases

INVALID_CREDENTIALS = "invalid_service_credentials"


async def service_row(db: AsyncEngine, name: str) -> dict[str, Any]:
    async with db.connect() as connection:
        row = (
            (
                await connection.execute(
                    text("SELECT * FROM service_clients WHERE name = :n"), {"n": name}
                )
            )
            .mappings()
            .one()
        )
    return dict(row)


def listing(broker: BrokerProcess) -> dict[str, list[str]]:
    """`service list` as {name: [providers, state]}."""
    result = cli("service", "list", config_path=broker.config_path)
    assert result.returncode == 0, result.stderr
    rows = [line.split("\t") for line in result.stdout.splitlines()]
    assert all(len(row) == 3 for row in rows), result.stdout
    return {name: rest for name, *rest in rows}


@pytest.fixture
async def http(broker: BrokerProcess) -> Any:
    client = local_client(base_url=f"{broker.url}/api/v1", timeout=30)
    yield client
    await client.aclose()


@pytest.fixture(scope="module")
def gamma(broker: BrokerProcess) -> Registered:
    return register(broker, fresh_name("gamma"))


# ------------------------------------------------------------------------------------------------
# service create / list / revoke
# ------------------------------------------------------------------------------------------------


async def test_k1_service_create_prints_the_secret_once_and_stores_only_its_digest(
    broker: BrokerProcess, idp: IdpProcess, db: AsyncEngine, http: httpx2.AsyncClient
) -> None:
    """K1. stdout is exactly one line, the secret (`cbs_…`, 256 bits); stderr says it is shown
    once and does not repeat it; the table holds a keyed 64-hex digest (not even a plain SHA-256
    of the secret); `service list` and the broker log never show it; and it authenticates."""
    name = fresh_name("k1-create")
    log = LogWindow(broker)

    result = cli("service", "create", name, config_path=broker.config_path)
    secret = result.stdout.strip()
    row = await service_row(db, name)
    used = await http.get(
        "/connections",
        params={"issuer": idp.issuer, "subject": fresh_user("k1")},
        headers={"Authorization": f"Bearer {secret}"},
    )
    listed = cli("service", "list", config_path=broker.config_path)

    assert result.returncode == 0, result.stderr
    assert result.stdout.count("\n") == 1
    assert re.fullmatch(r"cbs_[A-Za-z0-9_-]{43}", secret)
    assert "shown only once" in result.stderr
    assert secret not in result.stderr
    assert re.fullmatch(r"[0-9a-f]{64}", row["secret_digest"])
    assert row["secret_digest"] != hashlib.sha256(secret.encode()).hexdigest()
    assert not any(secret[4:] in str(value) for value in row.values())
    assert ok(used) == {"connections": []}
    assert secret not in listed.stdout + listed.stderr
    assert row["secret_digest"] not in listed.stdout
    assert secret not in log.text()


async def test_two_services_get_different_secrets(broker: BrokerProcess, db: AsyncEngine) -> None:
    first, second = register(broker, fresh_name("twin")), register(broker, fresh_name("twin"))

    digests = {(await service_row(db, s.name))["secret_digest"] for s in (first, second)}

    assert first.secret != second.secret
    assert len(digests) == 2


async def test_service_list_shows_name_providers_and_state(broker: BrokerProcess) -> None:
    """One line per service: name, its providers ("*" for all), and active or revoked <date>."""
    restricted, everything = fresh_name("list-some"), fresh_name("list-all")
    register(broker, restricted, ("demo", "github"))
    register(broker, everything)
    revoked = cli("service", "revoke", everything, config_path=broker.config_path)
    today = datetime.now(UTC).strftime("%Y-%m-%d")

    services = listing(broker)

    assert revoked.returncode == 0, revoked.stderr
    assert services[restricted] == ["demo github", "active"]
    assert services[everything] == ["*", f"revoked {today}"]


async def test_k1_revoked_service_secret_gets_the_same_401_as_an_unknown_one(
    broker: BrokerProcess, idp: IdpProcess, http: httpx2.AsyncClient
) -> None:
    """K1. After `service revoke` the secret is refused exactly like a secret never issued (no
    oracle telling the two apart); revoking again or an unknown name exits 1."""
    service = register(broker, fresh_name("k1-revoke"))
    params = {"issuer": idp.issuer, "subject": fresh_user("k1-revoke")}

    def fetch(secret: str) -> Any:
        return http.get(
            "/connections", params=params, headers={"Authorization": f"Bearer {secret}"}
        )

    before = await fetch(service.secret)
    revoked = cli("service", "revoke", service.name, config_path=broker.config_path)
    after = await fetch(service.secret)
    unknown = await fetch("cbs_" + secrets.token_urlsafe(32))
    again = cli("service", "revoke", service.name, config_path=broker.config_path)
    nobody = cli("service", "revoke", fresh_name("nobody"), config_path=broker.config_path)

    assert ok(before) == {"connections": []}
    assert revoked.returncode == 0
    assert revoked.stdout.strip() == f"service {service.name!r} revoked"
    assert problem(after, 401, INVALID_CREDENTIALS) == problem(unknown, 401, INVALID_CREDENTIALS)
    assert (again.returncode, nobody.returncode) == (1, 1)
    assert "not found or already revoked" in again.stdout


async def test_duplicate_service_name_exits_1_and_keeps_the_first_secret(
    broker: BrokerProcess, idp: IdpProcess, http: httpx2.AsyncClient, db: AsyncEngine
) -> None:
    """A second `service create` of a taken name prints no secret, says why, exits 1; the
    first registration is untouched and its secret still works."""
    service = register(broker, fresh_name("dup"))
    digest = (await service_row(db, service.name))["secret_digest"]

    duplicate = cli("service", "create", service.name, config_path=broker.config_path)
    still = await http.get(
        "/connections",
        params={"issuer": idp.issuer, "subject": fresh_user("dup")},
        headers={"Authorization": f"Bearer {service.secret}"},
    )

    assert duplicate.returncode == 1
    assert duplicate.stdout == ""
    assert duplicate.stderr.strip() == f"a service named {service.name!r} already exists"
    assert (await service_row(db, service.name))["secret_digest"] == digest
    assert await count_rows(db, "service_clients", name=service.name) == 1
    assert ok(still) == {"connections": []}


@pytest.mark.parametrize(
    "name",
    ["Upper", "has space", "-dash-first", "9digit-first", "x" * 65, "ünïcode", "mcp", ""],
    ids=["upper", "space", "dash-first", "digit-first", "too-long", "unicode", "mcp", "empty"],
)
async def test_bad_service_name_exits_2_naming_the_argument(
    name: str, broker: BrokerProcess, db: AsyncEngine
) -> None:
    """A name that cannot be a service (or the broker's own audience "mcp") is a usage error:
    exit 2, stderr names the argument and the rule, nothing printed or stored."""
    before = await count_rows(db, "service_clients")

    result = cli("service", "create", "--", name, config_path=broker.config_path)

    assert result.returncode == 2
    assert result.stdout == ""
    assert "argument name:" in result.stderr
    assert "lowercase letters, digits, - and _" in result.stderr
    assert "configuration error" not in result.stderr
    assert await count_rows(db, "service_clients") == before


async def test_unknown_provider_in_the_providers_option_exits_2_naming_it(
    broker: BrokerProcess, db: AsyncEngine
) -> None:
    name = fresh_name("bad-providers")

    result = cli(
        "service", "create", name, "--providers", "demo,nope", config_path=broker.config_path
    )

    assert result.returncode == 2
    assert result.stdout == ""
    assert "argument --providers: unknown provider 'nope'" in result.stderr
    assert "configured: acme, demo, github" in result.stderr
    assert await count_rows(db, "service_clients", name=name) == 0


# ------------------------------------------------------------------------------------------------
# K1: every request authenticates the service
# ------------------------------------------------------------------------------------------------

PRESENTED: dict[str, Callable[[str], str | None]] = {
    "missing": lambda secret: None,
    "unknown": lambda secret: "Bearer cbs_" + secrets.token_urlsafe(32),
    "no-prefix": lambda secret: "Bearer " + secret.removeprefix("cbs_"),
    "one-char-more": lambda secret: f"Bearer {secret}x",
    "one-char-less": lambda secret: f"Bearer {secret[:-1]}",
    "oversized": lambda secret: "Bearer cbs_" + "A" * 4000,
    "scheme-only": lambda secret: "Bearer",
    "basic-scheme": lambda secret: "Basic " + base64.b64encode(f"{secret}:".encode()).decode(),
    "raw-secret": lambda secret: secret,
}


@pytest.mark.parametrize("presented", PRESENTED)
async def test_k1_bad_service_secret_gets_one_stable_401_problem(
    presented: str,
    gamma: Registered,
    broker: BrokerProcess,
    idp: IdpProcess,
    http: httpx2.AsyncClient,
    db: AsyncEngine,
) -> None:
    """K1. Missing, unknown, malformed, near-miss or wrongly presented secrets all get the same
    401 `invalid_service_credentials` problem with `WWW-Authenticate: Bearer`, whose body says
    nothing about what was sent; nothing is started and the value is not logged."""
    authorization = PRESENTED[presented](gamma.secret)
    subject = fresh_user("k1-bad")
    headers = {"Authorization": authorization} if authorization else {}
    log = LogWindow(broker)

    response = await http.post(
        "/connections/demo/require",
        json=require_body({"issuer": idp.issuer, "subject": subject}),
        headers=headers,
    )

    assert problem(response, 401, INVALID_CREDENTIALS) == {
        "type": f"urn:connect-broker:error:{INVALID_CREDENTIALS}",
        "title": "Unknown or revoked service secret",
        "status": 401,
        "detail": "Send Authorization: Bearer <service secret> of a registered, unrevoked service.",
    }
    assert response.headers["www-authenticate"].startswith("Bearer")
    assert await count_rows(db, "flows", subject=subject) == 0
    value = (authorization or "").split(" ")[-1]
    if len(value) > 16:
        assert value not in log.text() + response.text


ENDPOINTS = [
    ("POST", "/connections/demo/require"),
    ("POST", "/connections/demo/resume"),
    ("GET", "/credentials/demo"),
    ("GET", "/connections"),
    ("DELETE", "/connections/demo"),
]


@pytest.mark.parametrize(("method", "path"), ENDPOINTS, ids=[p for _, p in ENDPOINTS])
async def test_k1_every_endpoint_authenticates_before_validating_the_request(
    method: str, path: str, http: httpx2.AsyncClient
) -> None:
    """K1. All five operations refuse an anonymous caller with 401, even when the request is
    itself wrong (foreign issuer, missing fields): no validation detail reaches the anonymous."""
    response = await http.request(
        method,
        path,
        params={"issuer": "https://evil.example"} if method != "POST" else None,
        json={"user": {"issuer": "https://evil.example"}} if method == "POST" else None,
    )

    problem(response, 401, INVALID_CREDENTIALS)


async def test_k1_service_registered_for_some_providers_is_refused_the_others(
    broker: BrokerProcess, idp: IdpProcess, db: AsyncEngine
) -> None:
    """K1. `--providers demo` confines the secret: every operation on another configured provider
    is 403 `provider_not_allowed` and starts nothing; demo works."""
    api = ServiceApi(broker.url, register(broker, fresh_name("k1-only-demo"), ("demo",)))
    user = {"issuer": idp.issuer, "subject": fresh_user("k1-restricted")}
    try:
        refused = [
            await api.require("github", user),
            await api.resume("github", user, "some-state"),
            await api.credential("github", user),
            await api.delete("github", user),
        ]
        allowed = await api.require("demo", user)
    finally:
        await api.aclose()

    for response in refused:
        problem(response, 403, "provider_not_allowed")
    _, flow_id = input_required(allowed)
    assert await count_rows(db, "flows", subject=user["subject"]) == 1
    assert await count_rows(db, "flows", id=flow_id, provider="demo") == 1
