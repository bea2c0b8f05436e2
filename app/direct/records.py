"""What the direct store reads and writes, and the interface both drivers implement."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Protocol


class StoreUnavailable(ConnectionError):
    """The database cannot be reached or is overloaded (the request answers 503)."""


@dataclass(frozen=True, slots=True)
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


@dataclass(frozen=True, slots=True)
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


@dataclass(frozen=True, slots=True)
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


@dataclass(frozen=True, slots=True)
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

    async def get_flow(self, flow_id: str) -> FlowRecord | None: ...

    async def find_service(self, digests: list[str]) -> ServiceRecord | None:
        """The unrevoked service whose secret digest is one of `digests`."""
        ...

    async def close(self) -> None: ...
