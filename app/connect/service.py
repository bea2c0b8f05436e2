"""Connect-flow lifecycle. Every transition is one conditional UPDATE (app/tables/flows.py), so
double clicks, replays and races have exactly one winner (DESIGN.md §5):

    pending ─api key─▶ completed ─retry─▶ consumed
    pending|authorizing|exchanging ─decline/cancel─▶ declined|cancelled
    pending|authorizing|exchanging ─expires_at─▶ expired (purged later)

A flow is bound to (issuer, subject, client id, provider, tool, argument digest) when created; only
that principal can read or move it. Flow ids are 256-bit random and carry no authority.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta

from sqlalchemy import ColumnElement
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from app import audit, request_id
from app.audit import Actor
from app.auth.principal import McpCaller, Principal
from app.clock import utcnow
from app.crypto import random_token
from app.direct import ConnectionRecord, DirectStore, FlowRecord, NewFlow
from app.models import BROKER_AUDIENCE, DONE_FLOW_STATUSES, OPEN_FLOW_STATUSES, Flow, FlowStatus
from app.tables import flows as flows_table

MAX_OPEN_FLOWS = 20  # unfinished flows per user and audience (app/tables/flows.py)
PURGE_AFTER = timedelta(days=1)
EXCHANGE_LEASE = timedelta(seconds=60)
PURGE_CHUNK = 1000  # rows per sweeper statement: tens of milliseconds, on either database


class TooManyOpenFlows(Exception):
    """The user already has the maximum number of unfinished connect links for the audience."""


@dataclass(slots=True)
class FlowView:
    """A flow as pages and tools may see it (no digests, no sealed values). Slotted, not frozen,
    like the records it is built from (app/direct/records.py): built on every MCP retry."""

    id: str
    principal: Principal
    client_id: str
    client_name: str | None
    audience: str
    provider: str
    scopes: tuple[str, ...]
    status: str
    account_label: str | None
    failure: str | None
    expires_at: datetime

    @property
    def is_open(self) -> bool:
        return self.status in OPEN_FLOW_STATUSES and self.expires_at > utcnow()

    @property
    def is_done(self) -> bool:
        return self.status in DONE_FLOW_STATUSES

    @property
    def outcome(self) -> str:
        """The status a visitor or client should see (an open flow past its expiry is expired)."""
        if self.status in OPEN_FLOW_STATUSES and self.expires_at <= utcnow():
            return FlowStatus.expired
        return self.status


@dataclass(slots=True)
class FlowRead:
    """A flow read for its owner, with the owner's connection for the flow's provider and
    audience as the same statement found it (None: there was none)."""

    flow: FlowView
    connection: ConnectionRecord | None


def _view(flow: Flow | FlowRecord) -> FlowView:
    return FlowView(
        id=flow.id,
        principal=Principal(flow.issuer, flow.subject),
        client_id=flow.client_id,
        client_name=flow.client_name,
        audience=flow.audience,
        provider=flow.provider,
        scopes=tuple(flow.scopes.split()),
        status=flow.status,
        account_label=flow.account_label,
        failure=flow.failure,
        expires_at=flow.expires_at,
    )


async def create(
    store: DirectStore,
    *,
    caller: McpCaller,
    client_name: str | None,
    provider: str,
    scopes: tuple[str, ...],
    tool_name: str,
    args_digest: str,
    ttl_seconds: int,
    audience: str = BROKER_AUDIENCE,
) -> FlowView:
    """Start a flow for the caller (the hot path: one statement, straight through the driver),
    or hand back the caller's open flow of the same call (client, audience, provider, scopes,
    tool and arguments) while its link lasts at least half as long as a new one: a client that
    repeats a call gets the same link, not one more. (Two of the same call in one loop turn may
    each get a link on PostgreSQL, which inserts a turn's flows in one statement.)

    Raises:
        TooManyOpenFlows: the caller has too many unfinished flows for `audience`.
    """
    now = utcnow()
    flow = NewFlow(
        id=random_token(),
        issuer=caller.principal.issuer,
        subject=caller.principal.subject,
        client_id=caller.client_id,
        client_name=(client_name or "")[:255] or None,
        audience=audience,
        provider=provider,
        scopes=" ".join(scopes),
        tool_name=tool_name,
        args_digest=args_digest,
        created_at=now,
        expires_at=now + timedelta(seconds=ttl_seconds),
        request_id=request_id.current.get(),
    )
    # Not inserted: the caller has a flow to reuse, or too many. A flow to reuse that ended
    # between the insert and the read leaves a place, so the insert gets one more try.
    for _ in range(2):
        if await store.insert_flow(flow, max_open=MAX_OPEN_FLOWS):
            return _new_view(flow, caller.principal, scopes)
        reused = await store.find_reusable_flow(flow)
        if reused is not None:
            return _view(reused)
    raise TooManyOpenFlows()


def _new_view(flow: NewFlow, principal: Principal, scopes: tuple[str, ...]) -> FlowView:
    return FlowView(
        id=flow.id,
        principal=principal,
        client_id=flow.client_id,
        client_name=flow.client_name,
        audience=flow.audience,
        provider=flow.provider,
        scopes=scopes,
        status=FlowStatus.pending,
        account_label=None,
        failure=None,
        expires_at=flow.expires_at,
    )


async def read_for(store: DirectStore, *, flow_id: str, principal: Principal) -> FlowRead | None:
    """The flow and its connection if it belongs to `principal` (MCP retries: foreign flows
    don't exist)."""
    if not flow_id or len(flow_id) > 64:
        return None
    found = await store.get_flow_and_connection(flow_id)
    if found is None:
        return None
    record, connection = found
    if (record.issuer, record.subject) != (principal.issuer, principal.subject):
        return None
    return FlowRead(_view(record), connection)


async def get(session: AsyncSession, *, flow_id: str) -> FlowView | None:
    """The flow by id, for any principal (pages check the identity themselves)."""
    if not flow_id or len(flow_id) > 64:
        return None
    statement = flows_table.by_id(flow_id).execution_options(populate_existing=True)
    flow = (await session.execute(statement)).scalar_one_or_none()
    return _view(flow) if flow is not None else None


async def transition(
    session: AsyncSession,
    *,
    flow_id: str,
    principal: Principal,
    from_statuses: tuple[str, ...],
    to_status: str,
    only_unexpired: bool = True,
    event: str | None = None,
    actor: Actor | None = None,
    **values: object,
) -> bool:
    """Move the flow if (and only if) it is in one of `from_statuses`; True for the winner.

    With `event`, the winner also records it (in the same transaction), by `actor` (default: who
    speaks for the flow's audience, app/audit.py)."""
    now = utcnow()
    completed = {"completed_at": now} if to_status == FlowStatus.completed else {}
    statement = flows_table.transition(
        flow_id,
        principal,
        from_statuses=from_statuses,
        unexpired_at=now if only_unexpired else None,
        values={"status": to_status, "updated_at": now, **completed, **values},
    )
    if event is None:
        result = await session.execute(statement)
        return bool(getattr(result, "rowcount", 0))
    moved = statement.returning(Flow.provider, Flow.audience, Flow.account_label)
    row = (await session.execute(moved)).first()
    if row is None:
        return False
    await audit.record(
        session,
        event,
        actor=actor or Actor.for_audience(principal, row.audience),
        principal=principal,
        provider=row.provider,
        audience=row.audience,
        account_label=row.account_label,
    )
    return True


async def end_by_client(
    session: AsyncSession, *, flow_id: str, principal: Principal, status: str
) -> bool:
    """Declined or cancelled from the MCP client: ends an open flow."""
    return await transition(
        session,
        flow_id=flow_id,
        principal=principal,
        from_statuses=OPEN_FLOW_STATUSES,
        to_status=status,
        only_unexpired=False,
        event=f"flow.{status}",
        state_digest=None,
        sealed_pkce_verifier=None,
    )


async def mark_consumed(session: AsyncSession, *, flow_id: str, principal: Principal) -> None:
    """The client has received the final result (a later identical retry still gets it)."""
    await transition(
        session,
        flow_id=flow_id,
        principal=principal,
        from_statuses=(FlowStatus.completed,),
        to_status=FlowStatus.consumed,
        only_unexpired=False,
    )


async def purge(sessions: async_sessionmaker[AsyncSession]) -> tuple[int, int]:
    """Expire open flows past their expiry (dropping their secrets), delete old ones.

    In chunks of PURGE_CHUNK rows, each its own transaction: a backlog (a flood of flows, a
    sweeper that was down) never becomes one statement that outlasts the statement timeout and
    fails every minute, nor holds SQLite's write lock for seconds. Returns (expired, deleted).
    """
    now = utcnow()
    expired = await _expire_in_chunks(sessions, now)
    async with sessions.begin() as session:
        await session.execute(flows_table.release_exchanges(now, EXCHANGE_LEASE))
    is_old = flows_table.expired_before(now - PURGE_AFTER)
    deleted = await _in_chunks(sessions, flows_table.remove, is_old)
    return expired, deleted


async def _expire_in_chunks(sessions: async_sessionmaker[AsyncSession], now: datetime) -> int:
    """Expire the open flows past their expiry, PURGE_CHUNK at a time, each chunk with its
    `flow.expired` events in its transaction; flows expired."""
    chunk = flows_table.chunk(*flows_table.open_past_expiry(now), size=PURGE_CHUNK)
    statement = flows_table.expire(now)(chunk).execution_options(synchronize_session=False)
    total = 0
    while True:
        async with sessions.begin() as session:
            rows = (await session.execute(statement)).all()
            await audit.record_rows(
                session,
                [
                    audit.row(
                        "flow.expired",
                        actor=audit.BROKER,
                        principal=Principal(row.issuer, row.subject),
                        provider=row.provider,
                        audience=row.audience,
                    )
                    for row in rows
                ],
            )
        total += len(rows)
        if len(rows) < PURGE_CHUNK:
            return total


async def _in_chunks(
    sessions: async_sessionmaker[AsyncSession],
    statement: flows_table.ChunkStatement,
    condition: tuple[ColumnElement[bool], ...],
) -> int:
    """Run `statement` on the flows matching `condition`, PURGE_CHUNK at a time (each chunk its
    own transaction); rows changed."""
    chunk = flows_table.chunk(*condition, size=PURGE_CHUNK)
    total = 0
    while True:
        async with sessions.begin() as session:
            result = await session.execute(
                statement(chunk).execution_options(synchronize_session=False)
            )
        changed = int(getattr(result, "rowcount", 0))
        total += changed
        if changed < PURGE_CHUNK:
            return total
