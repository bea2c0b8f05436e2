"""Posting lifecycle events to the configured webhooks, from the audit events themselves.

The outbox is `audit_events`: each event is written in the transaction of the change it records,
so the request paths write nothing more for webhooks (docs/adr/0007-webhooks-from-audit-events.md).
Each webhook has a row in `webhook_deliveries` with a cursor: the last event it was given (or that
was given up). The loop here reads the events after the cursor, in order, and posts them one at a
time; the cursor moves past an event only once its receiver answered 2xx, in the transaction that
records it, so each event is posted at least once, and in order.

Order and gaps: on PostgreSQL the sequence hands out ids at insert, and transactions commit in any
order, so an event with a smaller id can become visible after a larger one. Events are therefore
read in (writing transaction id, id) order, and only those written by a transaction older than any
still running (`app/tables/audit.py: settled_after`): nothing that commits later can sort before
them, so the cursor never passes an event still to come. On SQLite one writer at a time holds the
database, and ids (AUTOINCREMENT, never reused) follow commit order.

A failing head event blocks its webhook's later events: it is retried after FIRST_RETRY_SECONDS,
doubling up to MAX_RETRY_SECONDS, until GIVE_UP_AFTER from when it occurred; then it is given up
(a `webhook.abandoned` log line and a metric) and the webhook goes on. Across replicas, the
process that moves `next_attempt_at` ahead in one conditional UPDATE (`claim`) posts; every later
change is conditional on the cursor it claimed at, so a process whose claim ran out changes nothing.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import Mapping
from datetime import datetime, timedelta

import httpx2
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from app.bug_report import redacted_traceback
from app.clock import doubling_delay, utcnow
from app.errors import DATABASE_ERRORS
from app.metrics import BrokerMetrics
from app.models import AuditEvent, WebhookDelivery
from app.tables import audit as audit_table
from app.tables import webhooks as webhooks_table
from app.tables.audit import Position
from app.webhooks import signing
from app.webhooks.settings import WebhookSettings

logger = logging.getLogger("broker.webhooks")

POLL_SECONDS = 1.0  # how often each process looks for new events
PAUSE_SECONDS = 30.0  # after the database failed to answer
FIRST_RETRY_SECONDS = 10
MAX_RETRY_SECONDS = 1800
GIVE_UP_AFTER = timedelta(hours=24)
TIMEOUT_SECONDS = 5.0  # one post, from connecting to the answer's status line
# Longer than one post and its statements; renewed with each event delivered.
CLAIM_SECONDS = 30
BATCH = 50  # events read, and posted one after the other, per claim
EXPIRED = "expired"  # the event was older than GIVE_UP_AFTER before its post


def retry_delay(attempts: int) -> timedelta:
    """How long after the `attempts`-th failed post the next one is due."""
    return doubling_delay(attempts, first=FIRST_RETRY_SECONDS, cap=MAX_RETRY_SECONDS)


def position_of(event: AuditEvent) -> Position:
    return (event.txid or 0, event.id)


class Webhooks:
    """Delivers the events after each configured webhook's cursor, in order, at least once."""

    def __init__(
        self,
        *,
        webhooks: Mapping[str, WebhookSettings],
        sessionmaker: async_sessionmaker[AsyncSession],
        http: httpx2.AsyncClient,
        metrics: BrokerMetrics,
        postgres: bool,
    ) -> None:
        self._webhooks = dict(webhooks)
        self._sessionmaker = sessionmaker
        self._http = http
        self._metrics = metrics
        self._postgres = postgres

    @property
    def configured(self) -> bool:
        return bool(self._webhooks)

    async def start(self) -> None:
        """Give each new webhook its row, its cursor at the newest settled event: a webhook
        receives the events from when it is first served, not the history before."""
        names = tuple(self._webhooks)
        try:
            async with self._sessionmaker.begin() as session:
                rows = await session.execute(webhooks_table.states(names))
                missing = sorted(set(names) - {state.webhook for state in rows.scalars()})
                if not missing:
                    return
                newest = (
                    await session.execute(audit_table.newest_settled(postgres=self._postgres))
                ).first()
                position = (int(newest[0] or 0), int(newest[1])) if newest else (0, 0)
                for name in missing:
                    await session.execute(webhooks_table.start(name, position, utcnow()))
        except IntegrityError:
            return  # another process started one at the same moment: the next poll looks again
        for name in missing:
            logger.info("webhook.started webhook=%s", name)

    async def run_once(self) -> int:
        """Post what is due to every webhook: how many events were delivered. A webhook
        without its row yet gets it (`start`), and its events from the next call on."""
        names = tuple(self._webhooks)
        async with self._sessionmaker() as session:
            states = list((await session.execute(webhooks_table.states(names))).scalars())
        if len(states) < len(names):
            await self.start()
        outcomes = await asyncio.gather(
            *(self._run_webhook(state) for state in states if state.webhook in self._webhooks),
            return_exceptions=True,
        )
        for outcome in outcomes:
            if isinstance(outcome, BaseException):
                raise outcome  # the others have finished: none is left running unobserved
        return sum(outcome for outcome in outcomes if isinstance(outcome, int))

    async def backlog(self, session: AsyncSession) -> dict[str, int]:
        """Per webhook, the events waiting for it (for /metrics)."""
        waiting: dict[str, int] = {}
        rows = await session.execute(webhooks_table.states(tuple(self._webhooks)))
        for state in list(rows.scalars()):
            count = await session.scalar(
                audit_table.count_after(
                    (state.after_txid, state.after_id),
                    events=self._webhooks[state.webhook].event_filter,
                    postgres=self._postgres,
                )
            )
            waiting[state.webhook] = int(count or 0)
        return waiting

    async def forever(self) -> None:
        """The delivery loop of one process (app/main.py starts it when webhooks are set)."""
        while True:
            pause = POLL_SECONDS
            try:
                await self.run_once()
            except DATABASE_ERRORS as exc:
                logger.warning("webhook.poll_failed error=%s", type(exc).__name__)
                pause = PAUSE_SECONDS
            except Exception as exc:  # a bug: logged, and the deliveries go on after a pause
                logger.error(
                    "webhook.loop_failed error=%s\n%s", type(exc).__name__, redacted_traceback(exc)
                )
                pause = PAUSE_SECONDS
            await asyncio.sleep(pause)

    async def _run_webhook(self, state: WebhookDelivery) -> int:
        now = utcnow()
        if state.next_attempt_at > now:
            return 0
        name, settings = state.webhook, self._webhooks[state.webhook]
        position = (state.after_txid, state.after_id)
        async with self._sessionmaker() as session:
            statement = audit_table.settled_after(
                position, events=settings.event_filter, limit=BATCH, postgres=self._postgres
            )
            events = list((await session.execute(statement)).scalars())
        if not events:
            return 0
        async with self._sessionmaker.begin() as session:
            until = now + timedelta(seconds=CLAIM_SECONDS)
            claim = webhooks_table.claim(name, position, now, until)
            claimed = (await session.execute(claim)).scalar_one_or_none()
        if claimed is None:
            return 0  # another process has it, or moved it on
        attempts = claimed.attempts if claimed.head_id == events[0].id else 0
        expired = list(itertools.takewhile(lambda e: e.occurred_at + GIVE_UP_AFTER <= now, events))
        if expired:
            done = len(expired) == len(events)
            if not await self._advance(name, position, expired[-1], now, last=done):
                return 0
            self._abandoned(name, expired, attempts if len(expired) == 1 else 0, EXPIRED)
            position, attempts, events = position_of(expired[-1]), 0, events[len(expired) :]
        delivered = 0
        for index, event in enumerate(events):
            last = index == len(events) - 1
            moved = await self._deliver_one(name, settings, position, event, attempts, last=last)
            if moved is None:
                return delivered  # retried later, or the claim was lost
            delivered += moved
            position, attempts = position_of(event), 0
        return delivered

    async def _deliver_one(
        self,
        name: str,
        settings: WebhookSettings,
        position: Position,
        event: AuditEvent,
        attempts: int,
        *,
        last: bool,
    ) -> int | None:
        """Post the head event: 1 if delivered, 0 if given up (the cursor moved past it either
        way), None if it waits for a retry or this process lost the webhook. An event is posted
        until GIVE_UP_AFTER from when it occurred: one older is given up without a post, and
        so is a failed one whose next retry would fall later."""
        deadline = event.occurred_at + GIVE_UP_AFTER
        failure = EXPIRED if utcnow() >= deadline else await self._post(settings, event)
        now = utcnow()
        if failure is None:
            if not await self._advance(name, position, event, now, last=last):
                return None
            self._metrics.webhook_delivery(name, "ok")
            return 1
        if failure != EXPIRED:
            attempts += 1
            self._metrics.webhook_delivery(name, "failed")
            retry_at = now + retry_delay(attempts)
            if retry_at < deadline:
                await self._retry_later(name, position, event, attempts, failure, retry_at)
                return None
        if not await self._advance(name, position, event, now, last=last):
            return None
        self._abandoned(name, [event], attempts, failure)
        return 0

    def _abandoned(self, name: str, events: list[AuditEvent], attempts: int, error: str) -> None:
        """Count and log events given up: one line for a run of them (after a long outage, a
        webhook can find thousands of events past their 24 hours)."""
        self._metrics.webhook_abandoned(name, len(events))
        first = events[0]
        run = f" through_event_id={events[-1].id} count={len(events)}" if len(events) > 1 else ""
        logger.warning(
            "webhook.abandoned webhook=%s event_id=%d event=%s attempts=%d error=%s%s",
            name,
            first.id,
            first.event,
            attempts,
            error,
            run,
        )

    async def _retry_later(
        self,
        name: str,
        position: Position,
        event: AuditEvent,
        attempts: int,
        failure: str,
        at: datetime,
    ) -> None:
        async with self._sessionmaker.begin() as session:
            await session.execute(
                webhooks_table.retry_later(
                    name, position, head_id=event.id, attempts=attempts, error=failure, at=at
                )
            )
        logger.warning(
            "webhook.delivery_failed webhook=%s event_id=%d event=%s attempts=%d error=%s "
            "retry_in=%ds",
            name,
            event.id,
            event.event,
            attempts,
            failure,
            round((at - utcnow()).total_seconds()),
        )

    async def _advance(
        self, name: str, position: Position, event: AuditEvent, now: datetime, *, last: bool
    ) -> bool:
        """Move the cursor past `event`, keeping the claim unless it is the last one read."""
        hold = now if last else now + timedelta(seconds=CLAIM_SECONDS)
        async with self._sessionmaker.begin() as session:
            result = await session.execute(
                webhooks_table.advance(name, position, position_of(event), hold)
            )
        return int(getattr(result, "rowcount", 0)) == 1

    async def _post(self, settings: WebhookSettings, event: AuditEvent) -> str | None:
        """Post `event`: None once the receiver answered 2xx, else why not (an HTTP status or
        an exception class; never the URL). The answer's body is not read, redirects are not
        followed."""
        content = signing.body(event)
        secret = settings.secret.get_secret_value()
        try:
            async with (
                asyncio.timeout(TIMEOUT_SECONDS),
                self._http.stream(
                    "POST",
                    settings.url,
                    content=content,
                    headers=signing.headers(event, secret, content, utcnow()),
                    timeout=TIMEOUT_SECONDS,
                    follow_redirects=False,
                ) as response,
            ):
                status = response.status_code
        except (httpx2.HTTPError, httpx2.InvalidURL, TimeoutError) as exc:
            return type(exc).__name__
        return None if 200 <= status < 300 else f"http_{status}"
