"""Every statement on `webhook_deliveries`: one row per configured webhook, its cursor in the
audit events (app/tables/audit.py, `settled_after`) and the state of the event at its head.

Each change is conditional on the cursor the caller read: a process that lost its claim (its
lease ran out and another process took the webhook) changes nothing, and learns it from the row
count.
"""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import ColumnElement, Insert, Select, Update, insert, select, update
from sqlalchemy.sql.dml import ReturningUpdate

from app.models import WebhookDelivery
from app.tables.audit import Position


def states(names: tuple[str, ...]) -> Select[WebhookDelivery]:
    return select(WebhookDelivery).where(WebhookDelivery.webhook.in_(names))


def start(name: str, position: Position, now: datetime) -> Insert:
    """A new webhook's row: its cursor at `position` (the events before it are not posted)."""
    return insert(WebhookDelivery).values(
        webhook=name,
        after_txid=position[0],
        after_id=position[1],
        attempts=0,
        next_attempt_at=now,
        created_at=now,
    )


def _at(name: str, position: Position) -> tuple[ColumnElement[bool], ...]:
    return (
        WebhookDelivery.webhook == name,
        WebhookDelivery.after_txid == position[0],
        WebhookDelivery.after_id == position[1],
    )


def claim(
    name: str, position: Position, now: datetime, until: datetime
) -> ReturningUpdate[WebhookDelivery]:
    """Take the webhook until `until`, if it is due and still at `position`."""
    return (
        update(WebhookDelivery)
        .where(*_at(name, position), WebhookDelivery.next_attempt_at <= now)
        .values(next_attempt_at=until)
        .returning(WebhookDelivery)
        .execution_options(synchronize_session=False)
    )


def advance(name: str, position: Position, to: Position, hold_until: datetime) -> Update:
    """Move the cursor from `position` past the head event (delivered or given up)."""
    return (
        update(WebhookDelivery)
        .where(*_at(name, position))
        .values(
            after_txid=to[0],
            after_id=to[1],
            head_id=None,
            attempts=0,
            last_error=None,
            next_attempt_at=hold_until,
        )
        .execution_options(synchronize_session=False)
    )


def retry_later(
    name: str, position: Position, *, head_id: int, attempts: int, error: str, at: datetime
) -> Update:
    """The head event failed again: try it at `at`."""
    return (
        update(WebhookDelivery)
        .where(*_at(name, position))
        .values(head_id=head_id, attempts=attempts, last_error=error[:64], next_attempt_at=at)
        .execution_options(synchronize_session=False)
    )
