"""Throughput and latency of the broker's hot paths, against bare Starlette routes.

    python -m bench.run [--duration 10] [--connections 32] [--db sqlite,postgresql] [--pin]

For each database (a fresh one, and a fresh `connect-broker serve --workers 1`), wrk (-t1) drives:
  round1        tools/call connect_account by users without a connection -> input_required (JWT
                check + flow INSERT); one reused token per user, already in the broker's
                verified-token cache (the realistic case)
  retry         the accepted retry of a completed flow -> the final CallToolResult
  round1-fresh  round1 with a never-seen token on every request (signature checked every time)
  credential    the integration API's GET /api/v1/credentials/demo?issuer=…&subject=… by a
                registered service (its bearer secret checked, the sealed key of one of
                --credential-users users opened) -> 200 with the API key
  bare          the same requests against bench/echo_app.py, the reference for "ratio vs bare"
Each measured run follows a warm-up run. Everything listens and is driven on 127.0.0.1 only.
"cpu ms/req" is the server process's CPU time per response: unlike req/s it holds up when other
processes compete for the CPUs.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import signal
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn

from app.connect.service import MAX_OPEN_FLOWS_PER_USER
from bench.pool import (
    CredentialPreparation,
    PoolError,
    RetryPreparation,
    TokenMinter,
    call_body,
    flow_counts,
    prepare_credentials,
    prepare_retries,
    prime,
    write_get_pool,
    write_pool,
)
from bench.report import CREDENTIAL_TARGET, Measurement, Row, table
from bench.stack import (
    Pinning,
    StackError,
    config_file,
    cpu_seconds,
    create_service,
    ensure_idp_installed,
    fresh_database,
    running_broker,
    running_echo,
)
from bench.wrk import GET_SCRIPT, LUA_SCRIPT, WrkError, require_wrk, run_wrk
from tests.support.broker import BrokerConfig
from tests.support.idp import IdpConfig, free_port, running_idp

PEAK_RATE_GUESS = 2500  # req/s; sizes the round-1 user pool so no user nears the open-flow cap
SPARE = 1.3  # fresh-token pools are this much larger than the round-1 rate needs
BUSY_LOAD = 0.5  # a 1-minute load average above this means someone else is using the CPUs
INPUT_REQUIRED = '"resultType":"input_required"'
COMPLETE = '"resultType":"complete","content"'
ANY_RESULT = '"result"'
CREDENTIAL = '"secret":"sk_'  # the broker's stored keys are sk_bench_…, the bare one sk_bare_…
SERVICE = "bench-svc"
DEMO_PROVIDER: dict[str, Any] = {
    "kind": "api_key",
    "display_name": "Demo",
    "label": "API key",
    "pattern": r"^sk_[A-Za-z0-9_]{8,200}$",
}


@dataclass(frozen=True)
class Server:
    url: str  # the MCP endpoint
    pid: int

    @property
    def base_url(self) -> str:
        """Scheme, host and port: wrk's URL for GET pools, which carry their own paths."""
        return self.url.removesuffix("/mcp")


