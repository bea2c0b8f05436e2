"""The credential store: the only module that unseals stored credentials.

A credential is sealed (AES-GCM, app/crypto.py) with the purpose
"cred:v1|<issuer>|<subject>|<provider>|<audience>" as associated data, so a ciphertext copied into
another user's or provider's row does not open (SECURITY.md I4): such a row is treated as absent,
logged as `credential.decrypt_failed`, and the next tool call elicits a new connection. The
sealed text also names the account's identity at the provider (`BOUND_ACCOUNT`), so a ciphertext
copied between two accounts of the same user and provider is refused the same way. It is inside
the seal rather than in the purpose so that a version without several accounts still opens it
(downgrade), and a credential sealed before it keeps opening until it is next sealed. The
statements on `connections` are app/tables/connections.py's.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Protocol

from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession
from sqlalchemy.orm.attributes import set_committed_value

from app import audit, jsonbytes
from app.auth.principal import Principal
from app.clock import utcnow
from app.crypto import InvalidSeal, Keyring, seal, sealed_key_id, unseal
from app.models import (
    BROKER_AUDIENCE,
    NO_ACCOUNT_ID,
    Connection,
    ConnectionStatus,
    PendingRevocation,
)
from app.storable import unstorable_reason
from app.tables import account_choices as choices_table
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
    account_id: str = NO_ACCOUNT_ID  # the account's identity at the provider ("": not known)
    accounts: int = 1  # how many accounts of the provider the user holds there


@dataclass(frozen=True)
class ConnectionInfo:
    """What may be shown about a connection: never the secret."""

    provider: str
    audience: str  # who made it: "mcp" (the broker's own tools) or a sibling service's name
    account_label: str | None
    status: str
    scopes: frozenset[str]
    connected_at: datetime
    account_id: str = NO_ACCOUNT_ID
    account: str | None = None  # the account's name, unique among the user's at the provider
    default: bool = True  # the account used when none is named (the latest connected or chosen)


BOUND_ACCOUNT = "bound_account"  # in the sealed text: the account_id of the row it was sealed for


class SealedSecret(Protocol):
    """A row holding sealed tokens: a connection, or a revocation still to make."""

    @property
    def id(self) -> int: ...
    @property
    def account_id(self) -> str: ...  # NO_ACCOUNT_ID on a revocation queued before it was kept
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


def _purpose(issuer: str, subject: str, provider: str, audience: str) -> str:
    return f"cred:v1|{issuer}|{subject}|{provider}|{audience}"


def seal_secret(
    keys: Keyring,
    *,
    principal: Principal,
    provider: str,
    audience: str,
    secret: dict[str, str],
    account_id: str,
) -> dict[str, object]:
    """The `sealed_credential` and `key_id` columns of `secret`, sealed for its owner, provider
    and audience, and bound to the upstream account `account_id` (`open_row` checks it)."""
    purpose = _purpose(principal.issuer, principal.subject, provider, audience)
    return _sealed_values(seal(_sealed_text(secret, account_id), purpose=purpose, keys=keys))


def _sealed_text(secret: dict[str, str], account_id: str) -> bytes:
    return json.dumps({**secret, BOUND_ACCOUNT: account_id}).encode()


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
    account_id: str = NO_ACCOUNT_ID,
    expires_at: datetime | None = None,
) -> None:
    """Insert the sealed credential for (principal, provider, audience, account_id), or replace
    the one of the same upstream account, and make it the default account; recorded as the
    user's `credential.stored` (the user completes a flow in their browser)."""
    dialect = session.bind.dialect.name if session.bind else "sqlite"
    if account_id != NO_ACCOUNT_ID and account_label is not None:
        await session.execute(
            connections_table.adopt_unidentified(
                principal, provider, audience, account_id, account_label
            )
        )
    now = utcnow()
    values = {
        "issuer": principal.issuer,
        "subject": principal.subject,
        "provider": provider,
        "audience": audience,
        "status": ConnectionStatus.active,
        **seal_secret(
            keys,
            principal=principal,
            provider=provider,
            audience=audience,
            secret=secret,
            account_id=account_id,
        ),
        "scopes": " ".join(sorted(scopes)),
        "account_label": account_label,
        "account_id": account_id,
        "expires_at": expires_at,
        "created_at": now,
        "updated_at": now,
        "selected_at": now,
    }
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
    """The default account's connection row (`for_update` locks it on PostgreSQL until the
    transaction ends)."""
    statement = connections_table.find(principal, provider, audience, for_update=for_update)
    return (await session.execute(statement)).scalar_one_or_none()


async def find_by_id(
    session: AsyncSession, connection_id: int, *, for_update: bool = False
) -> Connection | None:
    """The connection row `connection_id` (`for_update`: locked on PostgreSQL)."""
    statement = connections_table.by_id(connection_id, for_update=for_update)
    return (await session.execute(statement)).scalar_one_or_none()


