"""What wrk sends, and the database side of the scenarios: tokens, bodies, pool files, checks.

A pool file has one request per line, "<bearer token>\\t<JSON body>"; bench/mcp.lua rotates over
it. Tokens are signed with the IdP's own key, so the broker verifies them against its real JWKS.
A GET pool file (the integration API's credential fetch) has "<bearer secret>\\t<path and query>"
lines instead; bench/credential.lua rotates over it.
"""

from __future__ import annotations

import asyncio
import json
import secrets
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote, urlencode

import httpx2
from sqlalchemy import func, select, update
from sqlalchemy.ext.asyncio import AsyncSession

from app import credentials
from app.auth.principal import Principal
from app.connect import service as flows
from app.connect.notify import PostgresFlowNotifier
from app.crypto import Keyring
from app.db import create_engine, create_sessionmaker, is_sqlite
from app.models import OPEN_FLOW_STATUSES, Flow, FlowStatus
from tests.support.idp import mint_token

PROTOCOL_VERSION = "2026-07-28"
TOOL = "connect_account"
INPUT_KEY = "connect_demo"
TOKEN_LIFETIME = 3600
CLIENT_CONCURRENCY = 32
META = {
    "io.modelcontextprotocol/protocolVersion": PROTOCOL_VERSION,
    "io.modelcontextprotocol/clientCapabilities": {"elicitation": {"url": {}}},
}

Entry = tuple[str, dict[str, Any]]


class PoolError(RuntimeError):
    """The broker did not answer a preparation request as the scenario needs."""


class TokenMinter:
    """Access tokens signed with the IdP's own key (tests/support/idp.py `mint_token`)."""

    def __init__(self, jwk: dict[str, Any], *, issuer: str, audience: str) -> None:
        self.issuer = issuer
        self._jwk = jwk
        self._audience = audience

    def mint(self, subject: str) -> str:
        return mint_token(
            self._jwk,
            issuer=self.issuer,
            audience=self._audience,
            subject=subject,
            client_id="bench-client",
            lifetime=TOKEN_LIFETIME,
        )

    def mint_many(self, prefix: str, start: int, count: int) -> list[tuple[str, str]]:
        """(subject, token) for subjects `<prefix>-<start>` … `<prefix>-<start + count - 1>`."""
        return [(f"{prefix}-{i}", self.mint(f"{prefix}-{i}")) for i in range(start, start + count)]


LIST_BODY = {"jsonrpc": "2.0", "id": 1, "method": "tools/list", "params": {"_meta": META}}


CALL_NUMBER = "@N@"  # bench/mcp.lua puts the request's number here


def call_body(request_state: str | None = None, *, numbered: bool = False) -> dict[str, Any]:
    """The canonical connect_account request; with `request_state`, its accepted retry.
    `numbered`: each request wrk sends is a call of its own (a scope named after its number,
    which an API-key provider ignores), so none finds an open flow of the same call to reuse."""
    arguments: dict[str, Any] = {"provider": "demo"}
    if numbered:
        arguments["scopes"] = [f"call-{CALL_NUMBER}"]
    params: dict[str, Any] = {"name": TOOL, "arguments": arguments, "_meta": META}
    if request_state is not None:
        params["inputResponses"] = {INPUT_KEY: {"action": "accept"}}
        params["requestState"] = request_state
    return {"jsonrpc": "2.0", "id": 1, "method": "tools/call", "params": params}


def headers(token: str, method: str = "tools/call") -> dict[str, str]:
    """The same headers bench/mcp.lua sends."""
    values = {
        "Content-Type": "application/json",
        "MCP-Protocol-Version": PROTOCOL_VERSION,
        "Mcp-Method": method,
        "Authorization": f"Bearer {token}",
    }
    if method == "tools/call":
        values["Mcp-Name"] = TOOL
    return values


def write_pool(path: Path, entries: Iterable[Entry]) -> Path:
    lines = (f"{token}\t{json.dumps(body, separators=(',', ':'))}\n" for token, body in entries)
    path.write_text("".join(lines))
    return path


def write_get_pool(path: Path, entries: Iterable[tuple[str, str]]) -> Path:
    """A pool of GET requests for bench/credential.lua: (bearer secret, path and query) lines."""
    path.write_text("".join(f"{token}\t{target}\n" for token, target in entries))
    return path


