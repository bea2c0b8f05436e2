"""Every statement on `flows`.

The state machine (app/connect/service.py) decides which transition to make; the statements that
make them, and the hot ones the direct store compiles (`insert_one`/`insert_many`,
`read_one`/`read_many`, `reusable_one`), are here.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import (
    ColumnElement,
    Delete,
    Insert,
    Integer,
    ScalarSelect,
    Select,
    Text,
    Update,
    and_,
    any_,
    bindparam,
    delete,
    func,
    insert,
    select,
    update,
)
from sqlalchemy.dialects.postgresql import ARRAY

from app.auth.principal import Principal
from app.models import OPEN_FLOW_STATUSES, Flow, FlowStatus, UtcDateTime
from app.tables import Rows, inline
from app.tables.connections import with_connection

# What the hot read returns of a flow (no digests, no sealed values).
HOT_COLUMNS = (
    Flow.id,
    Flow.issuer,
    Flow.subject,
    Flow.client_id,
    Flow.client_name,
    Flow.audience,
    Flow.provider,
    Flow.scopes,
    Flow.status,
    Flow.account_label,
    Flow.failure,
    Flow.expires_at,
)
# What an insert binds, beside `max_open`.
NEW_TEXTS = (
    "id",
    "issuer",
    "subject",
    "client_id",
    "client_name",
    "audience",
    "provider",
    "scopes",
    "tool_name",
    "args_digest",
)
NEW_TIMES = ("created_at", "expires_at")
# What makes two round 1s the same call: a flow open for one is handed to the other.
SAME_CALL = (
    "issuer",
    "subject",
    "audience",
    "client_id",
    "provider",
    "scopes",
    "tool_name",
    "args_digest",
)


def is_open() -> ColumnElement[bool]:
    return Flow.status.in_([inline(status) for status in OPEN_FLOW_STATUSES])


def _counted(
    conditions: tuple[ColumnElement[bool], ...], up_to: Any, name: str
) -> ScalarSelect[int]:
    """How many flows meet `conditions`, counted up to `up_to`: a scalar subquery the insert
    probes once per new flow (its FROM is its own: the owner comes from the outer statement).
    Not `NOT EXISTS` for "none": PostgreSQL makes that an anti-join, and the generic plan of the
    batched insert then joined the whole table (a batch took 20 ms, not 2, at the 90th
    percentile)."""
    found = select(inline(1)).where(*conditions).limit(up_to).correlate_except(Flow)
    return select(func.count()).select_from(found.subquery(name)).scalar_subquery()


def _open_count(issuer: Any, subject: Any, audience: Any, now: Any, cap: Any) -> ScalarSelect[int]:
    """How many unexpired open flows the owner has for `audience`, counted up to `cap` from the
    owner index alone. Per audience: a sibling service's flows never use up the places of the
    user's MCP client, nor another service's."""
    owner = (Flow.issuer == issuer, Flow.subject == subject, Flow.audience == audience)
    return _counted((*owner, is_open(), Flow.expires_at > now), cap, "open_flows")


def _same_call_open(new: dict[str, Any]) -> tuple[ColumnElement[bool], ...]:
    """Where a flow is an open flow of the same call as `new` (by column) whose link lasts past
    `new["reuse_after"]`: the round 1 that made `new` hands out such a flow instead."""
    return (
        *(getattr(Flow, name) == new[name] for name in SAME_CALL),
        is_open(),
        Flow.expires_at > new["reuse_after"],
    )


def _none_of_the_same_call(new: dict[str, Any]) -> ColumnElement[bool]:
    return _counted(_same_call_open(new), 1, "same_call") == 0


def _insert_capped(
    new: dict[str, Any], allowed: ColumnElement[bool], source: Any | None = None
) -> Insert:
    """Insert the flow `new` (its values, by column) in status `pending` where `allowed`."""
    values = select(
        *(new[name] for name in NEW_TEXTS),
        inline(FlowStatus.pending),
        new["created_at"],
        new["created_at"],
        new["expires_at"],
    ).where(allowed)
    if source is not None:
        values = values.select_from(source)
    columns = [*NEW_TEXTS, "status", "created_at", "updated_at", "expires_at"]
    return insert(Flow).from_select(columns, values)


def insert_one() -> Insert:
    """A new flow (bound by column, `max_open` and `reuse_after`), unless its owner has
    `max_open` unexpired open flows for its audience already, or an open flow of the same call
    to reuse (`reusable`)."""
    new: dict[str, Any] = {name: bindparam(name, type_=Text) for name in NEW_TEXTS}
    new |= {name: bindparam(name, type_=UtcDateTime()) for name in (*NEW_TIMES, "reuse_after")}
    cap = bindparam("max_open", type_=Integer)
    opened = _open_count(new["issuer"], new["subject"], new["audience"], new["created_at"], cap)
    return _insert_capped(new, and_(opened < cap, _none_of_the_same_call(new)))


def reusable_one() -> Rows:
    """The open flow of the same call as the flow `insert_one` was bound with (its same-call
    columns and `reuse_after`, bound by name), that the insert found instead of inserting: the
    one lasting longest."""
    new: dict[str, Any] = {name: bindparam(name, type_=Text) for name in SAME_CALL}
    new["reuse_after"] = bindparam("reuse_after", type_=UtcDateTime())
    return (
        select(*HOT_COLUMNS).where(*_same_call_open(new)).order_by(Flow.expires_at.desc()).limit(1)
    )


def insert_many() -> Insert:
    """`insert_one` for arrays (one entry per call), counting the flows of the same owner and
    audience earlier in the arrays as open too; RETURNING the flows inserted (what their audit
    events need)."""
    texts = [bindparam(name, type_=ARRAY(Text)) for name in NEW_TEXTS]
    times = [bindparam(name, type_=ARRAY(UtcDateTime())) for name in (*NEW_TIMES, "reuse_after")]
    caps = bindparam("max_open", type_=ARRAY(Integer))
    names = (*NEW_TEXTS, *NEW_TIMES, "reuse_after", "max_open")
    calls = (
        func.unnest(*texts, *times, caps)
        .table_valued(*names, with_ordinality="pos")
        .render_derived(name="n")
    )
    owner = ("issuer", "subject", "audience")
    owners = (
        func.unnest(*(texts[NEW_TEXTS.index(name)] for name in owner))
        .table_valued(*owner, with_ordinality="pos")
        .render_derived(name="e")
    )
    earlier = (
        select(func.count())
        .select_from(owners)
        .where(
            *(owners.c[name] == calls.c[name] for name in owner),
            owners.c.pos < calls.c.pos,
        )
        .scalar_subquery()
    )
    new = {name: calls.c[name] for name in names}
    opened = _open_count(
        calls.c.issuer, calls.c.subject, calls.c.audience, calls.c.created_at, calls.c.max_open
    )
    allowed = and_(opened + earlier < calls.c.max_open, _none_of_the_same_call(new))
    inserted = _insert_capped(new, allowed, calls)
    return inserted.returning(
        Flow.id, Flow.issuer, Flow.subject, Flow.provider, Flow.audience, Flow.created_at
    )


def _with_owners_connection(statement: Rows, *, lateral: bool) -> Rows:
    return with_connection(
        statement,
        Flow.issuer,
        Flow.subject,
        Flow.provider,
        Flow.audience,
        lateral=lateral,
        present=Flow.id,
    )


def read_one() -> Rows:
    """The flow with the bound `id`, and its owner's connection for its provider and audience."""
    flow = select(*HOT_COLUMNS).where(Flow.id == bindparam("id", type_=Text))
    return _with_owners_connection(flow, lateral=False)


