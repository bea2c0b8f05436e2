"""Instructions per credential fetch, counted by callgrind: a figure that holds still.

    python -m bench.instructions [--requests 2000] [--concurrency 32]

wrk's req/s moves with whatever else the machine does; an instruction count does not. This sends
the `credential` scenario's requests (bench/run.py) to the broker's ASGI app called in-process,
no HTTP server (the app's own work only: routing, access line, service-secret check, the SQLite
read, unsealing, the answer), under `valgrind --tool=callgrind`; then the same requests to the bare
reference's route (bench/echo_app.py), the same way. Requests go --concurrency at a time, as
bench/run.py's connections do, so what the store batches per event-loop turn is batched here
too; --concurrency 1 counts a request on an idle server. Each side runs twice after the same
warm-up: without measured requests, and with --requests of them; the difference, divided by
--requests, is its instructions per request. The ratio is bare / broker, as bench/run.py's are.

valgrind reports fewer CPU features than the machine has, and OpenSSL then runs generic code for
SHA-256: the secret's digest weighs more here than on the machine. Compare commits with it; do
not read it as a share of the real cost. Needs Debian's valgrind.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from fastapi import FastAPI

from bench.pool import credential_path, store_api_keys, write_get_pool
from bench.run import CONNECTIONS, DEMO_PROVIDER
from bench.scenarios import CREDENTIAL, SERVICE
from bench.stack import REPO, StackError, create_service, fresh_database, migrated_config
from tests.support.broker import BrokerConfig

ISSUER = "https://idp.bench.invalid"  # never contacted: the credential fetch verifies no token
USERS = 50
WARMUP = 200
CHILD_TIMEOUT = 900.0
COLLECTED = re.compile(r"Collected : (\d+)")

Asgi = Callable[[dict[str, Any], Any, Any], Awaitable[None]]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m bench.instructions",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--requests", type=int, default=2000, help="measured requests per side")
    parser.add_argument(
        "--concurrency",
        type=int,
        default=CONNECTIONS,
        help="requests in flight at once (bench.run's wrk connections)",
    )
    # a run under callgrind: --child broker|bare --config FILE --pool FILE --measured N
    parser.add_argument("--child", choices=("broker", "bare"), help=argparse.SUPPRESS)
    parser.add_argument("--config", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--pool", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--measured", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.requests < 1 or args.concurrency < 1:
        parser.error("--requests and --concurrency must be positive")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.child is not None:
        return _child(args.child, args.config, args.pool, args.measured, args.concurrency)
    valgrind = shutil.which("valgrind")
    if valgrind is None:
        print("valgrind is not installed: apt-get install valgrind", file=sys.stderr)
        return 2
    try:
        with tempfile.TemporaryDirectory(prefix="broker-instructions-") as tmp:
            per_request = _measure(valgrind, Path(tmp), args.requests, args.concurrency)
    except StackError as exc:
        print(f"instruction count failed: {exc}", file=sys.stderr)
        return 1
    broker, bare = per_request["broker"], per_request["bare"]
    print(
        f"instructions per credential fetch, in-process, {args.requests} measured requests,"
        f" {args.concurrency} at a time:"
    )
    print(f"  broker  {broker:>9,.0f}")
    print(f"  bare    {bare:>9,.0f}")
    print(f"  ratio   {bare / broker:.3f}x (bare / broker)")
    return 0


def _measure(valgrind: str, workdir: Path, requests: int, concurrency: int) -> dict[str, float]:
    """Set up the scenario on a fresh SQLite database, then count each side without and with
    the measured requests (two runs at a time: the counts do not depend on the load)."""
    with fresh_database("sqlite", workdir) as url:
        config = BrokerConfig(issuer=ISSUER, providers={"demo": DEMO_PROVIDER})
        config_path = migrated_config(config, url, workdir, "broker")
        secret = create_service(config_path, SERVICE)
        subjects = [f"credential-{number}" for number in range(USERS)]
        asyncio.run(store_api_keys(url, tuple(config.encryption), ISSUER, SERVICE, subjects))
        pool = write_get_pool(
            workdir / "pool.txt", ((secret, credential_path(ISSUER, s)) for s in subjects)
        )
        counts: dict[tuple[str, int], int] = {}
        for side in ("broker", "bare"):
            runs = {
                (side, measured): _start_child(
                    valgrind, side, config_path, pool, measured, concurrency
                )
                for measured in (0, requests)
            }
            for run, process in runs.items():
                counts[run] = _collected(run, process)
    return {
        side: (counts[side, requests] - counts[side, 0]) / requests for side in ("broker", "bare")
    }


def _start_child(
    valgrind: str, side: str, config: Path, pool: Path, measured: int, concurrency: int
) -> subprocess.Popen[str]:
    command = [
        *(valgrind, "--tool=callgrind", "--callgrind-out-file=/dev/null"),
        *(sys.executable, "-m", "bench.instructions", "--child", side),
        *("--config", str(config), "--pool", str(pool), "--measured", str(measured)),
        *("--concurrency", str(concurrency)),
    ]
    # one hash seed for every run: the same dict and set layouts with and without the requests
    environment = {**os.environ, "PYTHONHASHSEED": "0"}
    return subprocess.Popen(
        command,
        cwd=REPO,
        env=environment,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _collected(run: tuple[str, int], process: subprocess.Popen[str]) -> int:
    """The run's instruction count, from callgrind's summary on stderr."""
    side, measured = run
    try:
        stdout, stderr = process.communicate(timeout=CHILD_TIMEOUT)
    except subprocess.TimeoutExpired:
        process.kill()
        process.communicate()
        raise StackError(f"{side} with {measured} requests: over {CHILD_TIMEOUT:.0f} s") from None
    found = COLLECTED.search(stderr)
    if process.returncode != 0 or found is None:
        raise StackError(f"{side} with {measured} requests failed:\n{stdout}{stderr[-3000:]}")
    return int(found.group(1))


def _child(side: str, config_path: Path, pool: Path, measured: int, concurrency: int) -> int:
    """Send WARMUP + `measured` requests of `pool` to one side's app, `concurrency` at a time;
    1 if one is not a 200 with a stored key in it."""
    requests = [_request(line) for line in pool.read_text().splitlines()]
    if side == "bare":
        from bench.echo_app import app as bare

        return asyncio.run(_drive(bare, "127.0.0.1", requests, measured, concurrency))
    from app.config import load_settings
    from app.logsetup import configure_logging
    from app.main import create_app

    with open(os.devnull, "w") as log:
        configure_logging(log)  # access lines written as `serve` writes them
        settings = load_settings(config_path)
        app = create_app(settings)
        host = urlsplit(settings.public_url).netloc
        return asyncio.run(_drive_served(app, host, requests, measured, concurrency))


def _request(line: str) -> tuple[str, str]:
    """(bearer secret, path and query) of a pool line (bench/pool.py's write_get_pool)."""
    secret, _, target = line.partition("\t")
    return secret, target


async def _drive_served(
    app: FastAPI, host: str, requests: Sequence[tuple[str, str]], measured: int, concurrency: int
) -> int:
    async with app.router.lifespan_context(app):
        return await _drive(app, host, requests, measured, concurrency)


async def _drive(
    app: Asgi, host: str, requests: Sequence[tuple[str, str]], measured: int, concurrency: int
) -> int:
    """The warm-up, then the measured requests, each in rounds of `concurrency` at once (so the
    rounds of the warm-up are the same whether requests are measured or not)."""
    for first, count in (*_rounds(0, WARMUP, concurrency), *_rounds(WARMUP, measured, concurrency)):
        chosen = [requests[number % len(requests)] for number in range(first, first + count)]
        answers = await asyncio.gather(*(_get(app, host, *request) for request in chosen))
        for (_, target), (status, body) in zip(chosen, answers, strict=True):
            if status != 200 or CREDENTIAL.encode() not in body:
                print(f"GET {target} answered {status}: {body[:300]!r}", file=sys.stderr)
                return 1
    return 0


def _rounds(first: int, total: int, size: int) -> list[tuple[int, int]]:
    """(first request number, count) of each round of at most `size`, covering `total`."""
    return [
        (start, min(size, first + total - start)) for start in range(first, first + total, size)
    ]


async def _get(app: Asgi, host: str, secret: str, target: str) -> tuple[int, bytes]:
    """One GET through `app` as uvicorn would call it: (status, body)."""
    path, _, query = target.partition("?")
    scope: dict[str, Any] = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "GET",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": query.encode(),
        "root_path": "",
        "headers": [(b"host", host.encode()), (b"authorization", f"Bearer {secret}".encode())],
        "client": ("127.0.0.1", 40000),
        "server": ("127.0.0.1", 8000),
        "state": {},
    }
    messages: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        messages.append(message)

    await app(scope, receive, send)
    return messages[0]["status"], b"".join(message.get("body", b"") for message in messages[1:])


if __name__ == "__main__":
    raise SystemExit(main())