async def prime(mcp_url: str, tokens: list[str]) -> None:
    """One `tools/list` per token, so the broker's verified-token cache holds them all."""
    limit = asyncio.Semaphore(CLIENT_CONCURRENCY)
    async with httpx2.AsyncClient(timeout=30, trust_env=False) as http:

        async def one(token: str) -> None:
            async with limit:
                response = await http.post(
                    mcp_url, json=LIST_BODY, headers=headers(token, "tools/list")
                )
            if response.status_code != 200:
                raise PoolError(f"tools/list answered {response.status_code}: {response.text}")

        # One request first: a broker that has no JWKS yet answers 503 to requests arriving
        # while its first JWKS fetch is in flight (app/auth/jwks.py keys_for skips the lock).
        await one(tokens[0])
        await asyncio.gather(*(one(token) for token in tokens[1:]))


async def post(http: httpx2.AsyncClient, mcp_url: str, entry: Entry) -> dict[str, Any]:
    token, body = entry
    response = await http.post(mcp_url, json=body, headers=headers(token))
    if response.status_code != 200:
        raise PoolError(f"tools/call answered {response.status_code}: {response.text}")
    result: dict[str, Any] = response.json()["result"]
    return result


@dataclass(frozen=True)
class RetryPreparation:
    """Where the retry scenario's flows are and how to complete them."""

    mcp_url: str
    database_url: str
    issuer: str
    sealing_keys: tuple[str, ...]


async def prepare_retries(prep: RetryPreparation, users: list[tuple[str, str]]) -> list[Entry]:
    """A round-1 answer per user, its flow completed with a stored credential: retry entries."""
    started = await start_rounds(prep.mcp_url, users)
    await complete_flows(prep, started)
    tokens = dict(users)
    entries = [(tokens[round_.subject], call_body(round_.request_state)) for round_ in started]
    async with httpx2.AsyncClient(timeout=30, trust_env=False) as http:
        sample = await post(http, prep.mcp_url, entries[0])
    if sample.get("resultType") != "complete" or sample.get("isError"):
        raise PoolError(f"a retry of a completed flow did not give the final result: {sample}")
    return entries


@dataclass(frozen=True)
class StartedRound:
    """A user's round-1 answer: the requestState to retry with, and the flow it opened."""

    subject: str
    request_state: str
    flow_id: str


async def start_rounds(mcp_url: str, users: list[tuple[str, str]]) -> list[StartedRound]:
    """Round 1 of connect_account for each (subject, token), CLIENT_CONCURRENCY at a time."""
    limit = asyncio.Semaphore(CLIENT_CONCURRENCY)
    async with httpx2.AsyncClient(timeout=30, trust_env=False) as http:

        async def one(subject: str, token: str) -> StartedRound:
            async with limit:
                result = await post(http, mcp_url, (token, call_body()))
            if result.get("resultType") != "input_required":
                raise PoolError(f"round 1 for {subject} did not ask for input: {result}")
            url = result["inputRequests"][INPUT_KEY]["params"]["url"]
            return StartedRound(subject, result["requestState"], url.rsplit("/", 1)[1])

        return list(await asyncio.gather(*(one(subject, token) for subject, token in users)))


async def complete_flows(prep: RetryPreparation, started: list[StartedRound]) -> None:
    """What the API-key page does: store the sealed credential, move the flow to completed."""
    keys = Keyring.parse(prep.sealing_keys)
    engine = create_engine(prep.database_url, pool_size=2)
    notifier = None if is_sqlite(prep.database_url) else PostgresFlowNotifier(prep.database_url)
    try:
        async with create_sessionmaker(engine).begin() as session:
            for round_ in started:
                principal = Principal(issuer=prep.issuer, subject=round_.subject)
                await _store_api_key(session, keys, principal, audience="mcp")
                moved = await flows.transition(
                    session,
                    flow_id=round_.flow_id,
                    principal=principal,
                    from_statuses=(FlowStatus.pending,),
                    to_status=FlowStatus.completed,
                )
                if not moved:
                    raise PoolError(f"flow of {round_.subject} could not be completed")
                if notifier is not None:  # wakes a retry waiting on PostgreSQL at once
                    await notifier.publish(session, round_.flow_id)
    finally:
        await engine.dispose()