@dataclass
class Bench:
    """What every database block shares: options, tokens, the bare reference, the notes."""

    args: argparse.Namespace
    workdir: Path
    pin: Pinning
    config: BrokerConfig
    minter: TokenMinter
    echo: Server
    round1_users: list[tuple[str, str]]
    fresh_users: list[tuple[str, str]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def measure(
        self,
        server: Server,
        pool_file: Path,
        expect: str,
        warmup_file: Path | None = None,
        *,
        get: bool = False,
    ) -> Measurement:
        """A warm-up run (discarded), then the measured run and the server's CPU time for it.

        `get`: the pool holds GET requests (bench/credential.lua), not MCP POSTs (bench/mcp.lua).
        """
        options: dict[str, Any] = {
            "connections": self.args.connections,
            "prefix": self.pin.client,
            "script": GET_SCRIPT if get else LUA_SCRIPT,
        }
        url = server.base_url if get else server.url
        run_wrk(url, warmup_file or pool_file, expect, duration=self.args.warmup, **options)
        before = cpu_seconds(server.pid)
        result = run_wrk(url, pool_file, expect, duration=self.args.duration, **options)
        after = cpu_seconds(server.pid)
        if before is None or after is None or not result.requests:
            return Measurement(result, None)
        return Measurement(result, (after - before) * 1000 / result.requests)

    def fresh_tokens(self, count: int) -> list[str]:
        """`count` tokens of distinct users, minted on demand (a new broker has seen none)."""
        missing = count - len(self.fresh_users)
        if missing > 0:
            self.fresh_users += self.minter.mint_many("fresh", len(self.fresh_users), missing)
        return [token for _, token in self.fresh_users[:count]]


@dataclass
class Block:
    """The scenarios against one database and its broker."""

    bench: Bench
    kind: str
    database_url: str
    broker: Server
    config_path: Path

    def run(self) -> list[Row]:
        round1, round1_file = self.round1()
        retry, retry_file = self.retry()
        fresh = self.round1_fresh(round1.wrk.rps)
        credential, credential_file = self.credential()
        echo = self.bench.echo
        bare_round1 = self.bench.measure(echo, round1_file, ANY_RESULT)
        bare_retry = self.bench.measure(echo, retry_file, ANY_RESULT)
        bare_credential = self.bench.measure(echo, credential_file, CREDENTIAL, get=True)
        return [
            Row("round1", self.kind, round1, bare_round1),
            Row("retry", self.kind, retry, bare_retry),
            Row("round1-fresh", self.kind, fresh, bare_round1, targeted=False),
            Row("credential", self.kind, credential, bare_credential, target=CREDENTIAL_TARGET),
            Row("bare (round1 body)", self.kind, bare_round1),
            Row("bare (retry body)", self.kind, bare_retry),
            Row("bare (credential GET)", self.kind, bare_credential, target=CREDENTIAL_TARGET),
        ]

    def round1(self) -> tuple[Measurement, Path]:
        tokens = [token for _, token in self.bench.round1_users]
        asyncio.run(prime(self.broker.url, tokens))
        pool = write_pool(self._file("round1"), ((token, call_body()) for token in tokens))
        return self._counting_flows("round1", pool, len(tokens)), pool

    def round1_fresh(self, round1_rps: float) -> Measurement:
        args = self.bench.args
        warm = math.ceil(round1_rps * args.warmup * SPARE) + 100
        count = math.ceil(round1_rps * args.duration * SPARE) + 100
        tokens = self.bench.fresh_tokens(warm + count)
        warm_file = write_pool(self._file("fresh-warm"), ((t, call_body()) for t in tokens[:warm]))
        pool = write_pool(self._file("fresh"), ((t, call_body()) for t in tokens[warm:]))
        measured = self._counting_flows("round1-fresh", pool, warm + count, warm_file)
        result = measured.wrk
        if result.issued > result.pool:
            reused = (result.issued - result.pool) / result.issued
            self._note(f"round1-fresh: the token pool wrapped: {reused:.0%} of requests reused one")
        return measured

    def _counting_flows(
        self, name: str, pool: Path, users: int, warmup_file: Path | None = None
    ) -> Measurement:
        """Measure a round-1 scenario; note the flows it created and whether the cap hit."""
        before, _ = asyncio.run(flow_counts(self.database_url))
        measured = self.bench.measure(self.broker, pool, INPUT_REQUIRED, warmup_file)
        after, most = asyncio.run(flow_counts(self.database_url))
        refused = measured.wrk.unexpected
        self._note(
            f"{name}: {after - before} flows created (warm-up + run) by {users} users; "
            f"{measured.wrk.requests} responses measured, {refused} not input_required; "
            f"at most {most} flows for one user (cap {MAX_OPEN_FLOWS_PER_USER})"
            + (" <- the open-flow cap interfered" if refused else "")
        )
        return measured

    def retry(self) -> tuple[Measurement, Path]:
        bench = self.bench
        users = bench.minter.mint_many("retry", 0, bench.args.retry_users)
        preparation = RetryPreparation(
            mcp_url=self.broker.url,
            database_url=self.database_url,
            issuer=bench.minter.issuer,
            sealing_keys=tuple(bench.config.encryption),
        )
        entries = asyncio.run(prepare_retries(preparation, users))
        pool = write_pool(self._file("retry"), entries)
        self._note(f"retry: {len(entries)} users with a completed flow; a sample retry is complete")
        return bench.measure(self.broker, pool, COMPLETE), pool

    def credential(self) -> tuple[Measurement, Path]:
        """A service registered by the CLI fetches the keys of users in rotation."""
        bench = self.bench
        preparation = CredentialPreparation(
            base_url=self.broker.base_url,
            database_url=self.database_url,
            issuer=bench.minter.issuer,
            sealing_keys=tuple(bench.config.encryption),
            service=SERVICE,
            service_secret=create_service(self.config_path, SERVICE),
        )
        subjects = [f"credential-{i}" for i in range(bench.args.credential_users)]
        paths = asyncio.run(prepare_credentials(preparation, subjects))
        secret = preparation.service_secret
        pool = write_get_pool(self._file("credential"), ((secret, path) for path in paths))
        self._note(
            f"credential: service {SERVICE!r} and {len(paths)} users with a stored key it owns; "
            "a sample fetch is 200 with the stored key"
        )
        return bench.measure(self.broker, pool, CREDENTIAL, get=True), pool

    def _file(self, name: str) -> Path:
        return self.bench.workdir / f"pool-{self.kind}-{name}.txt"

    def _note(self, text: str) -> None:
        self.bench.notes.append(f"[{self.kind}] {text}")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m bench.run",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--duration", type=int, default=10, help="seconds per measured run")
    parser.add_argument("--connections", type=int, default=32, help="wrk connections")
    parser.add_argument("--db", default="sqlite,postgresql", help="comma-separated database kinds")
    parser.add_argument("--warmup", type=int, default=2, help="seconds of warm-up before each run")
    parser.add_argument("--retry-users", type=int, default=50, help="users in the retry scenario")
    parser.add_argument(
        "--credential-users", type=int, default=50, help="users in the credential scenario"
    )
    parser.add_argument("--pin", action="store_true", help="taskset: servers CPU 0, wrk CPU 1")
    args = parser.parse_args(argv)
    args.db = [kind.strip() for kind in args.db.split(",") if kind.strip()]
    unknown = set(args.db) - {"sqlite", "postgresql"}
    if unknown or not args.db:
        parser.error(f"--db takes sqlite and/or postgresql, not {sorted(unknown) or args.db}")
    counts = (args.duration, args.warmup, args.connections, args.retry_users, args.credential_users)
    if min(counts) < 1:
        parser.error(
            "--duration, --warmup, --connections, --retry-users and --credential-users"
            " must be positive"
        )
    return args


def round1_user_count(args: argparse.Namespace) -> int:
    """Enough users that none gets near the open-flow cap at PEAK_RATE_GUESS requests/s."""
    flows: int = PEAK_RATE_GUESS * (args.duration + args.warmup)
    return max(2000, math.ceil(flows / (MAX_OPEN_FLOWS_PER_USER // 2)))


def run(args: argparse.Namespace, workdir: Path) -> tuple[list[Row], list[str]]:
    pin = Pinning.choose(args.pin)
    with running_idp(IdpConfig(), workdir) as idp:
        config = BrokerConfig(issuer=idp.issuer, providers={"demo": DEMO_PROVIDER})
        minter = TokenMinter(idp.signing_jwk, issuer=idp.issuer, audience=config.mcp_url)
        round1_users = minter.mint_many("round1", 0, round1_user_count(args))
        print(setup_line(args, pin, len(round1_users)), flush=True)
        port = free_port()
        with running_echo(port, workdir, pin=pin) as echo:
            server = Server(f"http://127.0.0.1:{port}/mcp", echo.pid)
            bench = Bench(args, workdir, pin, config, minter, server, round1_users)
            rows = [row for kind in args.db for row in bench_database(bench, kind)]
    return rows, bench.notes


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