def open_row(row: SealedSecret, *, keys: Keyring) -> dict[str, str] | None:
    """The row's secret fields, or None (logged) when no configured key opens them, or when
    they were sealed for another account than the row's (not checked on a revocation queued
    before revocations named their account)."""
    purpose = _purpose(row.issuer, row.subject, row.provider, row.audience)
    try:
        secret = jsonbytes.loads(unseal(row.sealed_credential, purpose=purpose, keys=keys))
    except (InvalidSeal, ValueError):
        secret = None
    if not isinstance(secret, dict):
        logger.warning(
            "credential.decrypt_failed provider=%s %s=%s", row.provider, _kind(row), row.id
        )
        return None
    bound = secret.pop(BOUND_ACCOUNT, None)
    unnamed = isinstance(row, PendingRevocation) and row.account_id == NO_ACCOUNT_ID
    if bound is not None and not unnamed and bound != row.account_id:
        logger.warning(
            "credential.decrypt_failed provider=%s %s=%s reason=account",
            row.provider,
            _kind(row),
            row.id,
        )
        return None
    return secret


def _kind(row: SealedSecret) -> str:
    return "revocation" if isinstance(row, PendingRevocation) else "connection"


def as_credential(row: SealedRow, secret: dict[str, str], *, accounts: int = 1) -> Credential:
    return Credential(
        provider=row.provider,
        secret=str(secret.get("api_key") or secret.get("access_token") or ""),
        account_label=row.account_label,
        scopes=frozenset(row.scopes.split()),
        expires_at=row.expires_at,
        account_id=row.account_id,
        accounts=accounts,
    )


async def replace_tokens(
    session: AsyncSession,
    row: Connection,
    *,
    keys: Keyring,
    secret: dict[str, str],
    scopes: frozenset[str],
    expires_at: datetime | None,
) -> bool:
    """Re-seal a refreshed token set into `row` if the row is as it was read (committed by the
    caller); False when it changed or went meanwhile, and nothing is written."""
    values = {
        **seal_secret(
            keys,
            principal=Principal(row.issuer, row.subject),
            provider=row.provider,
            audience=row.audience,
            secret=secret,
            account_id=row.account_id,
        ),
        "scopes": " ".join(sorted(scopes)),
        "expires_at": expires_at,
        "updated_at": utcnow(),
    }
    return await _update_if_unchanged(session, row, values)


def _sealed_values(sealed: str) -> dict[str, object]:
    """The columns of a credential sealed anew: the ciphertext and the id of its key."""
    return {"sealed_credential": sealed, "key_id": sealed_key_id(sealed)}


async def mark_needs_reauth(session: AsyncSession, row: Connection) -> bool:
    """Mark the connection as needing the user to connect again (the provider refused its
    refresh token), if the row is as it was read; False when it changed or went meanwhile."""
    values = {"status": ConnectionStatus.needs_reauth, "updated_at": utcnow()}
    return await _update_if_unchanged(session, row, values)


async def _update_if_unchanged(
    session: AsyncSession, row: Connection, values: Mapping[str, object]
) -> bool:
    """`values` written to `row` only if its sealed credential is still the one read; the
    loaded row then shows them (without the session writing them a second time)."""
    statement = connections_table.replace_if_unchanged(row.id, row.sealed_credential, values)
    result = await session.execute(statement)
    if getattr(result, "rowcount", 0) != 1:
        return False
    for name, value in values.items():
        set_committed_value(row, name, value)
    return True


async def list_for(
    session: AsyncSession, *, principal: Principal, audience: str | None
) -> list[ConnectionInfo]:
    """The principal's connections made through `audience`, or through any (None)."""
    rows = list(
        (await session.execute(connections_table.of_principal(principal, audience))).scalars()
    )
    names = account_names(rows)
    return [
        ConnectionInfo(
            provider=row.provider,
            audience=row.audience,
            account_label=row.account_label,
            status=row.status,
            scopes=frozenset(row.scopes.split()),
            connected_at=row.created_at,
            account_id=row.account_id,
            account=names[row.id],
            default=index == 0 or _group(rows[index - 1]) != _group(row),
        )
        for index, row in enumerate(rows)  # each group's default account first
    ]


def _group(row: Connection) -> tuple[str, str, str, str]:
    """The accounts a user holds at one provider through one audience."""
    return (row.issuer, row.subject, row.provider, row.audience)


MAX_ACCOUNT_NAME = 255


def account_name_valid(name: str) -> bool:
    """An account's name as a caller gives it (`account`, on every surface): 1-255 characters
    of storable text, no control characters."""
    return (
        0 < len(name) <= MAX_ACCOUNT_NAME
        and unstorable_reason(name) is None
        and all(ord(c) >= 32 and ord(c) != 127 for c in name)
    )


