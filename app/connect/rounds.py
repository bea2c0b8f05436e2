"""The client's answer to a connect round, decided once for every surface.

A retry brings the client's `action` for the URL elicitation (accept, decline, cancel, or none).
`/mcp` and the integration API each translate the `RoundOutcome` to their own wire format; what
the outcome is lives only here. In particular, when the user finished in the browser before the
client's decline or cancel arrived, the flow is done and the outcome says so on both surfaces:
the connection exists, and the client gets it.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from app.auth.principal import Principal
from app.connect import service as flows
from app.connect.context import RoundContext
from app.connect.require import url_declared
from app.connect.service import FlowRead, FlowView
from app.connect.wait import wait_for_flow
from app.errors import DATABASE_ERRORS
from app.models import FlowStatus

logger = logging.getLogger("broker")

ACTIONS = ("accept", "decline", "cancel")
Action = Literal["accept", "decline", "cancel"]
ENDED_STATUSES = (FlowStatus.declined, FlowStatus.cancelled, FlowStatus.failed)


@dataclass(frozen=True, slots=True)
class RoundOutcome:
    """Exactly one of: `done` (the flow completed: its read, with the connection), `open` (still
    waiting for the browser: elicit the same URL again), `needs_url_capability` (still open, but
    this request does not declare URL-mode elicitation, so the URL cannot be asked again), or
    `ended` (declined, cancelled, failed or expired; `flow` is None when no flow is found for
    the caller any more)."""

    done: FlowRead | None = None
    open: FlowView | None = None
    needs_url_capability: bool = False
    ended: str | None = None
    flow: FlowView | None = None


async def resume_round(
    context: RoundContext,
    *,
    flow_id: str,
    principal: Principal,
    action: Action | None,
    capabilities: Mapping[str, Any],
) -> RoundOutcome:
    """Settle the client's answer for flow `flow_id`: a decline or cancel ends a flow that is
    still open; an accept waits (bounded) for the browser side; no answer only looks.

    `capabilities` are this request's: a client that no longer declares URL-mode elicitation
    gets a done or ended flow's outcome, but is not waited for nor asked the URL again.
    """
    if action in ("decline", "cancel"):
        status = FlowStatus.declined if action == "decline" else FlowStatus.cancelled
        async with context.sessionmaker.begin() as session:
            await flows.end_by_client(session, flow_id=flow_id, principal=principal, status=status)
        read = await flows.read_for(context.store, flow_id=flow_id, principal=principal)
        if read is not None and read.flow.is_done:
            return RoundOutcome(done=read)  # the browser won the race: the user did connect
        return RoundOutcome(ended=status, flow=read.flow if read else None)
    can_ask = url_declared(capabilities)
    wait = context.settings.server.retry_wait_seconds if action == "accept" and can_ask else 0
    read = await wait_for_flow(context.store, context.notifier, flow_id, principal, wait)
    if read is None:
        return RoundOutcome(ended=FlowStatus.expired)
    if read.flow.is_done:
        return RoundOutcome(done=read)
    if read.flow.is_open:
        return RoundOutcome(open=read.flow) if can_ask else RoundOutcome(needs_url_capability=True)
    outcome = read.flow.outcome
    return RoundOutcome(
        ended=outcome if outcome in ENDED_STATUSES else FlowStatus.expired, flow=read.flow
    )


async def mark_delivered(context: RoundContext, read: FlowRead) -> None:
    """The client has its final answer for a done flow: a completed flow becomes consumed (a later
    identical retry still gets the answer; consumed already: no write).

    Bookkeeping only: the answer is decided and the connection stored, so a write the database
    cannot take now (SQLite's one writer, when hundreds of flows finish at once) leaves the flow
    completed, which answers the same, rather than fail the client's request.
    """
    if read.flow.status != FlowStatus.completed:
        return
    try:
        async with context.sessionmaker.begin() as session:
            await flows.mark_consumed(session, flow_id=read.flow.id, principal=read.flow.principal)
    except DATABASE_ERRORS as exc:
        logger.warning("flow.consume_deferred error=%s", type(exc).__name__)
