"""The one place the service reads the time, so tests can move it (time-machine)."""

from datetime import UTC, datetime, timedelta


def utcnow() -> datetime:
    return datetime.now(UTC)


def doubling_delay(attempts: int, *, first: int, cap: int) -> timedelta:
    """The wait after the `attempts`-th failure of a retried task: `first` seconds, doubling
    with each failure, at most `cap`."""
    return timedelta(seconds=min(first * 2 ** (attempts - 1), cap))
