"""Calls made during one turn of the event loop, handled together.

Under load many requests reach the same statement in the same turn of the event loop. Sending
them as one statement (one pool checkout, one round trip, one commit) costs the process a
fraction of sending each alone; a request waits at most until the end of the current turn.

A batch must not let one request's bad value fail the others. When the handler raises for a batch
of several items, the batcher cannot tell whose item caused it (PostgreSQL refuses a whole
statement for one NUL; SQLite cannot bind one lone surrogate), so it hands each item to the handler
again, alone: each then gets its own answer. Failures that are nobody's item (the database is
gone) are declared by the caller as `shared_failures` and fail the batch at once, without retries.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from typing import Generic, TypeVar

Item = TypeVar("Item")
Result = TypeVar("Result")

# Handles a batch: one outcome per item, in order; an exception as an outcome fails that item
# alone, an exception raised fails every item of the batch.
BatchHandler = Callable[[list[Item]], Awaitable[Sequence[Result | Exception]]]


class LoopBatcher(Generic[Item, Result]):
    """`await batcher.submit(item)`: the items submitted in one loop turn go to the handler
    together, at the start of the next turn. Batches run concurrently with each other.

    A cancelled caller leaves its item in the batch; its outcome is dropped.
    """

    def __init__(
        self,
        handle: BatchHandler[Item, Result],
        *,
        shared_failures: tuple[type[Exception], ...] = (),
    ) -> None:
        self._handle = handle
        self._shared_failures = shared_failures
        self._pending: list[tuple[Item, asyncio.Future[Result]]] = []
        self._running: set[asyncio.Task[None]] = set()

    def submit(self, item: Item) -> asyncio.Future[Result]:
        """The future of `item`'s outcome (awaited by the caller itself: no coroutine of its own
        between the caller and the batch)."""
        loop = asyncio.get_running_loop()
        if not self._pending:
            loop.call_soon(self._start)
        done: asyncio.Future[Result] = loop.create_future()
        self._pending.append((item, done))
        return done

    def _start(self) -> None:
        batch, self._pending = self._pending, []
        task = asyncio.get_running_loop().create_task(self._run(batch))
        self._running.add(task)  # the loop keeps only a weak reference to a task
        task.add_done_callback(self._running.discard)

    async def _run(self, batch: list[tuple[Item, asyncio.Future[Result]]]) -> None:
        items = [item for item, _ in batch]
        outcomes = await self._outcomes(items)
        shared = isinstance(outcomes, self._shared_failures)
        if len(items) > 1 and isinstance(outcomes, Exception) and not shared:
            outcomes = [await self._alone(item) for item in items]
        if isinstance(outcomes, Exception):
            outcomes = [outcomes] * len(items)
        for (_, done), outcome in zip(batch, outcomes, strict=True):
            if done.done():
                continue  # the caller was cancelled meanwhile
            if isinstance(outcome, Exception):
                done.set_exception(outcome)
            else:
                done.set_result(outcome)

    async def _outcomes(self, items: list[Item]) -> Sequence[Result | Exception] | Exception:
        """One outcome per item, or the exception that failed the whole call."""
        try:
            outcomes = await self._handle(items)
        except Exception as exc:
            return exc
        if len(outcomes) != len(items):  # a bug in the handler: fail the batch, never hang it
            return RuntimeError(f"{len(outcomes)} outcomes for a batch of {len(items)}")
        return outcomes

    async def _alone(self, item: Item) -> Result | Exception:
        outcomes = await self._outcomes([item])
        return outcomes if isinstance(outcomes, Exception) else outcomes[0]