async def _store_api_key(
    session: AsyncSession, keys: Keyring, principal: Principal, *, audience: str
) -> str:
    """Store (sealed) a fresh demo API key of `principal` owned by `audience`; return the key."""
    api_key = f"sk_bench_{secrets.token_hex(8)}"
    await credentials.store(
        session,
        keys=keys,
        principal=principal,
        provider="demo",
        audience=audience,
        secret={"api_key": api_key},
    )
    return api_key


@dataclass(frozen=True)
class CredentialPreparation:
    """The credential-fetch scenario: a service, and users with a key that service owns."""

    base_url: str  # the broker's public URL
    database_url: str
    issuer: str
    sealing_keys: tuple[str, ...]
    service: str
    service_secret: str


def credential_path(issuer: str, subject: str) -> str:
    """`GET /api/v1/credentials/demo?issuer=…&subject=…` (path and query)."""
    query = urlencode({"issuer": issuer, "subject": subject}, quote_via=quote)
    return f"/api/v1/credentials/demo?{query}"


async def prepare_credentials(prep: CredentialPreparation, subjects: list[str]) -> list[str]:
    """Store a key per user for the service; check one fetch; the paths for wrk, in order."""
    stored = await store_api_keys(
        prep.database_url, prep.sealing_keys, prep.issuer, prep.service, subjects
    )
    paths = [credential_path(prep.issuer, subject) for subject in subjects]
    await _check_credential(prep, paths[0], stored[subjects[0]])
    return paths


async def store_api_keys(
    database_url: str,
    sealing_keys: tuple[str, ...],
    issuer: str,
    service: str,
    subjects: list[str],
) -> dict[str, str]:
    """A fresh sealed demo API key per subject, owned by `service`: subject -> key."""
    keys = Keyring.parse(sealing_keys)
    stored: dict[str, str] = {}
    engine = create_engine(database_url, pool_size=2)
    try:
        async with create_sessionmaker(engine).begin() as session:
            for subject in subjects:
                principal = Principal(issuer=issuer, subject=subject)
                stored[subject] = await _store_api_key(session, keys, principal, audience=service)
    finally:
        await engine.dispose()
    return stored


async def _check_credential(prep: CredentialPreparation, path: str, api_key: str) -> None:
    """The broker answers the fetch with 200 and exactly the stored key."""
    auth = {"Authorization": f"Bearer {prep.service_secret}"}
    async with httpx2.AsyncClient(timeout=30, trust_env=False) as http:
        response = await http.get(prep.base_url + path, headers=auth)
    if response.status_code != 200:
        raise PoolError(f"GET {path} answered {response.status_code}: {response.text}")
    body = response.json()
    if body.get("secret") != api_key or body.get("kind") != "api_key":
        raise PoolError(f"GET {path} did not return the stored key: {body}")


async def flow_counts(database_url: str) -> tuple[int, int]:
    """(number of flows, most open flows any one user has)."""
    open_per_user = (
        select(func.count().label("n"))
        .where(Flow.status.in_(OPEN_FLOW_STATUSES))
        .group_by(Flow.subject)
        .subquery()
    )
    engine = create_engine(database_url, pool_size=1)
    try:
        async with engine.connect() as connection:
            total = await connection.scalar(select(func.count()).select_from(Flow))
            most = await connection.scalar(select(func.max(open_per_user.c.n)))
    finally:
        await engine.dispose()
    return int(total or 0), int(most or 0)


async def expire_open_flows(database_url: str, subject_prefix: str) -> None:
    """Expire the open flows of the users whose subject starts with `subject_prefix`, as the
    sweeper does once their links are old: each run then starts with its users far from the
    open-flow cap, however fast the previous run went."""
    engine = create_engine(database_url, pool_size=1)
    try:
        async with engine.begin() as connection:
            await connection.execute(
                update(Flow)
                .where(Flow.status.in_(OPEN_FLOW_STATUSES), Flow.subject.startswith(subject_prefix))
                .values(status=FlowStatus.expired)
            )
    finally:
        await engine.dispose()
