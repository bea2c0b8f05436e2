"""The broker's hot paths at scale: a large database, and thousands of retries waiting at once.

    python -m bench.scale [--scenario large,waiting] [--flows 1000000] [--connection-rows 100000]
                          [--waiters 5000] [--db sqlite,postgresql] [bench.run's options]

large    round1, retry and credential (as bench/run.py measures them, in broker/bare pairs) on a
         fresh database; then --flows flow rows and --connection-rows connections of other users
         are added (bench/seed.py) and the same requests are measured again. The figure is
         large/small: each scenario's ratio to the bare reference on the large database over its
         ratio on the small one (target >= 0.9). On PostgreSQL the seeded tables are ANALYZEd,
         as autovacuum would do after such an insert; on SQLite nothing is (the broker never
         runs ANALYZE, so the planner sees what a real deployment's would).
waiting  --waiters users each start a connect round; then all of them retry at once, accepting,
         and wait on their still-pending flows (server.retry_wait_seconds, set to --wait).
         A tenth of the flows are completed while they wait: those retries must answer with the
         result, the rest with the same elicitation once the wait runs out; any other answer,
         HTTP error or broken connection counts as an error (target: none). The broker's
         resident memory (VmRSS, sampled every 50 ms) is reported before, at its peak, and after
         (target: peak <= 300 MB). The broker runs with server.max_connections above --waiters:
         its default (900) would refuse the rest, which is the point of that limit.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from bench.pool import (
    PoolError,
    RetryPreparation,
    StartedRound,
    call_body,
    complete_flows,
    headers,
    start_rounds,
)
from bench.rawpost import RawPostError, Target, post, request_bytes
from bench.run import argument_parser, checked, prepared_bench
from bench.scenarios import Bench, Block, Paired, Server
from bench.seed import seed
from bench.stack import StackError, config_file, fresh_database, running_broker
from bench.wrk import WrkError, require_wrk

LARGE_TARGET = 0.9  # large-database ratio over small-database ratio
RSS_TARGET_MB = 300
SAMPLE_SECONDS = 0.05
COMPLETED_SHARE = 10  # one flow in this many is completed while its retry waits
COMPLETE_AFTER = 0.4  # ... this share of the wait after the retries start


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argument_parser("python -m bench.scale", __doc__)
    parser.add_argument("--scenario", default="large,waiting", help="large and/or waiting")
    parser.add_argument("--flows", type=int, default=1_000_000, help="flow rows to add")
    parser.add_argument(
        "--connection-rows", type=int, default=100_000, help="connection rows to add"
    )
    parser.add_argument("--waiters", type=int, default=5000, help="retries waiting at once")
    parser.add_argument("--wait", type=float, default=15, help="the broker's retry_wait_seconds")
    parser.set_defaults(duration=5, repeat=2)
    args = checked(parser, parser.parse_args(argv))
    args.scenario = [name.strip() for name in args.scenario.split(",") if name.strip()]
    if not args.scenario or set(args.scenario) - {"large", "waiting"}:
        parser.error(f"--scenario takes large and/or waiting, not {args.scenario}")
    if min(args.flows, args.connection_rows, args.waiters) < 1 or args.wait <= 0:
        parser.error("--flows, --connection-rows, --waiters and --wait must be positive")
    return args


# -- large database ---------------------------------------------------------------------------


@dataclass(frozen=True)
class LargeRow:
    scenario: str
    db: str
    small: Paired
    large: Paired

    def small_ratio(self) -> float:
        return statistics.median(self.small.ratios)

    def large_ratio(self) -> float:
        return statistics.median(self.large.ratios)

    def line(self) -> str:
        share = self.large_ratio() / self.small_ratio() if self.small_ratio() else 0.0
        verdict = "ok" if share >= LARGE_TARGET else "BELOW TARGET"
        return (
            f"{self.scenario:<11} {self.db:<11} {self.small_ratio():>6.2f}x"
            f" {self.small.broker.wrk.p99_ms:>8.2f} {self.large_ratio():>6.2f}x"
            f" {self.large.broker.wrk.p99_ms:>8.2f} {share:>6.2f}  >= {LARGE_TARGET} {verdict}"
        )

    @property
    def clean(self) -> bool:
        runs = (self.small.broker.wrk, self.large.broker.wrk)
        return all(run.requests and not (run.non_2xx or run.unexpected) for run in runs)


def large_database(bench: Bench, kind: str, args: argparse.Namespace) -> list[LargeRow]:
    print(f"large database on {kind} ...", flush=True)
    name = f"broker-large-{kind}"
    with (
        fresh_database(kind, bench.workdir) as url,
        running_broker(bench.config, url, bench.workdir, name=name, pin=bench.pin) as process,
    ):
        broker = Server(bench.config.mcp_url, process.pid)
        block = Block(bench, kind, url, broker, config_file(bench.workdir, name))
        prepared = {
            "round1": block.prepare_round1(),
            "retry": block.prepare_retry(),
            "credential": block.prepare_credential(),
        }
        small = {scenario: block.measure(p) for scenario, p in prepared.items()}
        started = time.monotonic()
        issuer = bench.minter.issuer
        asyncio.run(seed(url, issuer=issuer, flows=args.flows, connections=args.connection_rows))
        print(
            f"  added {args.flows:,} flows and {args.connection_rows:,} connections"
            f" in {time.monotonic() - started:.1f} s",
            flush=True,
        )
        large = {scenario: block.measure(p) for scenario, p in prepared.items()}
    return [LargeRow(scenario, kind, small[scenario], large[scenario]) for scenario in prepared]


# -- waiting retries --------------------------------------------------------------------------


class RssSampler:
    """The resident memory of a process, sampled on a thread: the first sample and the peak."""

    def __init__(self, pid: int) -> None:
        self._path = Path(f"/proc/{pid}/status")
        self.first_mb = self.peak_mb = self.now_mb()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def now_mb(self) -> float:
        for line in self._path.read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
        raise StackError(f"no VmRSS in {self._path}")

    def _sample(self) -> None:
        while not self._stop.wait(SAMPLE_SECONDS):
            self.peak_mb = max(self.peak_mb, self.now_mb())

    def __enter__(self) -> RssSampler:
        self._thread.start()
        return self

    def __exit__(self, *_exc: object) -> None:
        self._stop.set()
        self._thread.join()


@dataclass
class WaitingResult:
    db: str
    waiters: int
    completed: int  # flows completed while their retries waited
    answered_complete: int = 0
    answered_open: int = 0
    errors: int = 0
    first_error: str = ""
    rss_before_mb: float = 0.0
    rss_peak_mb: float = 0.0
    rss_after_mb: float = 0.0
    seconds: float = 0.0
    all_sent_s: float = 0.0  # from the first retry sent to the last one written
    wake_ms: tuple[float, ...] = ()  # completed flows: from the completion to the answer

    @property
    def clean(self) -> bool:
        return (
            not self.errors
            and self.answered_complete == self.completed
            and self.answered_open == self.waiters - self.completed
        )

    def lines(self) -> list[str]:
        wake = sorted(self.wake_ms) or [0.0]
        verdict = "ok" if self.clean and self.rss_peak_mb <= RSS_TARGET_MB else "BELOW TARGET"
        return [
            f"[{self.db}] {self.waiters} retries, all sent within {self.all_sent_s:.1f} s and"
            f" answered within {self.seconds:.1f} s: "
            f"{self.answered_complete} answered with the result (of {self.completed} completed"
            f" meanwhile), {self.answered_open} with the elicitation again, {self.errors} errors"
            + (f" (first: {self.first_error})" if self.first_error else ""),
            f"[{self.db}] completed flows woke their retry in p50 {statistics.median(wake):.0f}"
            f" ms, max {wake[-1]:.0f} ms",
            f"[{self.db}] broker RSS: {self.rss_before_mb:.0f} MB before,"
            f" {self.rss_peak_mb:.0f} MB peak, {self.rss_after_mb:.0f} MB after"
            f" (target: no error, peak <= {RSS_TARGET_MB} MB) {verdict}",
        ]


def waiting_retries(bench: Bench, kind: str, args: argparse.Namespace) -> WaitingResult:
    print(f"{args.waiters} waiting retries on {kind} ...", flush=True)
    name = f"broker-waiting-{kind}"
    users = bench.minter.mint_many(f"waiting-{kind}", 0, args.waiters)
    with (
        fresh_database(kind, bench.workdir) as url,
        running_broker(bench.config, url, bench.workdir, name=name, pin=bench.pin) as process,
    ):
        started = asyncio.run(start_rounds(bench.config.mcp_url, users))
        preparation = RetryPreparation(
            mcp_url=bench.config.mcp_url,
            database_url=url,
            issuer=bench.minter.issuer,
            sealing_keys=tuple(bench.config.encryption),
        )
        result = WaitingResult(kind, args.waiters, completed=len(started[::COMPLETED_SHARE]))
        with RssSampler(process.pid) as rss:
            result.rss_before_mb = rss.first_mb
            asyncio.run(_retry_all(preparation, dict(users), started, result, args.wait))
            result.rss_peak_mb = rss.peak_mb
        result.rss_after_mb = rss.now_mb()
    return result


async def _retry_all(
    prep: RetryPreparation,
    tokens: dict[str, str],
    started: list[StartedRound],
    result: WaitingResult,
    wait: float,
) -> None:
    """Every retry at once; once all are sent, complete a tenth of the flows (and note when).

    The retries go out through bench/rawpost.py, so that sending and reading 5,000 requests is
    not what the figures measure."""
    target = Target.of(prep.mcp_url)
    requests = {
        round_.subject: request_bytes(
            target,
            headers(tokens[round_.subject]),
            json.dumps(call_body(round_.request_state), separators=(",", ":")).encode(),
        )
        for round_ in started
    }
    completed_at: list[float] = []
    answered_at: dict[str, float] = {}
    sent_at: list[float] = []
    to_complete = {round_.subject for round_ in started[::COMPLETED_SHARE]}

    async def one(subject: str) -> None:
        try:
            async with asyncio.timeout(wait + 60):
                answer = await post(target, requests[subject])
            document = json.loads(answer.body) if answer.status == 200 else {}
        except (OSError, EOFError, TimeoutError, RawPostError, ValueError) as exc:
            _error(result, f"{type(exc).__name__}: {exc}")
            return
        sent_at.append(answer.sent_at)
        outcome = document.get("result", {})
        kind = outcome.get("resultType")
        if kind == "complete" and not outcome.get("isError"):
            result.answered_complete += 1
            answered_at[subject] = answer.read_at
        elif kind == "input_required":
            result.answered_open += 1
        else:
            _error(result, f"HTTP {answer.status}: {answer.body[:200]!r}")

    async def complete_some() -> None:
        await asyncio.sleep(wait * COMPLETE_AFTER)  # the retries are waiting by then
        chosen = [round_ for round_ in started if round_.subject in to_complete]
        # on a loop of its own: this one is busy with the waiting retries, and a database
        # connect timed on it ran out before the loop came back to it (PostgreSQL)
        await asyncio.to_thread(asyncio.run, complete_flows(prep, chosen))
        completed_at.append(time.monotonic())

    begun = time.monotonic()
    await asyncio.gather(complete_some(), *(one(subject) for subject in requests))
    result.seconds = time.monotonic() - begun
    result.all_sent_s = max(sent_at, default=begun) - begun
    if completed_at:
        result.wake_ms = tuple(
            max(0.0, (answered_at[subject] - completed_at[0]) * 1000)
            for subject in to_complete
            if subject in answered_at
        )


def _error(result: WaitingResult, description: str) -> None:
    result.errors += 1
    result.first_error = result.first_error or description


# -- main ---------------------------------------------------------------------------------------


def run(args: argparse.Namespace, workdir: Path) -> bool:
    clean = True
    if "large" in args.scenario:
        with prepared_bench(args, workdir) as bench:
            rows = [row for kind in args.db for row in large_database(bench, kind, args)]
        print("checks:", *(f"  {note}" for note in bench.notes), sep="\n")
        print(
            f"{'scenario':<11} {'db':<11} {'small':>7} {'p99 ms':>8} {'large':>7} {'p99 ms':>8}"
            f" {'large/small':>6}  target"
        )
        print(*(row.line() for row in rows), sep="\n")
        clean = all(row.clean for row in rows)
    if "waiting" in args.scenario:
        options = {
            "retry_wait_seconds": args.wait,
            "extra": {"server": {"max_connections": args.waiters + 100}},
        }
        with prepared_bench(args, workdir, **options) as bench:
            results = [waiting_retries(bench, kind, args) for kind in args.db]
        print(*(line for result in results for line in result.lines()), sep="\n")
        clean = clean and all(result.clean for result in results)
    return clean


def _terminate(signum: int, _frame: object) -> None:
    raise SystemExit(128 + signum)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, _terminate)
    try:
        require_wrk()
        with tempfile.TemporaryDirectory(prefix="broker-scale-") as tmp:
            clean = run(args, Path(tmp))
    except (WrkError, StackError, PoolError) as exc:
        print(f"benchmark failed: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted; everything started was stopped", file=sys.stderr)
        return 130
    if not clean:
        print("FAILED: errors or unexpected answers (see above)")
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
