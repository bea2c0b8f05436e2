"""The benchmark's result table and its targets."""

from __future__ import annotations

from dataclasses import dataclass

from bench.wrk import WrkResult

TARGET_RATIO = 0.35
TARGET_P99_MS = 20.0
HEADER = (
    "scenario",
    "db",
    "req/s",
    "p50 ms",
    "p99 ms",
    "ratio vs bare",
    "non-2xx",
    "cpu ms/req",
    "target",
)


@dataclass(frozen=True)
class Measurement:
    """One measured wrk run and the server CPU time it cost (None where /proc is missing)."""

    wrk: WrkResult
    cpu_ms_per_request: float | None


@dataclass(frozen=True)
class Row:
    scenario: str
    db: str
    measured: Measurement
    bare: Measurement | None = None  # None: this row is the bare reference itself
    targeted: bool = True

    @property
    def ratio(self) -> float:
        return self.measured.wrk.rps / self.bare.wrk.rps if self.bare else 1.0

    @property
    def verdict(self) -> str:
        if self.bare is None:
            return "-"
        misses = [
            name
            for name, ok in (
                ("ratio", self.ratio >= TARGET_RATIO),
                ("p99", self.measured.wrk.p99_ms <= TARGET_P99_MS),
            )
            if not ok
        ]
        verdict = f"MISS ({', '.join(misses)})" if misses else "PASS"
        return verdict if self.targeted else f"[{verdict}]"

    @property
    def clean(self) -> bool:
        """No non-2xx, socket error or unexpected body (e.g. the open-flow cap's isError)."""
        result = self.measured.wrk
        return not (result.non_2xx or result.socket_errors or result.unexpected)

    def cells(self) -> tuple[str, ...]:
        result = self.measured.wrk
        errors = str(result.non_2xx)
        if result.socket_errors:
            errors += f" (+{result.socket_errors} socket errors)"
        cpu = self.measured.cpu_ms_per_request
        return (
            self.scenario,
            self.db,
            f"{result.rps:.0f}",
            f"{result.p50_ms:.2f}",
            f"{result.p99_ms:.2f}",
            f"{self.ratio:.2f}x",
            errors,
            "-" if cpu is None else f"{cpu:.2f}",
            self.verdict,
        )


def table(rows: list[Row]) -> str:
    lines = [HEADER, *(row.cells() for row in rows)]
    widths = [max(len(line[i]) for line in lines) for i in range(len(HEADER))]
    text = [_line(lines[0], widths), "-+-".join("-" * width for width in widths)]
    text += [_line(line, widths) for line in lines[1:]]
    text.append(
        f"targets (round1, retry): ratio >= {TARGET_RATIO}x and p99 <= {TARGET_P99_MS:.0f} ms; "
        "[bracketed]: informational only (round1-fresh is the worst case, not a target)"
    )
    return "\n".join(text)


def _line(cells: tuple[str, ...], widths: list[int]) -> str:
    """Names left-aligned, numbers right-aligned."""
    padded = (
        cell.ljust(width) if index < 2 else cell.rjust(width)
        for index, (cell, width) in enumerate(zip(cells, widths, strict=True))
    )
    return " | ".join(padded).rstrip()
