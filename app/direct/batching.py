"""Calls made during one turn of the event loop, handled together.

Under load many requests reach the same statement in the same turn of the event loop. Sending
them as one statement (one pool checkout, one round trip, one commit) costs the process a
fraction of sending each alone; a request waits at most until the end of the current turn.
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

    def __init__(self, handle: BatchHandler[Item, Result]) -> None:
        self._handle = handle
        self._pending: list[tuple[Item, asyncio.Future[Result]]] = []
        self._running: set[asyncio.Task[None]] = set()

    async def submit(self, item: Item) -> Result:
        loop = asyncio.get_running_loop()
        if not self._pending:
            loop.call_soon(self._start)
        done: asyncio.Future[Result] = loop.create_future()
        self._pending.append((item, done))
        return await done

    def _start(self) -> None:
        batch, self._pending = self._pending, []
        task = asyncio.get_running_loop().create_task(self._run(batch))
        self._running.add(task)  # the loop keeps only a weak reference to a task
        task.add_done_callback(self._running.discard)

    async def _run(self, batch: list[tuple[Item, asyncio.Future[Result]]]) -> None:
        try:
            outcomes = await self._handle([item for item, _ in batch])
        except Exception as exc:
            outcomes = [exc] * len(batch)
        if len(outcomes) != len(batch):  # a bug in the handler: fail the batch, never hang it
            error = RuntimeError(f"{len(outcomes)} outcomes for a batch of {len(batch)}")
            outcomes = [error] * len(batch)
        for (_, done), outcome in zip(batch, outcomes, strict=True):
            if done.done():
                continue  # the caller was cancelled meanwhile
            if isinstance(outcome, Exception):
                done.set_exception(outcome)
            else:
                done.set_result(outcome)
