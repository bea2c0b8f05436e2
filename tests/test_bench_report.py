"""The benchmark's table: verdicts against the targets, and the note on a slow reference."""

from __future__ import annotations

from bench.report import CREDENTIAL_TARGET, MCP_TARGET, Measurement, Row, table
from bench.wrk import WrkResult


def measured(rps: float, p99_ms: float) -> Measurement:
    result = WrkResult(
        requests=1000,
        rps=rps,
        p50_ms=p99_ms / 2,
        p99_ms=p99_ms,
        non_2xx=0,
        socket_errors=0,
        issued=1000,
        unexpected=0,
        pool=1,
    )
    return Measurement(result, cpu_ms_per_request=0.1)


def test_verdicts_follow_ratio_and_p99() -> None:
    bare = measured(10_000, 5.0)
    passing = Row("retry", "sqlite", measured(4_000, 12.0), bare=bare, ratios=(0.40, 0.41))
    slow = Row("round1", "sqlite", measured(3_000, 12.0), bare=bare, ratios=(0.30, 0.31))
    late = Row(
        "credential",
        "sqlite",
        measured(5_000, 11.0),
        bare=bare,
        target=CREDENTIAL_TARGET,
        ratios=(0.5, 0.5),
    )

    assert (passing.verdict, slow.verdict, late.verdict) == ("PASS", "MISS (ratio)", "MISS (p99)")
    assert "NOTE" not in table([passing, slow, late])


def test_a_reference_over_the_p99_bound_is_named_and_the_verdict_stands() -> None:
    slow_machine = measured(5_000, 17.0)  # bare itself over the credential bound (10 ms)
    row = Row(
        "credential",
        "postgresql",
        measured(2_500, 24.0),
        bare=slow_machine,
        target=CREDENTIAL_TARGET,
        ratios=(0.5,),
    )
    fine = Row("retry", "postgresql", measured(2_500, 19.0), bare=slow_machine, target=MCP_TARGET)

    printed = table([row, fine, Row("bare", "postgresql", slow_machine)])

    assert row.verdict == "MISS (p99)"
    notes = [line for line in printed.splitlines() if line.startswith("NOTE")]
    assert notes == [
        "NOTE: [postgresql] the bare reference for credential has p99 17.00 ms, over the 10 ms"
        " bound itself: this machine cannot show that bound"
    ]
