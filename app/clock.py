"""The one place the service reads the time, so tests can move it (time-machine)."""

from datetime import UTC, datetime


def utcnow() -> datetime:
    return datetime.now(UTC)
