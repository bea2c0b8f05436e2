"""Process logging (app/logsetup.py): every line arrives, in order, with one flush per loop turn."""

from __future__ import annotations

import asyncio
import io
import logging
import signal
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from app.logsetup import (
    LOG_FORMAT,
    LineFormatter,
    TurnFlushedHandler,
    buffered_stderr,
    sole_line_handler,
)

from .support.broker import BrokerConfig, running_broker


class CountingStream(io.StringIO):
    """Holds what was written; `flushed` is what had been flushed, at each flush."""

    def __init__(self) -> None:
        super().__init__()
        self.flushed: list[str] = []

    def flush(self) -> None:
        self.flushed.append(self.getvalue())


def make_logger(name: str) -> tuple[logging.Logger, CountingStream]:
    stream = CountingStream()
    handler = TurnFlushedHandler(stream)
    handler.setFormatter(logging.Formatter(LOG_FORMAT))
    logger = logging.getLogger(f"test.logsetup.{name}")
    logger.handlers = [handler]
    logger.setLevel(logging.INFO)
    logger.propagate = False
    return logger, stream


async def test_the_lines_of_one_loop_turn_are_flushed_together_at_its_end() -> None:
    logger, stream = make_logger("turn")

    for number in range(3):
        logger.info("line %d", number)
    assert stream.flushed == []  # nothing yet: the turn is not over

    await asyncio.sleep(0)
    assert len(stream.flushed) == 1
    assert [line.rsplit(" ", 1)[1] for line in stream.flushed[0].splitlines()] == ["0", "1", "2"]

    logger.info("next turn")
    await asyncio.sleep(0)
    assert len(stream.flushed) == 2
    assert stream.flushed[1].endswith("INFO test.logsetup.turn next turn\n")


async def test_a_warning_is_flushed_at_once_with_the_lines_before_it() -> None:
    logger, stream = make_logger("warning")

    logger.info("before")
    logger.warning("trouble")

    assert len(stream.flushed) == 1
    assert "before" in stream.flushed[0]
    assert stream.flushed[0].endswith("WARNING test.logsetup.warning trouble\n")


async def test_the_servers_own_lines_are_flushed_at_once_with_the_lines_before_them() -> None:
    """uvicorn raises the SIGTERM that stopped it again within the loop turn that logged its
    last lines: a flush at the end of that turn would never come."""
    stream = CountingStream()
    handler = TurnFlushedHandler(stream)
    handler.setFormatter(LineFormatter())
    server = logging.getLogger("uvicorn.error")
    before = (server.handlers, server.level, server.propagate)
    server.handlers, server.propagate = [handler], False
    server.setLevel(logging.INFO)
    try:
        handler.write_plain(logging.INFO, "broker.access", "GET /healthz 200")
        server.info("Application shutdown complete.")
    finally:
        server.handlers, server.propagate = before[0], before[2]
        server.setLevel(before[1])

    assert len(stream.flushed) == 1
    assert "GET /healthz 200" in stream.flushed[0]
    assert stream.flushed[0].endswith("INFO uvicorn.error Application shutdown complete.\n")


def test_serve_writes_its_last_lines_before_a_sigterm_ends_it(tmp_path: Path) -> None:
    config = BrokerConfig(issuer="http://127.0.0.1:1")
    with running_broker(config, tmp_path) as broker:
        broker.stop()

    last = broker.log().splitlines()[-2:]
    assert broker.process.returncode == -signal.SIGTERM  # uvicorn raised it again
    assert [line.split(" ", 2)[2] for line in last] == [
        "INFO uvicorn.error Application shutdown complete.",
        f"INFO uvicorn.error Finished server process [{broker.process.pid}]",
    ]


def test_outside_an_event_loop_every_line_is_flushed_at_once() -> None:
    logger, stream = make_logger("no-loop")

    logger.info("from a plain call")
    worker = threading.Thread(target=logger.info, args=("from a thread",))
    worker.start()
    worker.join()

    assert len(stream.flushed) == 2
    assert stream.flushed[-1].endswith("from a thread\n")


def test_stderr_without_a_descriptor_is_used_as_it_is(monkeypatch: pytest.MonkeyPatch) -> None:
    replaced = io.StringIO()  # what an embedding program may put in sys.stderr's place
    monkeypatch.setattr(sys, "stderr", replaced)
    assert buffered_stderr() is replaced


