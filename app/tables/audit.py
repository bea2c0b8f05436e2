"""Every statement on `audit_events`.

Rows are only added (in the transaction of the change they record), listed, read in order by the
webhooks (`settled_after`), and deleted: by the retention sweep, and by a user's erasure. A new
flow's event is written by the flow insert's own statement on PostgreSQL (`with_new_flows`) and
right after it, in its transaction, on SQLite (`for_new_flow`): the hot round 1 gets no round
trip more.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import (
    BigInteger,
    ColumnElement,
    Delete,
    Insert,
    Select,
    Text,
    bindparam,
    case,
    cast,
    delete,
    func,
    insert,
    literal,
    select,
    tuple_,
)
from sqlalchemy.dialects.postgresql import ARRAY
from sqlalchemy.sql.selectable import CTE

from app.models import BROKER_AUDIENCE, ActorKind, AuditEvent, Flow
from app.tables import inline

FLOW_CREATED = "flow.created"
COLUMNS = (
    "occurred_at",
    "event",
    "actor_kind",
    "actor_id",
    "issuer",
    "subject",
    "provider",
    "audience",
    "request_id",
)


def add(rows: list[dict[str, Any]]) -> Insert:
    """Insert `rows` (values by column; the session binds them)."""
    return insert(AuditEvent).values(rows)


def _flow_created(source: Any, request_id: ColumnElement[Any]) -> Select[Any]:
    """The `flow.created` row of each flow in `source` (a table or CTE with the flow columns)."""
    own = source.c.audience == inline(BROKER_AUDIENCE)
    return select(
        source.c.created_at,
        inline(FLOW_CREATED),
        case((own, inline(ActorKind.user)), else_=inline(ActorKind.service)),
        case((own, source.c.issuer + inline("|") + source.c.subject), else_=source.c.audience),
        source.c.issuer,
        source.c.subject,
        source.c.provider,
        source.c.audience,
        request_id,
    )


def for_new_flow() -> Insert:
    """The event of the flow with the bound `id` just inserted (none if the insert was refused),
    with the bound `request_id`."""
    flows = Flow.__table__
    rows = _flow_created(flows, bindparam("request_id", type_=Text)).where(
        flows.c.id == bindparam("id", type_=Text)
    )
    return insert(AuditEvent).from_select(COLUMNS, rows)


def with_new_flows(flows_insert: Insert) -> Select[Any]:
    """`flows_insert` (RETURNING the new flows' columns) with their events added in the same
    statement; selects the ids inserted. Each flow's request id comes from the arrays `id` and
    `request_id` bound beside the insert's."""
    inserted: CTE = flows_insert.cte("inserted")
    given = (
        func.unnest(bindparam("id", type_=ARRAY(Text)), bindparam("request_id", type_=ARRAY(Text)))
        .table_valued("id", "request_id")
        .render_derived(name="r")
    )
    rows = _flow_created(inserted, given.c.request_id).select_from(
        inserted.join(given, given.c.id == inserted.c.id)
    )
    recorded = insert(AuditEvent).from_select(COLUMNS, rows).cte("recorded")
    return select(inserted.c.id).add_cte(recorded)


def listing(
    *,
    issuer: str | None,
    subject: str | None,
    provider: str | None,
    since: datetime | None,
    limit: int,
) -> Select[Any]:
    """The `limit` most recent events matching every filter given, newest first."""
    conditions: list[ColumnElement[bool]] = []
    if issuer is not None:
        conditions.append(AuditEvent.issuer == issuer)
    if subject is not None:
        conditions.append(AuditEvent.subject == subject)
    if provider is not None:
        conditions.append(AuditEvent.provider == provider)
    if since is not None:
        conditions.append(AuditEvent.occurred_at >= since)
    return (
        select(AuditEvent)
        .where(*conditions)
        .order_by(AuditEvent.occurred_at.desc(), AuditEvent.id.desc())
        .limit(limit)
    )


def older_than(cutoff: datetime, size: int) -> Select[Any]:
    """Up to `size` ids of events before `cutoff` (the retention sweep's chunk)."""
    return select(AuditEvent.id).where(AuditEvent.occurred_at < cutoff).limit(size)


def remove(ids: Select[Any]) -> Delete:
    return delete(AuditEvent).where(AuditEvent.id.in_(ids))


def remove_of_user(issuer: str, subject: str, before: datetime) -> Delete:
    """The user's events older than `before` (an erasure keeps the recent ones)."""
    return delete(AuditEvent).where(
        AuditEvent.issuer == issuer, AuditEvent.subject == subject, AuditEvent.occurred_at < before
    )


# Where an event stands in the webhooks' order (app/webhooks/delivery.py): (txid, id) on
# PostgreSQL, (0, id) on SQLite.
Position = tuple[int, int]


def _settled() -> ColumnElement[bool]:
    """PostgreSQL: written by a transaction older than every one still running. Such a row's
    place is final: whatever commits later was written by a younger transaction, and so sorts
    after it in (txid, id) order, whatever ids the sequence handed out meanwhile."""
    horizon = func.pg_snapshot_xmin(func.pg_current_snapshot())
    return AuditEvent.txid < cast(cast(horizon, Text), BigInteger)


def _after(position: Position, *, postgres: bool) -> ColumnElement[bool]:
    if postgres:
        return tuple_(AuditEvent.txid, AuditEvent.id) > tuple_(
            literal(position[0], BigInteger), literal(position[1], BigInteger)
        )
    return AuditEvent.id > position[1]  # SQLite: one writer at a time, ids in commit order


def settled_after(
    position: Position, *, events: tuple[str, ...] | None, limit: int, postgres: bool
) -> Select[Any]:
    """Up to `limit` events after `position` (of `events`, or all), in the webhooks' order,
    that no transaction still running can come before."""
    conditions = [_after(position, postgres=postgres)]
    if postgres:
        conditions.append(_settled())
    if events is not None:
        conditions.append(AuditEvent.event.in_(events))
    order = (AuditEvent.txid, AuditEvent.id) if postgres else (AuditEvent.id,)
    return select(AuditEvent).where(*conditions).order_by(*order).limit(limit)


def newest_settled(*, postgres: bool) -> Select[int | None, int]:
    """The position of the newest settled event (none when there is no event)."""
    if postgres:
        return (
            select(AuditEvent.txid, AuditEvent.id)
            .where(AuditEvent.txid.is_not(None), _settled())
            .order_by(AuditEvent.txid.desc(), AuditEvent.id.desc())
            .limit(1)
        )
    return select(literal(0, BigInteger), func.max(AuditEvent.id)).having(
        func.max(AuditEvent.id).is_not(None)
    )


def count_after(
    position: Position, *, events: tuple[str, ...] | None, postgres: bool
) -> Select[Any]:
    """How many events (of `events`, or all) come after `position`, settled or not."""
    conditions = [_after(position, postgres=postgres)]
    if events is not None:
        conditions.append(AuditEvent.event.in_(events))
    return select(func.count()).select_from(AuditEvent).where(*conditions)
