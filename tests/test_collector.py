"""The cyclic collector as the serving process runs it (app/collector.py)."""

from __future__ import annotations

import asyncio
import gc
from collections.abc import Iterator
from pathlib import Path

import pytest

from app import collector
from app.config import load_settings
from app.main import create_app
from app.migrate import upgrade

from .test_config import VALID, write

SERVING_THRESHOLDS = (
    collector.YOUNG_GENERATION_THRESHOLD,
    collector.MIDDLE_GENERATION_THRESHOLD,
    collector.OLD_GENERATION_THRESHOLD,
)


@pytest.fixture
def restored_collector() -> Iterator[None]:
    """This test process's own collector settings, put back afterwards."""
    thresholds = gc.get_threshold()
    yield
    gc.set_threshold(*thresholds)
    gc.unfreeze()


def test_settling_freezes_the_start_up_heap_and_raises_the_young_threshold(
    restored_collector: None,
) -> None:
    gc.unfreeze()
    gc.set_threshold(700, 10, 10)
    start_up_objects = [[index] for index in range(1000)]

    collector.settle_for_serving()

    assert gc.get_threshold() == SERVING_THRESHOLDS
    assert gc.get_freeze_count() >= len(start_up_objects)
    assert collector.YOUNG_GENERATION_THRESHOLD > 700  # the reason for the module


async def test_the_app_settles_the_collector_when_it_starts_serving(
    tmp_path: Path, restored_collector: None
) -> None:
    database = f"sqlite:///{tmp_path / 'broker.db'}"
    await asyncio.to_thread(upgrade, database)  # it runs its own event loop
    settings = load_settings(write(tmp_path, VALID), overrides={"database": {"url": database}})
    app = create_app(settings)
    gc.set_threshold(700, 10, 10)

    async with app.router.lifespan_context(app):
        assert gc.get_threshold() == SERVING_THRESHOLDS