def read_many() -> Rows:
    """`read_one` for an array of `ids`."""
    ids = bindparam("ids", type_=ARRAY(Text))
    return _with_owners_connection(select(*HOT_COLUMNS).where(Flow.id == any_(ids)), lateral=True)


def by_id(flow_id: str) -> Select[Flow]:
    return select(Flow).where(Flow.id == flow_id)


def id_by_state(state_digest: str) -> Select[str]:
    return select(Flow.id).where(Flow.state_digest == state_digest)


def open_among() -> Select[str]:
    """The ids among the bound list `ids` of flows still open at `now` (the check of the flows
    a process's retries wait for, app/connect/notify.py)."""
    return select(Flow.id).where(
        Flow.id.in_(bindparam("ids", expanding=True)),
        is_open(),
        Flow.expires_at > bindparam("now", type_=UtcDateTime),
    )


def transition(
    flow_id: str,
    principal: Principal,
    *,
    from_statuses: tuple[str, ...],
    unexpired_at: datetime | None,
    values: dict[str, object],
) -> Update:
    """Move the principal's flow, if in one of `from_statuses` (and unexpired at
    `unexpired_at`, unless None), with `values`."""
    conditions = [
        Flow.id == flow_id,
        Flow.issuer == principal.issuer,
        Flow.subject == principal.subject,
        Flow.status.in_(from_statuses),
    ]
    if unexpired_at is not None:
        conditions.append(Flow.expires_at > unexpired_at)
    return (
        update(Flow)
        .where(*conditions)
        .values(**values)
        .execution_options(synchronize_session=False)
    )


