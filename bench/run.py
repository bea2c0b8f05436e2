"""Throughput and latency of the broker's hot paths, against bare Starlette routes.

    python -m bench.run [--duration 10] [--repeat 3] [--connections 32] [--pin]
                        [--db sqlite,postgresql]

For each database (a fresh one, and a fresh `connect-broker serve --workers 1`), wrk (-t1) drives:
  round1        tools/call connect_account by users without a connection -> input_required (JWT
                check + flow INSERT); one reused token per user, already in the broker's
                verified-token cache (the realistic case); the users' open flows are expired
                before each broker run, so no run meets the open-flow cap
  retry         the accepted retry of a completed flow -> the final CallToolResult
  round1-fresh  round1 with a never-seen token on every request (signature checked every time)
  credential    the integration API's GET /api/v1/credentials/demo?issuer=…&subject=… by a
                registered service (its bearer secret checked, the sealed key of one of
                --credential-users users opened) -> 200 with the API key
  bare          the same requests against bench/echo_app.py, the reference for "ratio vs bare"
The brokers' rate limits (app/limits.py) are set high enough never to refuse (BrokerConfig's
defaults): every request still pays for its check. Each measured run follows a warm-up run.
Everything listens and is driven on 127.0.0.1 only.
round1, retry and credential run --repeat times, each broker run followed at once by the bare run
of the same requests: a row shows the medians over the repeats, its ratio is the median of the
per-pair ratios (listed under "checks"), so a slow spell of the machine hits both sides of a pair.
"cpu ms/req" is the server process's CPU time per response: unlike req/s it holds up when other
processes compete for the CPUs; "cpu ratio" compares it with the bare reference's (informational).
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import signal
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NoReturn

from app.auth.bearer import CACHE_SIZE as TOKEN_CACHE_SIZE
from app.connect.service import MAX_OPEN_FLOWS
from bench.pool import PoolError, TokenMinter
from bench.report import Row, table
from bench.scenarios import ROUND1_USERS, Bench, Block, Server
from bench.stack import (
    Pinning,
    StackError,
    config_file,
    ensure_idp_installed,
    fresh_database,
    running_broker,
    running_echo,
)
from bench.wrk import WrkError, require_wrk
from tests.support.broker import BrokerConfig
from tests.support.idp import IdpConfig, free_port, running_idp

PEAK_RATE_GUESS = 8000  # req/s; sizes the round-1 user pool so no user nears the open-flow cap
BUSY_LOAD = 0.5  # a 1-minute load average above this means someone else is using the CPUs
DEMO_PROVIDER: dict[str, Any] = {
    "kind": "api_key",
    "display_name": "Demo",
    "label": "API key",
    "pattern": r"^sk_[A-Za-z0-9_]{8,200}$",
}


CONNECTIONS = 32  # wrk connections by default; bench/instructions.py sends as many at once


def argument_parser(prog: str, description: str | None) -> argparse.ArgumentParser:
    """The options every benchmark of the broker's hot paths takes (bench/scale.py adds its own)."""
    parser = argparse.ArgumentParser(
        prog=prog,
        description=description,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--duration", type=int, default=10, help="seconds per measured run")
    parser.add_argument("--connections", type=int, default=CONNECTIONS, help="wrk connections")
    parser.add_argument("--db", default="sqlite,postgresql", help="comma-separated database kinds")
    parser.add_argument("--warmup", type=int, default=2, help="seconds of warm-up before each run")
    parser.add_argument(
        "--repeat", type=int, default=3, help="broker/bare pairs of runs per targeted scenario"
    )
    parser.add_argument("--retry-users", type=int, default=50, help="users in the retry scenario")
    parser.add_argument(
        "--credential-users", type=int, default=50, help="users in the credential scenario"
    )
    parser.add_argument("--pin", action="store_true", help="taskset: servers CPU 0, wrk CPU 1")
    return parser


def checked(parser: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.Namespace:
    """`args` with --db split into a list; exits through `parser.error` when an option is bad."""
    args.db = [kind.strip() for kind in args.db.split(",") if kind.strip()]
    unknown = set(args.db) - {"sqlite", "postgresql"}
    if unknown or not args.db:
        parser.error(f"--db takes sqlite and/or postgresql, not {sorted(unknown) or args.db}")
    counts = (
        args.duration,
        args.warmup,
        args.repeat,
        args.connections,
        args.retry_users,
        args.credential_users,
    )
    if min(counts) < 1:
        parser.error(
            "--duration, --warmup, --repeat, --connections, --retry-users and --credential-users"
            " must be positive"
        )
    return args


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argument_parser("python -m bench.run", __doc__)
    return checked(parser, parser.parse_args(argv))


def round1_user_count(args: argparse.Namespace) -> int:
    """Enough users that none gets near the open-flow cap in one broker run (warm-up and measured
    run) at PEAK_RATE_GUESS requests/s (their open flows are expired before each run), but no
    more than the broker's verified-token cache holds: round1 measures cached tokens (more users
    would cycle the cache and check a signature on every request, which is round1-fresh)."""
    flows: int = PEAK_RATE_GUESS * (args.duration + args.warmup)
    return min(TOKEN_CACHE_SIZE, max(2000, math.ceil(flows / (MAX_OPEN_FLOWS // 2))))


def run(args: argparse.Namespace, workdir: Path) -> tuple[list[Row], list[str]]:
    with prepared_bench(args, workdir) as bench:
        rows = [row for kind in args.db for row in bench_database(bench, kind)]
    return rows, bench.notes


@contextlib.contextmanager
def prepared_bench(
    args: argparse.Namespace, workdir: Path, **broker_options: Any
) -> Iterator[Bench]:
    """The IdP, the round-1 users' tokens and the bare reference, running; `broker_options` go
    to the brokers' BrokerConfig."""
    pin = Pinning.choose(args.pin)
    with running_idp(IdpConfig(), workdir) as idp:
        config = BrokerConfig(
            issuer=idp.issuer, providers={"demo": DEMO_PROVIDER}, **broker_options
        )
        minter = TokenMinter(idp.signing_jwk, issuer=idp.issuer, audience=config.mcp_url)
        round1_users = minter.mint_many(ROUND1_USERS, 0, round1_user_count(args))
        print(setup_line(args, pin, len(round1_users)), flush=True)
        port = free_port()
        with running_echo(port, workdir, pin=pin) as echo:
            server = Server(f"http://127.0.0.1:{port}/mcp", echo.pid)
            yield Bench(args, workdir, pin, config, minter, server, round1_users)


def bench_database(bench: Bench, kind: str) -> list[Row]:
    print(f"measuring on {kind} ...", flush=True)
    name = f"broker-{kind}"
    with (
        fresh_database(kind, bench.workdir) as url,
        running_broker(bench.config, url, bench.workdir, name=name, pin=bench.pin) as process,
    ):
        broker = Server(bench.config.mcp_url, process.pid)
        return Block(bench, kind, url, broker, config_file(bench.workdir, name)).run()


def setup_line(args: argparse.Namespace, pin: Pinning, round1_users: int) -> str:
    load = os.getloadavg()[0]
    busy = f" -- WARNING: load {load:.1f} before start, req/s will be low" * (load > BUSY_LOAD)
    return (
        f"wrk -t1 -c{args.connections} -d{args.duration}s --latency after a {args.warmup}s warm-up;"
        f" {args.repeat} broker/bare pairs per targeted scenario (medians shown);"
        f" 1 uvicorn worker per server; CPU pinning: {pin.description}{busy}\n"
        f"pools: round1 {round1_users} users (one cached token each), retry {args.retry_users}"
        " users, round1-fresh a new user and token per request, credential"
        f" {args.credential_users} users (one service secret)"
    )


def report(rows: list[Row], notes: list[str]) -> int:
    print("checks:", *(f"  {note}" for note in notes), sep="\n")
    print(table(rows))
    load = os.getloadavg()[0]
    if load > BUSY_LOAD + 2:  # wrk and the server alone give about 2
        print(f"WARNING: load {load:.1f} at the end: other processes shared the 2 CPUs")
    if not all(row.clean for row in rows):
        print("FAILED: no responses, non-2xx, socket errors or unexpected answers (see above)")
        return 1
    return 0


def _terminate(signum: int, _frame: object) -> NoReturn:
    raise SystemExit(128 + signum)  # unwinds every `finally`: processes stop, databases drop


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, _terminate)
    try:
        require_wrk()
        ensure_idp_installed()
        with tempfile.TemporaryDirectory(prefix="broker-bench-") as tmp:
            rows, notes = run(args, Path(tmp))
    except (WrkError, StackError, PoolError) as exc:
        print(f"benchmark failed: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted; everything started was stopped", file=sys.stderr)
        return 130
    return report(rows, notes)


if __name__ == "__main__":
    raise SystemExit(main())
