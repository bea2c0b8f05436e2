"""The benchmark's table: verdicts against the targets, the CPU ratio beside them, and the notes
on a slow reference and on pairs of runs that disagree."""

from __future__ import annotations

from bench.report import CREDENTIAL_TARGET, MCP_TARGET, Measurement, Row, table
from bench.wrk import WrkResult


def measured(rps: float, p99_ms: float, cpu_ms: float | None = 0.1) -> Measurement:
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
    return Measurement(result, cpu_ms_per_request=cpu_ms)


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


def columns(printed: str, scenario: str) -> list[str]:
    header = printed.splitlines()[0].split(" | ")
    row = next(line for line in printed.splitlines() if line.startswith(scenario + " "))
    return [cell.strip() for cell in row.split(" | ")][: len(header)]


def test_the_cpu_ratio_is_the_references_cpu_per_response_over_the_brokers() -> None:
    bare = measured(10_000, 5.0, cpu_ms=0.1)
    row = Row("credential", "sqlite", measured(3_000, 9.0, cpu_ms=0.4), bare=bare, ratios=(0.3,))
    unknown = Row("retry", "sqlite", measured(3_000, 9.0, cpu_ms=None), bare=bare, ratios=(0.3,))

    printed = table([row, unknown, Row("bare (credential GET)", "sqlite", bare)])

    header = [cell.strip() for cell in printed.splitlines()[0].split(" | ")]
    at = header.index("cpu ratio")
    assert row.cpu_ratio == 0.25
    assert columns(printed, "credential")[at] == "0.25x"
    assert columns(printed, "retry")[at] == "-"
    assert columns(printed, "bare (credential GET)")[at] == "-"
    assert row.verdict == "MISS (ratio)"  # the verdict stays on the throughput ratio


def test_pairs_of_runs_that_disagree_are_named_and_the_verdict_stands() -> None:
    bare = measured(10_000, 5.0)
    noisy = Row("round1", "postgresql", measured(3_000, 12.0), bare=bare, ratios=(0.21, 0.62, 0.4))
    steady = Row("retry", "postgresql", measured(3_000, 12.0), bare=bare, ratios=(0.3, 0.44))
    fresh = Row("round1-fresh", "postgresql", measured(900, 30.0), bare=bare, targeted=False)

    notes = [line for line in table([noisy, steady, fresh]).splitlines() if "pairs" in line]

    assert notes == [
        "NOTE: [postgresql] round1: its pairs of runs gave 0.21x to 0.62x, so the machine's other"
        " load changed under the run and the ratio is not a measurement here; the cpu ratio and"
        " `python -m bench.instructions` hold up under load"
    ]
    assert noisy.verdict == "PASS"  # the median passes: the note is what warns
