"""wait_for_flow, the retry's bounded wait, against a scripted store: which reads it makes, when it
subscribes, and that no completion is missed between its first read and its subscription; and
the notifier's periodic check of every waited-for flow, against a scripted check."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from collections.abc import Iterator
from datetime import timedelta
from typing import cast

import pytest

from app.auth.principal import Principal
from app.clock import utcnow
from app.connect.notify import FlowNotifier
from app.connect.service import FlowView
from app.connect.wait import wait_for_flow
from app.direct import DirectStore
from app.direct.records import ConnectionRecord, FlowRecord
from app.models import FlowStatus

ALICE = Principal("https://idp.example", "alice")
OPEN = FlowRecord(
    id="flow-1",
    issuer=ALICE.issuer,
    subject=ALICE.subject,
    client_id="client",
    client_name=None,
    audience="mcp",
    provider="demo",
    scopes="",
    status=FlowStatus.pending,
    account_label=None,
    failure=None,
    expires_at=utcnow() + timedelta(days=1),  # set at import: valid however late the test runs
)
DONE = dataclasses.replace(OPEN, status=FlowStatus.completed, account_label="demo key")
SLOW_POLL = 5.0  # seconds: a wait that relied on polling would show in the elapsed time


class ScriptedStore:
    """Answers `get_flow_and_connection` from a list (flows, no connection), the last answer
    repeating; counts the reads."""

    def __init__(self, *answers: FlowRecord) -> None:
        self.answers = list(answers)
        self.reads = 0

    async def get_flow_and_connection(
        self, flow_id: str
    ) -> tuple[FlowRecord, ConnectionRecord | None] | None:
        answer = self.answers[min(self.reads, len(self.answers) - 1)]
        self.reads += 1
        return (answer, None) if answer.id == flow_id else None


class CountingNotifier(FlowNotifier):
    def __init__(self) -> None:
        super().__init__(poll_interval=SLOW_POLL)
        self.subscriptions = 0

    @contextlib.contextmanager
    def subscribe(self, flow_id: str) -> Iterator[asyncio.Event]:
        self.subscriptions += 1
        with super().subscribe(flow_id) as event:
            yield event


async def timed_wait(
    store: ScriptedStore, notifier: FlowNotifier, seconds: float
) -> tuple[FlowView | None, float]:
    loop = asyncio.get_running_loop()
    started = loop.time()
    read = await wait_for_flow(cast(DirectStore, store), notifier, "flow-1", ALICE, seconds)
    return (read.flow if read is not None else None), loop.time() - started


async def test_a_finished_flow_is_answered_from_one_read_without_subscribing() -> None:
    store, notifier = ScriptedStore(DONE), CountingNotifier()
    flow, _ = await timed_wait(store, notifier, 20)
    assert flow is not None and flow.status == FlowStatus.completed
    assert (store.reads, notifier.subscriptions) == (1, 0)


async def test_a_completion_between_the_first_read_and_the_subscription_is_not_missed() -> None:
    store, notifier = ScriptedStore(OPEN, DONE), CountingNotifier()  # no wake-up ever comes
    flow, elapsed = await timed_wait(store, notifier, 20)
    assert flow is not None and flow.status == FlowStatus.completed
    assert elapsed < SLOW_POLL / 2, "found only by polling, not by the read after subscribing"
    assert (store.reads, notifier.subscriptions) == (2, 1)


async def test_an_open_flow_is_returned_when_its_completion_wakes_the_wait() -> None:
    store, notifier = ScriptedStore(OPEN), CountingNotifier()

    async def complete_later() -> None:
        await asyncio.sleep(0.05)
        store.answers = [DONE]
        notifier.wake("flow-1")

    completer = asyncio.create_task(complete_later())
    flow, elapsed = await timed_wait(store, notifier, 20)
    await completer
    assert flow is not None and flow.status == FlowStatus.completed
    assert elapsed < SLOW_POLL / 2


async def test_without_a_wait_an_open_flow_is_returned_as_it_stands() -> None:
    store, notifier = ScriptedStore(OPEN), CountingNotifier()
    flow, _ = await timed_wait(store, notifier, 0)
    assert flow is not None and flow.status == FlowStatus.pending
    assert (store.reads, notifier.subscriptions) == (1, 0)


POLL = 0.05  # seconds between the notifier's checks in the tests below


class ScriptedCheck:
    """`still_open` answering from a list of answers (a set of open ids, or an exception to
    raise), the last repeating; records the ids of each call."""

    def __init__(self, *answers: set[str] | Exception) -> None:
        self.answers = list(answers)
        self.calls: list[list[str]] = []

    async def __call__(self, flow_ids: list[str]) -> set[str]:
        answer = self.answers[min(len(self.calls), len(self.answers) - 1)]
        self.calls.append(sorted(flow_ids))
        if isinstance(answer, Exception):
            raise answer
        return answer


async def test_one_check_covers_every_waited_flow_and_wakes_those_no_longer_open() -> None:
    check = ScriptedCheck({"still-open"})
    notifier = FlowNotifier(poll_interval=POLL, still_open=check)
    await notifier.start()
    try:
        with notifier.subscribe("ended") as ended, notifier.subscribe("still-open") as waiting:
            await asyncio.wait_for(ended.wait(), 2)
            assert not waiting.is_set()
        assert check.calls[0] == ["ended", "still-open"]  # both in one call
        calls = len(check.calls)
        await asyncio.sleep(POLL * 4)
        assert len(check.calls) == calls, "checked with no flow waited for"
    finally:
        await notifier.stop()


async def test_failed_checks_leave_the_waiters_waiting_are_logged_once_and_the_next_wakes(
    caplog: pytest.LogCaptureFixture,
) -> None:
    check = ScriptedCheck(TimeoutError(), TimeoutError(), TimeoutError(), set())
    notifier = FlowNotifier(poll_interval=POLL, still_open=check)
    await notifier.start()
    try:
        with (
            caplog.at_level(logging.INFO, "broker.flows"),
            notifier.subscribe("flow-1") as changed,
        ):
            await asyncio.wait_for(changed.wait(), 2)
    finally:
        await notifier.stop()
    assert len(check.calls) == 4
    messages = [record.getMessage() for record in caplog.records]
    assert messages == ["flows.check_failed error=TimeoutError", "flows.check_recovered"]


async def test_a_wait_ended_by_the_check_returns_the_flow_as_read_again() -> None:
    store = ScriptedStore(OPEN, OPEN, DONE)  # open at the first two reads, done at the third
    notifier = FlowNotifier(poll_interval=POLL, still_open=ScriptedCheck(set()))
    await notifier.start()
    try:
        flow, elapsed = await timed_wait(store, notifier, 20)
    finally:
        await notifier.stop()
    assert flow is not None and flow.status == FlowStatus.completed
    assert elapsed < 2
    assert store.reads == 3