def claim(flow_id: str, state_digest: str, now: datetime) -> Update:
    """`authorizing → exchanging` for the flow holding `state_digest`, RETURNING its sealed
    PKCE verifier."""
    return (
        update(Flow)
        .where(
            Flow.id == flow_id,
            Flow.status == FlowStatus.authorizing,
            Flow.state_digest == state_digest,
            Flow.expires_at > now,
        )
        .values(status=FlowStatus.exchanging, updated_at=now)
        .returning(Flow.sealed_pkce_verifier)
        .execution_options(synchronize_session=False)
    )


# The sweeper's chunks: a statement on the flows whose ids the chunk's subquery selects.
ChunkStatement = Callable[[Select[str]], Update | Delete]


def chunk(*condition: ColumnElement[bool], size: int) -> Select[str]:
    """Up to `size` ids of flows matching `condition`, locked (PostgreSQL; SQLite runs one
    writer): a flow another transaction moves meanwhile is read again and dropped if it no
    longer matches, one locked by a transaction still running is skipped."""
    return select(Flow.id).where(*condition).limit(size).with_for_update(skip_locked=True)


def open_past_expiry(now: datetime) -> tuple[ColumnElement[bool], ...]:
    return (is_open(), Flow.expires_at <= now)


def expire(now: datetime) -> ChunkStatement:
    """Expire the chunk's flows, dropping their secrets; RETURNING whose flows they were (for
    their audit events)."""
    return lambda ids: (
        update(Flow)
        .where(Flow.id.in_(ids))
        .values(
            status=FlowStatus.expired, updated_at=now, state_digest=None, sealed_pkce_verifier=None
        )
        .returning(Flow.issuer, Flow.subject, Flow.provider, Flow.audience)
    )


def release_exchanges(now: datetime, lease: timedelta) -> Update:
    """A process that died mid-exchange leaves `exchanging`: after the lease, back to
    `pending`, so the user may retry."""
    return (
        update(Flow)
        .where(Flow.status == FlowStatus.exchanging, Flow.updated_at <= now - lease)
        .values(
            status=FlowStatus.pending,
            updated_at=now,
            failure="interrupted",
            sealed_pkce_verifier=None,
        )
        .execution_options(synchronize_session=False)
    )


def expired_before(cutoff: datetime) -> tuple[ColumnElement[bool], ...]:
    """Every status named: the (status, expires_at) index then serves the delete as one range per
    status; `expires_at` alone leads no index, and the table would be scanned every minute."""
    return (Flow.status.in_(tuple(FlowStatus)), Flow.expires_at <= cutoff)


def remove(ids: Select[str]) -> Delete:
    return delete(Flow).where(Flow.id.in_(ids))


def remove_of_owner(issuer: str, subject: str) -> Delete:
    """Every flow of the user, whatever its status (an erasure)."""
    return delete(Flow).where(Flow.issuer == issuer, Flow.subject == subject)
