"""Running wrk with bench/mcp.lua (or bench/credential.lua) and reading its report."""

from __future__ import annotations

import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

LUA_SCRIPT = Path(__file__).resolve().parent / "mcp.lua"
GET_SCRIPT = Path(__file__).resolve().parent / "credential.lua"
EXTRA_TIMEOUT = 60  # seconds wrk may take beyond --duration before it is killed
UNIT_MS = {"us": 0.001, "ms": 1.0, "s": 1000.0}
SOCKET_ERRORS = re.compile(r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)")


class WrkError(RuntimeError):
    """wrk is missing, failed, or printed a report we cannot read."""


@dataclass(frozen=True)
class WrkResult:
    requests: int
    rps: float
    p50_ms: float
    p99_ms: float
    non_2xx: int
    socket_errors: int
    issued: int
    unexpected: int
    pool: int


def require_wrk() -> str:
    """The wrk executable. Raises WrkError with an install hint when it is missing."""
    path = shutil.which("wrk")
    if path is None:
        raise WrkError("wrk is not installed: `apt-get install wrk` (Debian package wrk)")
    return path


def run_wrk(
    url: str,
    pool_file: Path,
    expect: str,
    *,
    duration: int,
    connections: int,
    prefix: tuple[str, ...] = (),
    script: Path = LUA_SCRIPT,
    pause_ms: int = 0,
) -> WrkResult:
    """One wrk run (1 thread) against `url` with the requests of `pool_file`, sent by `script`.

    `pause_ms` (bench/mcp.lua only): each connection waits that long after an answer, which caps
    the rate at `connections * 1000 / pause_ms` requests a second."""
    command = [
        *prefix,
        require_wrk(),
        "-t1",
        f"-c{connections}",
        f"-d{duration}s",
        "--latency",
        "-s",
        str(script),
        url,
        "--",
        str(pool_file),
        expect,
        *([str(pause_ms)] if pause_ms else []),
    ]
    try:
        done = subprocess.run(
            command, capture_output=True, text=True, timeout=duration + EXTRA_TIMEOUT, check=False
        )
    except subprocess.TimeoutExpired:
        raise WrkError(f"wrk did not finish within {duration + EXTRA_TIMEOUT}s") from None
    if done.returncode != 0:
        raise WrkError(f"wrk exited with {done.returncode}: {done.stderr or done.stdout}")
    return parse_report(done.stdout)


def parse_report(text: str) -> WrkResult:
    """The figures of a `wrk --latency` report plus the BENCH line printed by the Lua script."""
    sockets = SOCKET_ERRORS.search(text)
    non_2xx = re.search(r"Non-2xx or 3xx responses: (\d+)", text)
    bench = _search(r"^BENCH issued=(\d+) unexpected=(\d+) pool=(\d+)$", text)
    return WrkResult(
        requests=int(_search(r"^\s*(\d+) requests in ", text).group(1)),
        rps=float(_search(r"^Requests/sec:\s+([\d.]+)", text).group(1)),
        p50_ms=_percentile(text, "50"),
        p99_ms=_percentile(text, "99"),
        non_2xx=int(non_2xx.group(1)) if non_2xx else 0,
        socket_errors=sum(int(n) for n in sockets.groups()) if sockets else 0,
        issued=int(bench.group(1)),
        unexpected=int(bench.group(2)),
        pool=int(bench.group(3)),
    )


def _percentile(text: str, percent: str) -> float:
    match = _search(rf"^\s+{percent}%\s+([\d.]+)(us|ms|s)\s*$", text)
    return float(match.group(1)) * UNIT_MS[match.group(2)]


def _search(pattern: str, text: str) -> re.Match[str]:
    match = re.search(pattern, text, re.MULTILINE)
    if match is None:
        raise WrkError(f"unexpected wrk output (no match for {pattern!r}):\n{text}")
    return match
