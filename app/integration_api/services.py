"""Registered sibling MCP servers ("services") and their bearer secrets.

A secret is shown once at creation; the table keeps only its keyed digest (HMAC-SHA256 under a
subkey of the signing keys), which makes the per-request lookup one indexed equality query. The
statements on `service_clients` are app/tables/services.py's. After
a signing-key rotation, digests under every configured key are tried, so secrets keep working.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass

from sqlalchemy.ext.asyncio import AsyncSession

from app import audit
from app.audit import Actor
from app.auth.principal import Principal
from app.clock import utcnow
from app.crypto import Keyring, hmac_digest
from app.direct import ConnectionRecord, DirectStore, ServiceRecord
from app.models import ServiceClient
from app.tables import services as services_table

SECRET_PREFIX = "cbs_"  # noqa: S105 (a marker that makes leaked secrets greppable)


@dataclass(frozen=True)
class Service:
    name: str
    providers: frozenset[str]  # empty: every configured provider

    def may_use(self, provider: str) -> bool:
        return not self.providers or provider in self.providers


def digests(keys: Keyring, secret: str) -> list[str]:
    """The keyed digests of a presented bearer secret under each signing key, the current key's
    first; none for a value that cannot be a secret of ours. They find the service's row, and
    the first is what this process remembers of a secret it verified (app/limits.py), so memory
    holds nothing the table does not."""
    if not _well_formed(secret):
        return []
    return [hmac_digest(key, secret) for key in keys.derive("digest:service-secret")]


async def create(
    session: AsyncSession,
    *,
    keys: Keyring,
    name: str,
    providers: tuple[str, ...],
    actor: Actor = audit.CLI,
) -> str:
    """Register a service and return its secret (shown once, never stored)."""
    secret = SECRET_PREFIX + secrets.token_urlsafe(32)
    digest = digests(keys, secret)[0]
    await session.execute(services_table.add(name, digest, " ".join(providers), utcnow()))
    await audit.record(
        session, "service.created", actor=actor, audience=name, detail=_providers(providers)
    )
    return secret


def _providers(providers: tuple[str, ...]) -> str:
    return "providers=" + (",".join(providers) or "*")


def _well_formed(secret: str) -> bool:
    return secret.startswith(SECRET_PREFIX) and len(secret) <= 128


def _service(row: ServiceRecord) -> Service:
    return Service(name=row.name, providers=frozenset(row.providers.split()))


async def authenticate(store: DirectStore, digests: list[str]) -> Service | None:
    """The live service whose secret has these `digests`, or None."""
    if not digests:
        return None
    row = await store.find_service(digests)
    return _service(row) if row is not None else None


async def authenticate_with_own_connection(
    store: DirectStore, digests: list[str], *, principal: Principal, provider: str
) -> tuple[Service, ConnectionRecord | None] | None:
    """`authenticate`, and the connection the service made for the user and provider, if any,
    read in the same statement (the credential fetch's one round trip). Only read: whether the
    service may use the provider, and for which user, is still the caller's to check."""
    if not digests:
        return None
    found = await store.find_service_and_own_connection(
        digests, principal.issuer, principal.subject, provider
    )
    if found is None:
        return None
    row, connection = found
    return _service(row), connection


async def list_all(session: AsyncSession) -> list[ServiceClient]:
    return list((await session.execute(services_table.by_name())).scalars())


async def revoke(session: AsyncSession, *, name: str, actor: Actor = audit.CLI) -> bool:
    result = await session.execute(services_table.revoke(name, utcnow()))
    revoked = bool(getattr(result, "rowcount", 0))
    if revoked:
        await audit.record(session, "service.revoked", actor=actor, audience=name)
    return revoked
