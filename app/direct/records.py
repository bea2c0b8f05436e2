"""What the direct store reads and writes, and the interface both drivers implement.

The row helpers below name the single-call statements (SQLite's `FIND_CONNECTION`, …). PostgreSQL's
batched statements (`FIND_CONNECTIONS`, …) answer the same columns; where they lead with the
call's position, the caller strips it before handing the row over.

The records are plain slotted dataclasses, not frozen ones: a frozen dataclass's `__init__` sets
each field through `object.__setattr__`, three times the cost, and every request builds several
of these. Nothing mutates them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Protocol


class StoreUnavailable(ConnectionError):
    """The database cannot be reached or is overloaded (the request answers 503)."""


@dataclass(slots=True)
class ConnectionRecord:
    """A row of `connections` as the hot paths need it (the credential still sealed)."""

    id: int
    issuer: str
    subject: str
    provider: str
    audience: str
    status: str
    sealed_credential: str
    scopes: str
    account_label: str | None
    expires_at: datetime | None


@dataclass(slots=True)
class FlowRecord:
    """A row of `flows` without its digests and sealed values."""

    id: str
    issuer: str
    subject: str
    client_id: str
    client_name: str | None
    audience: str
    provider: str
    scopes: str
    status: str
    account_label: str | None
    failure: str | None
    expires_at: datetime


def connection_record(
    key: tuple[str, str, str, str], row: Sequence[Any], expires_at: datetime | None
) -> ConnectionRecord:
    """The record for (issuer, subject, provider, audience) from a row of the stores'
    `FIND_CONNECTION` (id, status, sealed_credential, scopes, account_label, expires_at),
    with `expires_at` as the driver's row gives it, converted."""
    issuer, subject, provider, audience = key
    return ConnectionRecord(
        id=row[0],
        issuer=issuer,
        subject=subject,
        provider=provider,
        audience=audience,
        status=row[1],
        sealed_credential=row[2],
        scopes=row[3],
        account_label=row[4],
        expires_at=expires_at,
    )


def service_and_connection(
    user: tuple[str, str, str], row: Sequence[Any], expires_at: datetime | None
) -> tuple[ServiceRecord, ConnectionRecord | None]:
    """The records from a row of the stores' `FIND_SERVICE_AND_OWN_CONNECTION` for (issuer,
    subject, provider): the service's name and providers, then `FIND_CONNECTION`'s columns (all
    NULL when the service made no such connection), with `expires_at` converted."""
    service = ServiceRecord(name=row[0], providers=row[1])
    if row[2] is None:
        return service, None
    return service, connection_record((*user, service.name), row[2:], expires_at)


def flow_record(row: Sequence[Any], expires_at: datetime) -> FlowRecord:
    """The flow's record from the first twelve columns of a `GET_FLOW_AND_CONNECTION` row (the
    fields in order, `expires_at` last), with `expires_at` converted."""
    return FlowRecord(
        id=row[0],
        issuer=row[1],
        subject=row[2],
        client_id=row[3],
        client_name=row[4],
        audience=row[5],
        provider=row[6],
        scopes=row[7],
        status=row[8],
        account_label=row[9],
        failure=row[10],
        expires_at=expires_at,
    )


def flow_and_connection(
    row: Sequence[Any], expires_at: datetime, connection_expires_at: datetime | None
) -> tuple[FlowRecord, ConnectionRecord | None]:
    """The records from a row of the stores' `GET_FLOW_AND_CONNECTION`: `GET_FLOW`'s columns,
    then `FIND_CONNECTION`'s for the flow's owner, provider and audience (all NULL when there is
    no such connection), with both `expires_at` converted."""
    flow = flow_record(row, expires_at)
    if row[12] is None:
        return flow, None
    key = (flow.issuer, flow.subject, flow.provider, flow.audience)
    return flow, connection_record(key, row[12:], connection_expires_at)


@dataclass(slots=True)
class NewFlow:
    """A flow to insert, in status `pending`."""

    id: str
    issuer: str
    subject: str
    client_id: str
    client_name: str | None
    audience: str
    provider: str
    scopes: str
    tool_name: str
    args_digest: str
    created_at: datetime
    expires_at: datetime


@dataclass(slots=True)
class ServiceRecord:
    name: str
    providers: str  # space-separated; empty means every provider


class DirectStore(Protocol):
    async def find_connection(
        self, issuer: str, subject: str, provider: str, audience: str
    ) -> ConnectionRecord | None: ...

    async def insert_flow(self, flow: NewFlow, *, max_open: int) -> bool:
        """Insert `flow` unless its owner has `max_open` unexpired open flows (pending,
        authorizing or exchanging); True if inserted."""
        ...

    async def get_flow_and_connection(
        self, flow_id: str
    ) -> tuple[FlowRecord, ConnectionRecord | None] | None:
        """The flow, and in the same statement its owner's connection for the flow's provider and
        audience, if any: a retry that finds its flow done has the credential without another
        round trip (and both come from one snapshot)."""
        ...

    async def find_service(self, digests: list[str]) -> ServiceRecord | None:
        """The unrevoked service whose secret digest is one of `digests`."""
        ...

    async def find_service_and_own_connection(
        self, digests: list[str], issuer: str, subject: str, provider: str
    ) -> tuple[ServiceRecord, ConnectionRecord | None] | None:
        """`find_service`, and in the same statement the connection that service made for
        (issuer, subject, provider), if any: a credential fetch in one round trip."""
        ...

    async def close(self) -> bool:
        """Close the store; False when the database did not answer and its connections were
        dropped instead (the caller then drops its other connections to it too)."""
        ...
