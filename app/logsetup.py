"""Process logging for `serve` and `dev`: one line per record on stderr.

Every request writes an access line, so a log line must cost little next to the request itself.
Two costs dominated it, and both are gone:

- A write(2) per line. Lines go to a buffered stream on stderr's descriptor, flushed once per
  event-loop turn (every line of that turn in one write), at once outside a running loop, at once
  for WARNING and above, and at once for the server's own lines (`AT_ONCE_LOGGERS`).
  `logging.shutdown` flushes what is left at a normal exit; a SIGTERM or SIGINT is not one:
  uvicorn raises the signal again once it has shut down, and the process ends within the loop
  turn that logged "Application shutdown complete." and "Finished server process".
- Thread and process names, which the format never shows (`logging.logThreads` and the like).
  The caller lookup (a stack walk) stays: logging offers no public switch for it, and no hot
  path writes a record (the access line skips it, below).

`LineFormatter` also reuses the timestamp text within a second: `localtime` and `strftime` cost
more than the rest of a line.

The access line (app/middleware.py) can skip the record altogether: when the handler installed here
is the only one the line would reach, and no filter is on its way (`sole_line_handler`), the
handler writes the line the record would have become (`write_plain`). Building the record and
passing it down the logger and handler chain cost a seventh of the credential fetch's own
instructions. Anything an operator adds (a handler, a filter, another formatter) sends the line
the standard way again.
"""

from __future__ import annotations

import asyncio
import io
import logging
import os
import sys
import time
from typing import TextIO, cast

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s %(message)s"
BUFFER_BYTES = 64 * 1024
# uvicorn's start and stop lines: a few per process, the last ones written just before it
# re-raises the signal that stopped it, too late for a flush at the end of the loop turn
AT_ONCE_LOGGERS = frozenset({"uvicorn.error"})


class TurnFlushedHandler(logging.StreamHandler[TextIO]):
    """A stream handler that flushes at the end of the current event-loop turn."""

    def __init__(self, stream: TextIO) -> None:
        super().__init__(stream)
        self._flush_pending = False

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.stream.write(self.format(record) + self.terminator)
        except RecursionError:
            raise
        except Exception:
            self.handleError(record)
            return
        self._flush_for(record.levelno, record.name)

    def write_plain(self, level: int, name: str, message: str) -> None:
        """Write what `emit` writes for a plain record (no arguments, exception or stack) of
        logger `name` at `level`, without building the record. Only for a handler
        `sole_line_handler` returned, i.e. one formatting with LineFormatter."""
        formatter = cast(LineFormatter, self.formatter)
        line = formatter.plain_line(time.time(), logging.getLevelName(level), name, message)
        self.acquire()
        try:
            self.stream.write(line + self.terminator)
        except RecursionError:
            raise
        except Exception:
            self.handleError(logging.LogRecord(name, level, "", 0, message, None, None))
            return
        finally:
            self.release()
        self._flush_for(level, name)

    def _flush_for(self, level: int, name: str) -> None:
        """WARNING and above, and the server's own lines, at once; the rest at the end of the
        loop turn."""
        if level >= logging.WARNING or name in AT_ONCE_LOGGERS:
            self.flush()
        else:
            self._flush_soon()

    def _flush_soon(self) -> None:
        if self._flush_pending:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # no loop in this thread: nothing would flush later
            self.flush()
            return
        self._flush_pending = True
        loop.call_soon(self._flush_turn)

    def _flush_turn(self) -> None:
        self._flush_pending = False
        self.flush()


class LineFormatter(logging.Formatter):
    """`LOG_FORMAT`, with the date and time part of the timestamp computed once per second, and
    plain records formatted without the `%`-style machinery."""

    def __init__(self) -> None:
        super().__init__(LOG_FORMAT)
        self._second: tuple[int, str] = (-1, "")  # replaced whole, so threads never mix parts

    def format(self, record: logging.LogRecord) -> str:
        """`LOG_FORMAT` spelled out for the plain record (no exception or stack to append); the
        rest goes the standard way."""
        if record.exc_info or record.exc_text or record.stack_info:
            return super().format(record)
        record.message = record.getMessage()
        record.asctime = self.formatTime(record)
        return f"{record.asctime} {record.levelname} {record.name} {record.message}"

    def plain_line(self, created: float, levelname: str, name: str, message: str) -> str:
        """The line `format` makes of a plain record created at `created` (time.time())."""
        msecs = int((created - int(created)) * 1000)  # truncated, as LogRecord does
        return f"{self._timestamp(created, msecs)} {levelname} {name} {message}"

    def formatTime(self, record: logging.LogRecord, datefmt: str | None = None) -> str:
        if datefmt is not None:
            return super().formatTime(record, datefmt)
        return self._timestamp(record.created, int(record.msecs))

    def _timestamp(self, created: float, msecs: int) -> str:
        second = int(created)
        cached_second, text = self._second
        if second != cached_second:
            text = time.strftime(self.default_time_format, self.converter(created))
            self._second = (second, text)
        return f"{text},{msecs:03d}"


def sole_line_handler(logger: logging.Logger, level: int) -> TurnFlushedHandler | None:
    """The handler a record of `logger` at `level` would be written by, if it is the only one,
    a TurnFlushedHandler formatting with LineFormatter, and no filter is on the record's way;
    else None, and the record must go through `logger`. Checked on every call: the logging
    configuration may change while the process runs."""
    if logger.filters or not logger.isEnabledFor(level):
        return None
    found: TurnFlushedHandler | None = None
    current: logging.Logger | None = logger
    while current is not None:
        for handler in current.handlers:
            if (
                found is not None
                or type(handler) is not TurnFlushedHandler
                or type(handler.formatter) is not LineFormatter
                or handler.filters
                or level < handler.level
            ):
                return None
            found = handler
        current = current.parent if current.propagate else None
    return found


def buffered_stderr() -> TextIO:
    """stderr's descriptor behind a block buffer (Python line-buffers `sys.stderr` itself), or
    `sys.stderr` as it is when it has no descriptor (replaced by an embedding program)."""
    try:
        descriptor = os.dup(sys.stderr.fileno())
    except (AttributeError, OSError, ValueError):  # io.UnsupportedOperation is both of the last
        return sys.stderr
    return io.TextIOWrapper(
        io.BufferedWriter(io.FileIO(descriptor, "w"), BUFFER_BYTES),
        encoding="utf-8",
        errors="backslashreplace",
    )


def configure_logging(stream: TextIO | None = None, *, json: bool = False) -> None:
    """INFO and above, one line each, to `stream` (default: stderr); with `json`, each line a
    JSON object (app/logjson.py)."""
    from app.logjson import JsonFormatter

    logging.logThreads = False
    logging.logProcesses = False
    logging.logMultiprocessing = False
    handler = TurnFlushedHandler(stream if stream is not None else buffered_stderr())
    handler.setFormatter(JsonFormatter() if json else LineFormatter())
    logging.basicConfig(level=logging.INFO, handlers=[handler])
