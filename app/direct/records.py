"""What the direct store reads and writes, and the interface both drivers implement.

Rows are read by column name (`RowReader`, from the compiled statement's own columns): a column
added to a statement, or moved in it, cannot shift what a record reads.

The records are plain slotted dataclasses, not frozen ones: a frozen dataclass's `__init__` sets
each field through `object.__setattr__`, three times the cost, and every request builds several
of these. Nothing mutates them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields
from datetime import datetime
from typing import Any, Protocol

from app.direct.compiled import Compiled, Row
from app.tables.connections import PREFIX


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
    account_id: str
    expires_at: datetime | None
    accounts: int  # how many accounts of the provider the user holds there; this is the default


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


# The columns read, by name, in the order the readers below unpack them.
CONNECTION_COLUMNS = tuple(
    f"{PREFIX}{name}"
    for name in (
        *("id", "status", "sealed_credential", "scopes", "account_label", "account_id"),
        *("expires_at", "accounts"),
    )
)
FLOW_COLUMNS = tuple(field.name for field in fields(FlowRecord))
SERVICE_COLUMNS = ("name", "providers")

# A stored time as the driver gives it (SQLite: text), made an aware datetime.
ReadTime = Callable[[Any], datetime]


def _reader(compiled: Compiled, names: tuple[str, ...]) -> Callable[[Row], tuple[Any, ...]] | None:
    """Reads `names` from the statement's rows; None if it returns none of them (KeyError if it
    returns some only)."""
    if names[0] not in compiled.columns:
        return None
    return compiled.reader(names)


class RowReader:
    """Builds the records from the rows of one compiled statement, reading its columns by name.

    Raises KeyError when built for a statement that lacks a column a record needs.
    """

    __slots__ = ("_connection", "_flow", "_service", "_time")

    def __init__(self, compiled: Compiled, time: ReadTime) -> None:
        self._time = time
        self._connection = _reader(compiled, CONNECTION_COLUMNS)
        self._flow = _reader(compiled, FLOW_COLUMNS)
        self._service = _reader(compiled, SERVICE_COLUMNS)

    def connection(self, key: tuple[str, str, str, str], row: Row) -> ConnectionRecord | None:
        """The connection of (issuer, subject, provider, audience) in `row`, if any."""
        assert self._connection is not None
        id_, status, sealed, scopes, label, account_id, expires_at, accounts = self._connection(row)
        if id_ is None:
            return None
        issuer, subject, provider, audience = key
        return ConnectionRecord(
            id=id_,
            issuer=issuer,
            subject=subject,
            provider=provider,
            audience=audience,
            status=status,
            sealed_credential=sealed,
            scopes=scopes,
            account_label=label,
            account_id=account_id,
            expires_at=self._time(expires_at) if expires_at is not None else None,
            accounts=accounts,
        )

    def flow(self, row: Row) -> FlowRecord:
        assert self._flow is not None
        flow = FlowRecord(*self._flow(row))  # FLOW_COLUMNS are its fields, in order
        flow.expires_at = self._time(flow.expires_at)  # as the driver gave it, until here
        return flow

    def flow_and_connection(self, row: Row) -> tuple[FlowRecord, ConnectionRecord | None]:
        """The flow, and its owner's connection for its provider and audience, if any."""
        flow = self.flow(row)
        key = (flow.issuer, flow.subject, flow.provider, flow.audience)
        return flow, self.connection(key, row)

    def service(self, row: Row) -> ServiceRecord:
        assert self._service is not None
        name, providers = self._service(row)
        return ServiceRecord(name=name, providers=providers)

    def service_and_connection(
        self, user: tuple[str, str, str], row: Row
    ) -> tuple[ServiceRecord, ConnectionRecord | None]:
        """The service, and the connection it made for (issuer, subject, provider), if any."""
        service = self.service(row)
        return service, self.connection((*user, service.name), row)


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
    request_id: str | None = None  # recorded with the flow's `flow.created` audit event


def insert_values(flow: NewFlow, max_open: int, time: Callable[[datetime], Any]) -> dict[str, Any]:
    """The parameters of the tables' flow insert for `flow`, times as `time` makes them. An open
    flow of the same call is reused while its link lasts at least half as long as `flow`'s."""
    reuse_after = flow.created_at + (flow.expires_at - flow.created_at) / 2
    return {
        "id": flow.id,
        "issuer": flow.issuer,
        "subject": flow.subject,
        "client_id": flow.client_id,
        "client_name": flow.client_name,
        "audience": flow.audience,
        "provider": flow.provider,
        "scopes": flow.scopes,
        "tool_name": flow.tool_name,
        "args_digest": flow.args_digest,
        "created_at": time(flow.created_at),
        "expires_at": time(flow.expires_at),
        "reuse_after": time(reuse_after),
        "max_open": max_open,
    }


@dataclass(slots=True)
class ServiceRecord:
    name: str
    providers: str  # space-separated; empty means every provider


OPEN_CHECK_CHUNK = 1000  # flow ids per statement of `still_open`


def open_check_chunks(flow_ids: list[str]) -> list[list[str]]:
    """`flow_ids` in lists of exactly OPEN_CHECK_CHUNK ids, the last one padded with its own last
    id (a repeated id changes nothing in an `IN` list): one compiled text serves every call."""
    chunks = [flow_ids[n : n + OPEN_CHECK_CHUNK] for n in range(0, len(flow_ids), OPEN_CHECK_CHUNK)]
    if chunks:
        chunks[-1] += [chunks[-1][-1]] * (OPEN_CHECK_CHUNK - len(chunks[-1]))
    return chunks


class DirectStore(Protocol):
    async def find_connection(
        self, issuer: str, subject: str, provider: str, audience: str
    ) -> ConnectionRecord | None: ...

    async def insert_flow(self, flow: NewFlow, *, max_open: int) -> bool:
        """Insert `flow` unless its owner has `max_open` unexpired open flows (pending,
        authorizing or exchanging) for its audience, or an open flow of the same call to reuse
        (`find_reusable_flow`); True if inserted."""
        ...

    async def find_reusable_flow(self, flow: NewFlow) -> FlowRecord | None:
        """The owner's open flow of the same call as `flow` that `insert_flow` would reuse
        instead of inserting `flow` (the one lasting longest), if any."""
        ...

    async def get_flow_and_connection(
        self, flow_id: str
    ) -> tuple[FlowRecord, ConnectionRecord | None] | None:
        """The flow, and in the same statement its owner's connection for the flow's provider and
        audience, if any: a retry that finds its flow done has the credential without another
        round trip (and both come from one snapshot)."""
        ...

    async def still_open(self, flow_ids: list[str]) -> set[str]:
        """Which of `flow_ids` are flows still open (any number of ids: one statement per
        OPEN_CHECK_CHUNK of them)."""
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
