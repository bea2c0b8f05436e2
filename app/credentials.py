"""The credential store: the only module that unseals stored credentials.

A credential is sealed (AES-GCM, app/crypto.py) with the purpose
"cred:v1|<issuer>|<subject>|<provider>|<audience>" as associated data, so a ciphertext copied into
another user's or provider's row does not open (SECURITY.md I4): such a row is treated as absent,
logged as `credential.decrypt_failed`, and the next tool call elicits a new connection. The
statements on `connections` are app/tables/connections.py's.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from datetime import datetime
from typing import Protocol

from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession

from app import audit, jsonbytes
from app.auth.principal import Principal
from app.clock import utcnow
from app.crypto import InvalidSeal, Keyring, seal, sealed_key_id, unseal
from app.models import Connection, ConnectionStatus, PendingRevocation
from app.tables import connections as connections_table

logger = logging.getLogger("broker.security")


@dataclass(frozen=True)
class Credential:
    """A usable third-party credential, handed to tool code only. Never put it in a result."""

    provider: str
    secret: str = field(repr=False)
    account_label: str | None
    scopes: frozenset[str]
    expires_at: datetime | None = None  # when an OAuth access token stops working; None: unknown


@dataclass(frozen=True)
class ConnectionInfo:
    """What may be shown about a connection: never the secret."""

    provider: str
    audience: str  # who made it: "mcp" (the broker's own tools) or a sibling service's name
    account_label: str | None
    status: str
    scopes: frozenset[str]
    connected_at: datetime


class SealedSecret(Protocol):
    """A row holding sealed tokens: a connection, or a revocation still to make."""

    @property
    def id(self) -> int: ...
    @property
    def issuer(self) -> str: ...
    @property
    def subject(self) -> str: ...
    @property
    def provider(self) -> str: ...
    @property
    def audience(self) -> str: ...
    @property
    def sealed_credential(self) -> str: ...


class SealedRow(SealedSecret, Protocol):
    """A stored connection as read by the ORM (`Connection`) or the direct store."""

    @property
    def scopes(self) -> str: ...
    @property
    def account_label(self) -> str | None: ...
    @property
    def expires_at(self) -> datetime | None: ...


def _purpose(principal: Principal, provider: str, audience: str) -> str:
    return f"cred:v1|{principal.issuer}|{principal.subject}|{provider}|{audience}"


async def store(
    session: AsyncSession,
    *,
    keys: Keyring,
    principal: Principal,
    provider: str,
    audience: str,
    secret: dict[str, str],
    scopes: frozenset[str] = frozenset(),
    account_label: str | None = None,
    expires_at: datetime | None = None,
) -> None:
    """Insert or replace the sealed credential for (principal, provider, audience); recorded as
    the user's `credential.stored` (the user completes a flow in their browser)."""
    sealed = seal(
        json.dumps(secret).encode(), purpose=_purpose(principal, provider, audience), keys=keys
    )
    now = utcnow()
    values = {
        "issuer": principal.issuer,
        "subject": principal.subject,
        "provider": provider,
        "audience": audience,
        "status": ConnectionStatus.active,
        "sealed_credential": sealed,
        "key_id": sealed_key_id(sealed),
        "scopes": " ".join(sorted(scopes)),
        "account_label": account_label,
        "expires_at": expires_at,
        "created_at": now,
        "updated_at": now,
    }
    dialect = session.bind.dialect.name if session.bind else "sqlite"
    await session.execute(connections_table.upsert(dialect, values))
    await audit.record(
        session,
        "credential.stored",
        actor=audit.Actor.user(principal),
        principal=principal,
        provider=provider,
        audience=audience,
        account_label=account_label,
    )


async def find(
    session: AsyncSession,
    *,
    principal: Principal,
    provider: str,
    audience: str,
    for_update: bool = False,
) -> Connection | None:
    """The connection row (`for_update` locks it on PostgreSQL until the transaction ends)."""
    statement = connections_table.find(principal, provider, audience, for_update=for_update)
    return (await session.execute(statement)).scalar_one_or_none()


