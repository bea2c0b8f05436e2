"""The operator commands' filter arguments (app/cli_filters.py): refused with a message naming
them, before anything reaches the database, rather than failing in a statement."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from app import cli
from app.cli_filters import BadArgument, since


@pytest.mark.parametrize(
    "value",
    ["999999d", "0001-01-01T00:00:00+05:00", "9999-12-31T23:00:00-05:00"],
    ids=["duration", "before-year-1-in-utc", "after-year-9999-in-utc"],
)
def test_a_since_outside_the_calendar_is_refused(value: str) -> None:
    with pytest.raises(BadArgument, match="too far back") as refused:
        since(value)

    assert refused.value.argument == "--since"


def test_a_since_with_an_offset_is_read_in_utc() -> None:
    assert since("2026-12-01T09:00:00+01:00") == datetime(2026, 12, 1, 8, tzinfo=UTC)
    assert since("2026-12-01T08:00:00") == datetime(2026, 12, 1, 8, tzinfo=UTC)


def test_service_revoke_refuses_a_name_no_statement_could_take(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A name from a non-UTF-8 argument (surrogates) is a usage error, before the database."""
    code = cli.main(["--config", "/dev/null", "service", "revoke", "\udcff\udcfe"])

    assert code == 2
    assert capsys.readouterr().err == (
        "connect-broker service revoke: error: argument name: must not hold an unpaired "
        "surrogate (\\ud800-\\udfff)\n"
    )
