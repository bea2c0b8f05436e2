"""Recording lifecycle events in `audit_events`, in the transaction of the change they record.

`record` adds one row with the caller's session: the event commits with the change or not at
all. An event names who acted (`Actor`), the user it concerns, the provider and account label
when known, and the request id of the request being served; never a secret (the columns have no
room for one, and `detail` holds only codes and counts the broker makes).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from app import request_id
from app.auth.principal import Principal
from app.clock import utcnow
from app.models import BROKER_AUDIENCE, ActorKind
from app.tables import audit as audit_table


@dataclass(frozen=True, slots=True)
class Actor:
    kind: ActorKind
    id: str

    @classmethod
    def user(cls, principal: Principal) -> Actor:
        return cls(ActorKind.user, f"{principal.issuer}|{principal.subject}")

    @classmethod
    def service(cls, name: str) -> Actor:
        return cls(ActorKind.service, name)

    @classmethod
    def operator(cls, via: str) -> Actor:
        return cls(ActorKind.operator, via)

    @classmethod
    def for_audience(cls, principal: Principal, audience: str) -> Actor:
        """Who speaks for the user of a flow or connection made through `audience`: the user
        (the broker's own MCP endpoint), or the sibling service relaying them."""
        return cls.user(principal) if audience == BROKER_AUDIENCE else cls.service(audience)


BROKER = Actor(ActorKind.broker, "broker")
CLI = Actor(ActorKind.operator, "cli")


def row(
    event: str,
    *,
    actor: Actor,
    principal: Principal | None = None,
    provider: str | None = None,
    audience: str | None = None,
    account_label: str | None = None,
    detail: str | None = None,
) -> dict[str, Any]:
    """The values of one event row, stamped now and with the current request's id."""
    return {
        "occurred_at": utcnow(),
        "event": event,
        "actor_kind": actor.kind.value,
        "actor_id": actor.id[:511],
        "issuer": principal.issuer if principal else None,
        "subject": principal.subject if principal else None,
        "provider": provider,
        "audience": audience,
        "account_label": account_label[:255] if account_label else None,
        "detail": detail[:128] if detail else None,
        "request_id": request_id.current.get(),
    }


async def record(
    session: AsyncSession,
    event: str,
    *,
    actor: Actor,
    principal: Principal | None = None,
    provider: str | None = None,
    audience: str | None = None,
    account_label: str | None = None,
    detail: str | None = None,
) -> None:
    """Add one event in `session`'s transaction (committed with the change it records)."""
    values = row(
        event,
        actor=actor,
        principal=principal,
        provider=provider,
        audience=audience,
        account_label=account_label,
        detail=detail,
    )
    await session.execute(audit_table.add([values]))


async def record_rows(session: AsyncSession, rows: list[dict[str, Any]]) -> None:
    """Add several events at once (a sweep's chunk)."""
    if rows:
        await session.execute(audit_table.add(rows))


SWEEP_CHUNK = 1000  # rows per retention statement, each its own short transaction


async def sweep(sessions: async_sessionmaker[AsyncSession], *, retention_days: int) -> int:
    """Delete the events older than `retention_days`, SWEEP_CHUNK at a time; rows deleted."""
    cutoff = utcnow() - timedelta(days=retention_days)
    total = 0
    while True:
        async with sessions.begin() as session:
            result = await session.execute(
                audit_table.remove(audit_table.older_than(cutoff, SWEEP_CHUNK))
            )
        deleted = int(getattr(result, "rowcount", 0))
        total += deleted
        if deleted < SWEEP_CHUNK:
            return total
