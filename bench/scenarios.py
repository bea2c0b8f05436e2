"""The scenarios of one benchmark run: the servers, wrk runs measured in broker/bare pairs, and
the database side each scenario needs (see bench/run.py for what each scenario sends)."""

from __future__ import annotations

import argparse
import asyncio
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from app.connect.service import MAX_OPEN_FLOWS
from bench.pool import (
    CredentialPreparation,
    RetryPreparation,
    TokenMinter,
    call_body,
    expire_open_flows,
    flow_counts,
    prepare_credentials,
    prepare_retries,
    prime,
    write_get_pool,
    write_pool,
)
from bench.report import CREDENTIAL_TARGET, Measurement, Row, median_of
from bench.stack import Pinning, cpu_seconds, create_service
from bench.wrk import GET_SCRIPT, LUA_SCRIPT, run_wrk
from tests.support.broker import BrokerConfig

SPARE = 1.3  # fresh-token pools are this much larger than the round-1 rate needs
INPUT_REQUIRED = '"resultType":"input_required"'
COMPLETE = '"resultType":"complete","content"'
ANY_RESULT = '"result"'
CREDENTIAL = '"secret":"sk_'  # the broker's stored keys are sk_bench_…, the bare one sk_bare_…
SERVICE = "bench-svc"
ROUND1_USERS = "round1"  # round-1 subjects are "round1-<n>" (bench/run.py mints them)


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

    def paired(
        self,
        server: Server,
        pool_file: Path,
        expect: str,
        bare_expect: str,
        *,
        get: bool = False,
        before_broker: Callable[[], None] | None = None,
    ) -> Paired:
        """--repeat pairs of runs on the same requests: the broker's, then the bare reference's.
        `before_broker` runs before each broker run (its warm-up included)."""
        broker_runs: list[Measurement] = []
        bare_runs: list[Measurement] = []
        for _ in range(self.args.repeat):
            if before_broker is not None:
                before_broker()
            broker_runs.append(self.measure(server, pool_file, expect, get=get))
            bare_runs.append(self.measure(self.echo, pool_file, bare_expect, get=get))
        ratios = tuple(
            broker.wrk.rps / bare.wrk.rps if bare.wrk.rps else 0.0
            for broker, bare in zip(broker_runs, bare_runs, strict=True)
        )
        return Paired(median_of(broker_runs), median_of(bare_runs), ratios)

    def fresh_tokens(self, count: int) -> list[str]:
        """`count` tokens of distinct users, minted on demand (a new broker has seen none)."""
        missing = count - len(self.fresh_users)
        if missing > 0:
            self.fresh_users += self.minter.mint_many("fresh", len(self.fresh_users), missing)
        return [token for _, token in self.fresh_users[:count]]


@dataclass(frozen=True)
class Paired:
    """A scenario measured in interleaved broker/bare pairs: medians, and each pair's ratio."""

    broker: Measurement
    bare: Measurement
    ratios: tuple[float, ...]

    def row(self, scenario: str, kind: str, **options: Any) -> Row:
        return Row(scenario, kind, self.broker, self.bare, ratios=self.ratios, **options)

    def spread(self) -> str:
        return " ".join(f"{ratio:.2f}x" for ratio in self.ratios)


@dataclass(frozen=True)
class Prepared:
    """A scenario's requests, written once, and what its answers must contain."""

    pool: Path
    expect: str  # in every broker answer
    bare_expect: str  # in every answer of the bare reference
    get: bool = False  # GET requests (bench/credential.lua), not MCP POSTs
    before_broker: Callable[[], None] | None = None  # runs before each broker run


@dataclass
class Block:
    """The scenarios against one database and its broker."""

    bench: Bench
    kind: str
    database_url: str
    broker: Server
    config_path: Path

    def run(self) -> list[Row]:
        round1 = self.round1()
        retry = self.retry()
        fresh = self.round1_fresh(round1.broker.wrk.rps)
        credential = self.credential()
        for name, paired in (("round1", round1), ("retry", retry), ("credential", credential)):
            self._note(f"{name}: ratio of each broker/bare pair of runs: {paired.spread()}")
        return [
            round1.row("round1", self.kind),
            retry.row("retry", self.kind),
            Row("round1-fresh", self.kind, fresh, round1.bare, targeted=False),
            credential.row("credential", self.kind, target=CREDENTIAL_TARGET),
            Row("bare (round1 body)", self.kind, round1.bare),
            Row("bare (retry body)", self.kind, retry.bare),
            Row("bare (credential GET)", self.kind, credential.bare, target=CREDENTIAL_TARGET),
        ]

    def round1(self) -> Paired:
        prepared = self.prepare_round1()
        before, _ = asyncio.run(flow_counts(self.database_url))
        paired = self.measure(prepared)
        self._note_flows("round1", before, len(self.bench.round1_users), paired.broker)
        return paired

    def retry(self) -> Paired:
        return self.measure(self.prepare_retry())

    def credential(self) -> Paired:
        return self.measure(self.prepare_credential())

    def measure(self, prepared: Prepared) -> Paired:
        """--repeat broker/bare pairs of runs of a prepared scenario (it can be measured again)."""
        return self.bench.paired(
            self.broker,
            prepared.pool,
            prepared.expect,
            prepared.bare_expect,
            get=prepared.get,
            before_broker=prepared.before_broker,
        )

    def prepare_round1(self) -> Prepared:
        tokens = [token for _, token in self.bench.round1_users]
        asyncio.run(prime(self.broker.url, tokens))
        calls = ((token, call_body(numbered=True)) for token in tokens)
        pool = write_pool(self._file("round1"), calls)
        return Prepared(pool, INPUT_REQUIRED, ANY_RESULT, before_broker=self._expire_round1_flows)

    def _expire_round1_flows(self) -> None:
        asyncio.run(expire_open_flows(self.database_url, f"{ROUND1_USERS}-"))

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
        self._note_flows(name, before, users, measured)
        return measured

    def _note_flows(self, name: str, before: int, users: int, measured: Measurement) -> None:
        after, most = asyncio.run(flow_counts(self.database_url))
        refused = measured.wrk.unexpected
        self._note(
            f"{name}: {after - before} flows created (warm-ups + runs) by {users} users; "
            f"{measured.wrk.requests} responses measured, {refused} not input_required; "
            f"at most {most} open flows for one user (cap {MAX_OPEN_FLOWS})"
            + (" <- the open-flow cap interfered" if refused else "")
        )

    def prepare_retry(self) -> Prepared:
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
        return Prepared(pool, COMPLETE, ANY_RESULT)

    def prepare_credential(self) -> Prepared:
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
        return Prepared(pool, CREDENTIAL, CREDENTIAL, get=True)

    def _file(self, name: str) -> Path:
        return self.bench.workdir / f"pool-{self.kind}-{name}.txt"

    def _note(self, text: str) -> None:
        self.bench.notes.append(f"[{self.kind}] {text}")