def account_names(rows: Sequence[Connection]) -> dict[int, str | None]:
    """Each connection's account name, by connection id: its label, unless another account of
    the same user, provider and audience has the same label (or it has none and has siblings);
    then the label (or "account") followed by the upstream id. A sole unlabelled connection has
    no name (None)."""
    groups: dict[tuple[str, str, str, str], list[Connection]] = {}
    for row in rows:
        groups.setdefault(_group(row), []).append(row)
    names: dict[int, str | None] = {}
    for group in groups.values():
        labels = [row.account_label for row in group]
        for row in group:
            if row.account_label is not None and labels.count(row.account_label) == 1:
                names[row.id] = row.account_label
            elif len(group) == 1:
                names[row.id] = None
            else:
                names[row.id] = f"{row.account_label or 'account'} ({row.account_id or 'earlier'})"
    return names


async def accounts(
    session: AsyncSession, *, principal: Principal, provider: str, audience: str
) -> dict[str, Connection]:
    """The principal's accounts at `provider` through `audience` by name, the default first
    (an unnamed sole account is named by its provider)."""
    rows = list(
        (await session.execute(connections_table.accounts(principal, provider, audience))).scalars()
    )
    names = account_names(rows)
    return {names[row.id] or provider: row for row in rows}


async def chosen_account(
    session: AsyncSession, *, principal: Principal, client_id: str, provider: str
) -> str | None:
    """The upstream id of the account the principal chose for the client, if any."""
    statement = choices_table.chosen(principal, client_id, provider)
    return (await session.execute(statement)).scalar_one_or_none()


async def choose_account(
    session: AsyncSession, *, principal: Principal, client_id: str, row: Connection
) -> None:
    """Remember `row`'s account as the principal's choice for the client, and make it the
    default account (the most recently selected).

    The connection first: a connection removed meanwhile (disconnected, erased) leaves no choice
    behind, and the locks are taken in the order removals take them (connection, then choices).
    """
    dialect = session.bind.dialect.name if session.bind else "sqlite"
    now = utcnow()
    selected = await session.execute(connections_table.select_account(row.id, now))
    if not getattr(selected, "rowcount", 0):
        return
    await session.execute(
        choices_table.remember(dialect, principal, client_id, row.provider, row.account_id, now)
    )


async def remove(session: AsyncSession, row: Connection) -> bool:
    """Delete the connection, and every client's choice of its account; True if it was there."""
    result = await session.execute(connections_table.remove(row.id))
    if row.audience == BROKER_AUDIENCE:  # choices are made for the broker's own tools
        principal = Principal(row.issuer, row.subject)
        await session.execute(choices_table.forget(principal, row.provider, row.account_id))
    return bool(getattr(result, "rowcount", 0))


@dataclass(frozen=True)
class Resealed:
    """What a key rotation did: credentials re-sealed with the active key, and those no
    configured key opens (left as they are, each logged)."""

    resealed: int
    unopened: int


async def reseal_all(session: AsyncSession, *, keys: Keyring) -> Resealed:
    """Re-encrypt every credential not sealed with the active key (after a key rotation): the
    connections' and those of revocations still to make."""
    active_id, _ = keys.current()
    connections = await session.execute(connections_table.sealed_with_another_key(active_id))
    revocations = await session.execute(
        select(PendingRevocation).where(PendingRevocation.key_id != active_id)
    )
    resealed = unopened = 0
    for connection in connections.scalars():
        sealed = _resealed(connection, keys=keys)
        if sealed is None:
            unopened += 1
        # written only if unchanged since read: a refresh meanwhile sealed it with the active key
        elif await _update_if_unchanged(session, connection, _sealed_values(sealed)):
            resealed += 1
    for pending in revocations.scalars():  # nothing but a rotation rewrites these
        sealed = _resealed(pending, keys=keys)
        if sealed is None:
            unopened += 1
        else:
            pending.sealed_credential, pending.key_id = sealed, sealed_key_id(sealed)
            resealed += 1
    await session.flush()
    return Resealed(resealed, unopened)


def _resealed(row: Connection | PendingRevocation, *, keys: Keyring) -> str | None:
    """The row's credential sealed with the active key; None (logged) when no key opens it."""
    purpose = _purpose(row.issuer, row.subject, row.provider, row.audience)
    try:
        plaintext = unseal(row.sealed_credential, purpose=purpose, keys=keys)
    except InvalidSeal:
        logger.warning("credential.decrypt_failed %s=%s", _kind(row), row.id)
        return None
    if isinstance(row, Connection):  # a connection sealed before the account was bound: bind it
        secret = jsonbytes.loads(plaintext)
        if isinstance(secret, dict) and BOUND_ACCOUNT not in secret:
            plaintext = _sealed_text(secret, row.account_id)
    return seal(plaintext, purpose=purpose, keys=keys)
