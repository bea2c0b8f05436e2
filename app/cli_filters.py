"""The operator commands' filter arguments, checked before anything reaches the database: a
user (issuer and subject together), a provider name, a point in time (`--since`)."""

from __future__ import annotations

import re
from datetime import UTC, datetime, timedelta

from app.clock import utcnow
from app.storable import unstorable_reason

DURATION = re.compile(r"(\d{1,6})([smhd])")
UNITS = {"s": "seconds", "m": "minutes", "h": "hours", "d": "days"}
MAX_TEXT = 255


class BadArgument(ValueError):
    """An argument the command refuses; `argument` names it, the message says why."""

    def __init__(self, argument: str, message: str) -> None:
        super().__init__(message)
        self.argument = argument


def since(value: str | None) -> datetime | None:
    """`--since`: an ISO-8601 time (UTC when no offset is given) or a duration back from now
    (`30m`, `12h`, `7d`)."""
    if value is None:
        return None
    text = value.strip()
    try:
        if found := DURATION.fullmatch(text):
            return utcnow() - timedelta(**{UNITS[found[2]]: int(found[1])})
        moment = datetime.fromisoformat(text)
        # in UTC, as stored: a time whose UTC is out of the calendar (year 1 east of Greenwich)
        # overflows here, not in the statement
        return (moment if moment.tzinfo else moment.replace(tzinfo=UTC)).astimezone(UTC)
    except OverflowError:
        raise BadArgument("--since", f"{value!r:.80} is too far back (or ahead)") from None
    except ValueError:
        raise BadArgument(
            "--since",
            f"{value!r:.80} is neither an ISO-8601 time (2026-12-01T08:00:00Z) nor a duration "
            "(30m, 12h, 7d)",
        ) from None


def text(argument: str, value: str | None) -> str | None:
    """A name compared with stored text: at most MAX_TEXT characters the database can hold."""
    if value is None:
        return None
    if not value or len(value) > MAX_TEXT:
        raise BadArgument(argument, f"must be 1 to {MAX_TEXT} characters")
    reason = unstorable_reason(value)
    if reason:
        raise BadArgument(argument, f"must not hold {reason}")
    return value


def user(issuer: str | None, subject: str | None) -> tuple[str, str] | None:
    """`--issuer` and `--subject`: both, or neither."""
    if (issuer is None) != (subject is None):
        raise BadArgument(
            "--issuer/--subject", "name a user with both --issuer and --subject, or neither"
        )
    if issuer is None or subject is None:
        return None
    return text("--issuer", issuer) or "", text("--subject", subject) or ""
