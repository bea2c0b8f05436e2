"""This process's clock against PostgreSQL's (app/clock_skew.py): measured by the housekeeping,
shown as `broker_clock_skew_seconds`, logged as `clock.skew` past SKEW_WARN_SECONDS."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import time_machine
from sqlalchemy.ext.asyncio import AsyncEngine

from app import clock_skew
from app.db import create_engine
from app.metrics import BrokerMetrics

from .support.broker import PG_ADMIN, database_kind
from .support.http import local_client
from .support.stack import Stack, running_stack
from .test_metrics import SCRAPE_TOKEN, scrape

pytestmark = pytest.mark.both_databases  # the broker measures on PostgreSQL only

GAUGE = "broker_clock_skew_seconds"


@pytest.fixture
async def postgres() -> AsyncIterator[AsyncEngine]:
    """PostgreSQL, whichever database the run's brokers use: the measure only reads its clock."""
    engine = create_engine(PG_ADMIN)
    yield engine
    await engine.dispose()


@pytest.fixture(scope="module")
def stack(workdir: Path) -> Iterator[Stack]:
    extra = {"server": {"metrics_token": SCRAPE_TOKEN}}
    with running_stack(workdir, "clock", extra=extra) as running:
        yield running


def skew_records(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith("clock.skew")]


async def test_clocks_in_step_measure_near_zero_and_log_nothing(
    postgres: AsyncEngine, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="broker")

    skew = await clock_skew.check(postgres)

    assert abs(skew) < 1  # one machine, one clock: the round trip's error only
    assert skew_records(caplog) == []


@pytest.mark.parametrize(("shift", "shown"), [(60, "+60"), (-60, "-60")])
async def test_a_clock_a_minute_off_is_measured_and_logged(
    postgres: AsyncEngine, caplog: pytest.LogCaptureFixture, shift: int, shown: str
) -> None:
    caplog.set_level(logging.WARNING, logger="broker")

    with time_machine.travel(time.time() + shift, tick=True):
        skew = await clock_skew.check(postgres)

    assert shift - 1 < skew < shift + 1
    (message,) = skew_records(caplog)
    assert message.startswith(f"clock.skew seconds={shown}.")
    assert "synchronise them (NTP)" in message


async def test_a_clock_just_inside_the_bound_is_not_logged(
    postgres: AsyncEngine, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="broker")
    inside = clock_skew.SKEW_WARN_SECONDS - 2

    with time_machine.travel(time.time() + inside, tick=True):
        skew = await clock_skew.check(postgres)

    assert inside - 1 < skew < inside + 1
    assert skew_records(caplog) == []


def test_the_gauge_is_left_out_while_the_skew_is_unknown() -> None:
    metrics = BrokerMetrics()
    unknown = metrics.render(None).decode()
    metrics.clock_skew_seconds = -2.5

    assert GAUGE not in unknown
    assert f"{GAUGE} -2.5\n" in metrics.render(None).decode()


async def test_the_housekeeping_shows_the_skew_on_postgresql_only(stack: Stack) -> None:
    """The housekeeping's first round runs as the broker starts."""
    found: float | None = None
    async with local_client(timeout=10) as http:
        for _ in range(50):
            _, samples = await scrape(http, stack.broker)
            found = samples.get((GAUGE, frozenset()))
            if found is not None or database_kind() == "sqlite":
                break
            await asyncio.sleep(0.1)

    if database_kind() == "postgresql":
        assert found is not None and abs(found) < 1
    else:
        assert found is None  # one machine's processes share its clock