def test_stderr_with_a_descriptor_gets_a_buffer_of_its_own(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with (tmp_path / "stderr.txt").open("w") as file:
        monkeypatch.setattr(sys, "stderr", file)
        stream = buffered_stderr()
        assert stream is not file
        stream.write("one line\n")
        assert (tmp_path / "stderr.txt").read_text() == ""  # buffered, not yet written
        stream.flush()
        assert (tmp_path / "stderr.txt").read_text() == "one line\n"
        stream.close()


@pytest.mark.parametrize("created", [1_700_000_000.0, 1_700_000_000.999, 1_700_000_001.0005])
def test_line_formatter_writes_what_the_standard_formatter_writes(created: float) -> None:
    """LineFormatter only caches the timestamp's date and time: every line, including the ones
    after the second changes, reads exactly as `logging.Formatter(LOG_FORMAT)` writes it."""
    fast, standard = LineFormatter(), logging.Formatter(LOG_FORMAT)
    for moment in (created - 1, created, created + 0.0004, created + 1.5):
        record = logging.LogRecord("broker.x", logging.INFO, __file__, 1, "a %s", ("b",), None)
        record.created = moment
        record.msecs = (moment - int(moment)) * 1000

        assert fast.format(record) == standard.format(record)


def test_line_formatter_writes_exceptions_as_the_standard_formatter_does() -> None:
    fast, standard = LineFormatter(), logging.Formatter(LOG_FORMAT)
    try:
        raise ValueError("boom")
    except ValueError:
        exc_info = sys.exc_info()
    for stack in (None, "Stack (most recent call last):\n  here"):
        record = logging.LogRecord("broker.x", logging.ERROR, __file__, 1, "failed", (), exc_info)
        record.stack_info = stack

        assert fast.format(record) == standard.format(record)
        assert "ValueError: boom" in fast.format(record)


def line_logger(name: str) -> tuple[logging.Logger, TurnFlushedHandler, CountingStream]:
    """A logger set up as `configure_logging` sets up the root: one TurnFlushedHandler with a
    LineFormatter."""
    logger, stream = make_logger(name)
    (handler,) = logger.handlers
    assert isinstance(handler, TurnFlushedHandler)
    handler.setFormatter(LineFormatter())
    return logger, handler, stream


@pytest.mark.parametrize("created", [1_700_000_000.0, 1_700_000_000.9995, 1_700_000_001.0005])
async def test_a_plain_line_reads_as_the_record_would(
    created: float, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`write_plain` skips the record, not anything the line shows: timestamp (milliseconds
    truncated as LogRecord truncates them), level, logger name, message."""
    logger, handler, stream = line_logger("plain")
    monkeypatch.setattr(time, "time", lambda: created)
    monkeypatch.setattr(time, "time_ns", lambda: int(created * 1e9))  # LogRecord on 3.12+

    logger.info("GET /x 200 1.0ms rid=1")
    handler.write_plain(logging.INFO, logger.name, "GET /x 200 1.0ms rid=1")
    await asyncio.sleep(0)

    through_record, plain = stream.getvalue().splitlines()
    assert plain == through_record
    assert len(stream.flushed) == 1  # the plain line waited for the end of the turn too


def test_a_plain_warning_is_flushed_at_once() -> None:
    logger, handler, stream = line_logger("plain-warning")

    handler.write_plain(logging.WARNING, logger.name, "trouble")

    assert len(stream.flushed) == 1
    assert stream.flushed[0].endswith("WARNING test.logsetup.plain-warning trouble\n")


def test_the_sole_line_handler_is_found_only_where_nothing_else_would_see_the_record() -> None:
    logger, handler, _stream = line_logger("sole")
    child = logging.getLogger(f"{logger.name}.child")  # propagates to `logger`
    assert sole_line_handler(child, logging.INFO) is handler
    assert sole_line_handler(logger, logging.INFO) is handler

    def keep(_record: logging.LogRecord) -> bool:
        return True

    changes: list[tuple[Callable[[], object], Callable[[], object]]] = [
        (lambda: child.addFilter(keep), lambda: child.removeFilter(keep)),
        (lambda: handler.addFilter(keep), lambda: handler.removeFilter(keep)),
        (lambda: handler.setLevel(logging.WARNING), lambda: handler.setLevel(logging.NOTSET)),
        (lambda: logger.setLevel(logging.WARNING), lambda: logger.setLevel(logging.INFO)),
        (
            lambda: handler.setFormatter(logging.Formatter(LOG_FORMAT)),
            lambda: handler.setFormatter(LineFormatter()),
        ),
    ]
    second = logging.StreamHandler(io.StringIO())
    changes += [
        (lambda: child.addHandler(second), lambda: child.removeHandler(second)),
        (lambda: logger.addHandler(second), lambda: logger.removeHandler(second)),
    ]
    for change, undo in changes:
        change()
        assert sole_line_handler(child, logging.INFO) is None
        undo()
        assert sole_line_handler(child, logging.INFO) is handler

    child.propagate = False  # the record never reaches `logger`'s handler
    assert sole_line_handler(child, logging.INFO) is None
