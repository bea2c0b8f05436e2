"""LoopBatcher (app/direct/batching.py): the calls of one loop turn are handled together."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence

import pytest

from app.direct.batching import LoopBatcher


class Recorder:
    """A batch handler that doubles numbers, fails on negative ones, and records its batches."""

    def __init__(self) -> None:
        self.batches: list[list[int]] = []
        self.release = asyncio.Event()
        self.release.set()

    async def handle(self, items: list[int]) -> Sequence[int | Exception]:
        self.batches.append(list(items))
        await self.release.wait()
        return [ValueError(item) if item < 0 else item * 2 for item in items]


async def turns_until(condition: Callable[[], bool], most: int = 20) -> None:
    """Let the event loop run until `condition` holds (a few turns at most)."""
    for _ in range(most):
        if condition():
            return
        await asyncio.sleep(0)
    raise AssertionError("the condition did not come true")


async def test_calls_of_one_loop_turn_are_one_batch_and_each_gets_its_own_result() -> None:
    recorder = Recorder()
    batcher = LoopBatcher(recorder.handle)

    results = await asyncio.gather(*(batcher.submit(item) for item in range(5)))

    assert results == [0, 2, 4, 6, 8]
    assert recorder.batches == [[0, 1, 2, 3, 4]]


async def test_calls_of_later_turns_make_later_batches_while_earlier_ones_run() -> None:
    recorder = Recorder()
    recorder.release.clear()  # the first batch stays in flight
    batcher = LoopBatcher(recorder.handle)

    first = asyncio.gather(batcher.submit(1), batcher.submit(2))
    await turns_until(lambda: len(recorder.batches) == 1)
    second = asyncio.gather(batcher.submit(3))
    await turns_until(lambda: len(recorder.batches) == 2)
    assert recorder.batches == [[1, 2], [3]]  # the second did not wait for the first to finish

    recorder.release.set()
    assert list(await first) == [2, 4]
    assert list(await second) == [6]


async def test_a_failed_item_fails_alone() -> None:
    batcher = LoopBatcher(Recorder().handle)

    results = await asyncio.gather(
        batcher.submit(1), batcher.submit(-1), batcher.submit(3), return_exceptions=True
    )

    assert results[0] == 2
    assert isinstance(results[1], ValueError)
    assert results[2] == 6


async def test_a_shared_failure_fails_every_call_of_its_batch_at_once_and_no_later_one() -> None:
    batches: list[list[int]] = []

    async def handle(items: list[int]) -> Sequence[int]:
        batches.append(list(items))
        if len(batches) == 1:
            raise ConnectionError("database gone")
        return items

    batcher = LoopBatcher(handle, shared_failures=(ConnectionError,))
    results = await asyncio.gather(batcher.submit(1), batcher.submit(2), return_exceptions=True)

    assert [type(result) for result in results] == [ConnectionError, ConnectionError]
    assert batches == [[1, 2]]  # no item was tried again alone
    assert await batcher.submit(3) == 3


async def test_a_batch_refused_for_one_item_s_value_fails_that_item_alone() -> None:
    """Like one statement for the whole batch: one bad value makes the database refuse it all."""
    batches: list[list[int]] = []

    async def handle(items: list[int]) -> Sequence[int]:
        batches.append(list(items))
        if any(item < 0 for item in items):
            raise ValueError("a value the database refuses")
        return [item * 2 for item in items]

    batcher = LoopBatcher(handle, shared_failures=(ConnectionError,))
    results = await asyncio.gather(
        batcher.submit(1), batcher.submit(-1), batcher.submit(3), return_exceptions=True
    )

    assert results[0] == 2
    assert isinstance(results[1], ValueError)
    assert results[2] == 6
    assert batches == [[1, -1, 3], [1], [-1], [3]]


async def test_a_lone_item_that_fails_is_not_tried_twice() -> None:
    batches: list[list[int]] = []

    async def handle(items: list[int]) -> Sequence[int]:
        batches.append(list(items))
        raise ValueError("refused")

    with pytest.raises(ValueError, match="refused"):
        await LoopBatcher(handle).submit(1)
    assert batches == [[1]]


async def test_a_handler_answering_the_wrong_number_of_items_fails_the_batch_not_hangs() -> None:
    async def handle(items: list[int]) -> Sequence[int]:
        return items[:-1]

    batcher = LoopBatcher(handle)
    results = await asyncio.wait_for(
        asyncio.gather(batcher.submit(1), batcher.submit(2), return_exceptions=True), timeout=5
    )

    assert all(isinstance(result, RuntimeError) for result in results)


async def test_a_cancelled_caller_does_not_disturb_the_others() -> None:
    recorder = Recorder()
    recorder.release.clear()
    batcher = LoopBatcher(recorder.handle)

    cancelled = asyncio.ensure_future(batcher.submit(1))
    kept = asyncio.ensure_future(batcher.submit(2))
    await turns_until(lambda: len(recorder.batches) == 1)
    cancelled.cancel()
    recorder.release.set()

    assert await kept == 4
    with pytest.raises(asyncio.CancelledError):
        await cancelled
    assert recorder.batches == [[1, 2]]
