"""Process logging for `serve` and `dev`: one line per record on stderr.

Every request writes an access line, so a log line must cost little next to the request itself.
Two costs dominated it, and both are gone:

- A write(2) per line. Lines go to a buffered stream on stderr's descriptor, flushed once per
  event-loop turn (every line of that turn in one write), at once outside a running loop, and at
  once for WARNING and above. `logging.shutdown` flushes what is left at exit.
- Caller lookup (a stack walk) and thread/process names, which the format never shows.

`LineFormatter` also reuses the timestamp text within a second: `localtime` and `strftime` cost
more than the rest of a line.
"""

from __future__ import annotations

import asyncio
import io
import logging
import os
import sys
import time
from typing import TextIO

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s %(message)s"
BUFFER_BYTES = 64 * 1024


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
        if record.levelno >= logging.WARNING:
            self.flush()
            return
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

    def formatTime(self, record: logging.LogRecord, datefmt: str | None = None) -> str:
        if datefmt is not None:
            return super().formatTime(record, datefmt)
        second = int(record.created)
        cached_second, text = self._second
        if second != cached_second:
            text = time.strftime(self.default_time_format, self.converter(record.created))
            self._second = (second, text)
        return f"{text},{int(record.msecs):03d}"


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


def configure_logging(stream: TextIO | None = None) -> None:
    """INFO and above, one line each, to `stream` (default: stderr)."""
    logging.logThreads = False
    logging.logProcesses = False
    logging.logMultiprocessing = False
    logging._srcfile = None  # no caller lookup: the format shows no file, line or function
    handler = TurnFlushedHandler(stream if stream is not None else buffered_stderr())
    handler.setFormatter(LineFormatter())
    logging.basicConfig(level=logging.INFO, handlers=[handler])