def open_row(row: SealedSecret, *, keys: Keyring) -> dict[str, str] | None:
    """The row's secret fields, or None (logged) when no configured key opens them."""
    principal = Principal(row.issuer, row.subject)
    try:
        secret = jsonbytes.loads(
            unseal(
                row.sealed_credential,
                purpose=_purpose(principal, row.provider, row.audience),
                keys=keys,
            )
        )
    except (InvalidSeal, ValueError):
        logger.warning(
            "credential.decrypt_failed provider=%s %s=%s", row.provider, _kind(row), row.id
        )
        return None
    return secret if isinstance(secret, dict) else None


def _kind(row: SealedSecret) -> str:
    return "revocation" if isinstance(row, PendingRevocation) else "connection"


def as_credential(row: SealedRow, secret: dict[str, str]) -> Credential:
    return Credential(
        provider=row.provider,
        secret=str(secret.get("api_key") or secret.get("access_token") or ""),
        account_label=row.account_label,
        scopes=frozenset(row.scopes.split()),
        expires_at=row.expires_at,
    )


def replace_tokens(
    row: Connection,
    *,
    keys: Keyring,
    secret: dict[str, str],
    scopes: frozenset[str],
    expires_at: datetime | None,
) -> None:
    """Re-seal a refreshed token set into its (locked) row; committed by the caller."""
    principal = Principal(row.issuer, row.subject)
    row.sealed_credential = seal(
        json.dumps(secret).encode(),
        purpose=_purpose(principal, row.provider, row.audience),
        keys=keys,
    )
    row.key_id = sealed_key_id(row.sealed_credential)
    row.scopes = " ".join(sorted(scopes))
    row.expires_at = expires_at
    row.updated_at = utcnow()


async def list_for(
    session: AsyncSession, *, principal: Principal, audience: str | None
) -> list[ConnectionInfo]:
    """The principal's connections made through `audience`, or through any (None)."""
    rows = (await session.execute(connections_table.of_principal(principal, audience))).scalars()
    return [
        ConnectionInfo(
            provider=row.provider,
            audience=row.audience,
            account_label=row.account_label,
            status=row.status,
            scopes=frozenset(row.scopes.split()),
            connected_at=row.created_at,
        )
        for row in rows
    ]


async def remove(
    session: AsyncSession, *, principal: Principal, provider: str, audience: str
) -> bool:
    """Delete the connection; True if there was one."""
    result = await session.execute(connections_table.remove(principal, provider, audience))
    return bool(getattr(result, "rowcount", 0))


async def reseal_all(session: AsyncSession, *, keys: Keyring) -> int:
    """Re-encrypt every credential not sealed with the active key (after a key rotation): the
    connections' and those of revocations still to make.

    Rows that no configured key opens are left untouched and logged.
    """
    active_id, _ = keys.current()
    connections = await session.execute(connections_table.sealed_with_another_key(active_id))
    revocations = await session.execute(
        select(PendingRevocation).where(PendingRevocation.key_id != active_id)
    )
    rows: list[Connection | PendingRevocation] = [
        *connections.scalars(),
        *revocations.scalars(),
    ]
    count = sum(_reseal(row, keys=keys) for row in rows)
    await session.flush()
    return count


def _reseal(row: Connection | PendingRevocation, *, keys: Keyring) -> bool:
    purpose = _purpose(Principal(row.issuer, row.subject), row.provider, row.audience)
    try:
        plaintext = unseal(row.sealed_credential, purpose=purpose, keys=keys)
    except InvalidSeal:
        logger.warning("credential.decrypt_failed %s=%s", _kind(row), row.id)
        return False
    row.sealed_credential = seal(plaintext, purpose=purpose, keys=keys)
    row.key_id = sealed_key_id(row.sealed_credential)
    return True
