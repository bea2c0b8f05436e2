"""Instructions per credential fetch, counted by callgrind: a figure that holds still.

    python -m bench.instructions [--requests 2000] [--concurrency 32] [--user-proof]

wrk's req/s moves with whatever else the machine does; an instruction count does not. This sends
the `credential` scenario's requests (bench/run.py) to the broker's ASGI app called in-process,
no HTTP server (the app's own work only: routing, access line, service-secret check, the SQLite
read, unsealing, the answer), under `valgrind --tool=callgrind`; then the same requests to the bare
reference's route (bench/echo_app.py), the same way. Requests go --concurrency at a time, as
bench/run.py's connections do, so what the store batches per event-loop turn is batched here
too; --concurrency 1 counts a request on an idle server. Each side runs twice after the same
warm-up: without measured requests, and with --requests of them; the difference, divided by
--requests, is its instructions per request. The ratio is bare / broker, as bench/run.py's are.

With --user-proof, the same run also counts the credential read of a service with
`user_proof = "token"`: the token exchange (POST /api/v1/token, RFC 8693) of a user's access token
signed with the key of a real IdP (tests/support/idp.py, whose JWKS the broker fetches, as in
production), for the same stored keys. Twice: with a token the broker has verified before
(`known`: each of the users' tokens is verified during the warm-up, then served from the
verifier's cache, as a sibling's repeated calls are), and with a token never seen before (`new`:
every measured request carries a fresh token, so each pays the signature check). Tokens are
minted before the runs, outside the count.

valgrind reports fewer CPU features than the machine has, and OpenSSL then runs generic code for
SHA-256: the secret's digest weighs more here than on the machine. Compare commits with it; do
not read it as a share of the real cost. Needs Debian's valgrind.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any
from urllib.parse import urlencode, urlsplit

from fastapi import FastAPI

from bench.pool import TokenMinter, credential_path, store_api_keys, write_get_pool
from bench.run import CONNECTIONS, DEMO_PROVIDER
from bench.scenarios import SERVICE
from bench.stack import REPO, StackError, create_service, fresh_database, migrated_config
from tests.support.broker import BrokerConfig
from tests.support.idp import IdpConfig, IdpError, IdpProcess, running_idp

ISSUER = "https://idp.bench.invalid"  # never contacted: the credential fetch verifies no token
PROOFED = "bench-proofed"  # the service with user_proof = "token"
TOKEN_AUDIENCE = "https://sibling.bench.invalid/mcp"  # noqa: S105 (its token_audience)
TOKEN_PATH = "/api/v1/token"  # noqa: S105 (a path)
EXCHANGE = {
    "grant_type": "urn:ietf:params:oauth:grant-type:token-exchange",
    "subject_token_type": "urn:ietf:params:oauth:token-type:access_token",
    "requested_token_type": "urn:connect-broker:credential:demo",
}
FORM = "application/x-www-form-urlencoded"
SIDES = {  # the side's name: what it counts
    "broker": "broker GET /credentials",
    "bare": "bare",
    "token-known": "broker POST /token, known token",
    "token-new": "broker POST /token, new token",
}
USERS = 50
WARMUP = 200
CHILD_TIMEOUT = 900.0
COLLECTED = re.compile(r"Collected : (\d+)")
# a stored key, as GET /credentials (`"secret":"sk_…`) or the token exchange answers it
_KEY = re.compile(rb'"(?:secret|access_token)":"sk_')

Asgi = Callable[[dict[str, Any], Any, Any], Awaitable[None]]
Sent = tuple[str, str, str]  # (bearer secret, path and query, form body or "" for a GET)


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
    parser.add_argument(
        "--user-proof",
        action="store_true",
        help='also count POST /api/v1/token for a user_proof = "token" service (starts the IdP)',
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
        with (
            tempfile.TemporaryDirectory(prefix="broker-instructions-") as tmp,
            contextlib.ExitStack() as stack,
        ):
            workdir = Path(tmp)
            idp = None
            if args.user_proof:
                idp = stack.enter_context(running_idp(IdpConfig(), workdir))
            per_request = _measure(valgrind, workdir, args.requests, args.concurrency, idp)
    except (StackError, IdpError) as exc:
        print(f"instruction count failed: {exc}", file=sys.stderr)
        return 1
    print(report(per_request, args.requests, args.concurrency))
    return 0


def report(per_request: dict[str, float], requests: int, concurrency: int) -> str:
    """The counts of each side measured, the bare / broker ratio, and what a token read adds
    to the GET."""
    broker, bare = per_request["broker"], per_request["bare"]
    lines = [
        f"instructions per credential read, in-process, {requests} measured requests,"
        f" {concurrency} at a time:",
        *(
            f"  {SIDES[side]:<33} {per_request[side]:>9,.0f}"
            + (f"  ({per_request[side] / broker:.2f}x the GET)" if side.startswith("token") else "")
            for side in SIDES
            if side in per_request
        ),
        f"  ratio {bare / broker:.3f}x (bare / broker GET)",
    ]
    return "\n".join(lines)


def _measure(
    valgrind: str, workdir: Path, requests: int, concurrency: int, idp: IdpProcess | None
) -> dict[str, float]:
    """Set up the scenario on a fresh SQLite database, then count each side without and with
    the measured requests (two runs at a time: the counts do not depend on the load). With
    `idp`, the token sides too."""
    issuer = ISSUER if idp is None else idp.issuer
    proofed = {PROOFED: {"user_proof": "token", "token_audience": TOKEN_AUDIENCE}}
    with fresh_database("sqlite", workdir) as url:
        config = BrokerConfig(
            issuer=issuer,
            providers={"demo": DEMO_PROVIDER},
            services=proofed if idp is not None else {},
        )
        config_path = migrated_config(config, url, workdir, "broker")
        secret = create_service(config_path, SERVICE)
        subjects = [f"credential-{number}" for number in range(USERS)]
        asyncio.run(store_api_keys(url, tuple(config.encryption), issuer, SERVICE, subjects))
        get_pool = write_get_pool(
            workdir / "pool.txt", ((secret, credential_path(issuer, s)) for s in subjects)
        )
        pools = {"broker": get_pool, "bare": get_pool}
        if idp is not None:
            proofed_secret = create_service(config_path, PROOFED)
            keys = tuple(config.encryption)
            asyncio.run(store_api_keys(url, keys, issuer, PROOFED, subjects))
            minter = TokenMinter(idp.signing_jwk, issuer=issuer, audience=TOKEN_AUDIENCE)
            known = [minter.mint(subject) for subject in subjects]
            new = [minter.mint(subjects[n % USERS]) for n in range(WARMUP + requests)]
            pools["token-known"] = write_token_pool(workdir / "known.txt", proofed_secret, known)
            pools["token-new"] = write_token_pool(workdir / "new.txt", proofed_secret, new)
        counts: dict[tuple[str, int], int] = {}
        for side, pool in pools.items():
            child = "bare" if side == "bare" else "broker"
            runs = {
                (side, measured): _start_child(
                    valgrind, child, config_path, pool, measured, concurrency
                )
                for measured in (0, requests)
            }
            for run, process in runs.items():
                counts[run] = _collected(run, process)
    return {side: (counts[side, requests] - counts[side, 0]) / requests for side in pools}


def write_token_pool(path: Path, secret: str, tokens: Sequence[str]) -> Path:
    """A pool of token exchanges: (bearer secret, the token path, the form) lines."""
    forms = (urlencode({**EXCHANGE, "subject_token": token}) for token in tokens)
    path.write_text("".join(f"{secret}\t{TOKEN_PATH}\t{form}\n" for form in forms))
    return path


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
    """Send WARMUP + `measured` requests of `pool` to one side's app, `concurrency` at a time
    (the broker's after one request alone: the first fetches the IdP's keys, and requests
    arriving meanwhile would be refused); 1 if one is not a 200 with a stored key in it."""
    requests = [_request(line) for line in pool.read_text().splitlines()]
    if side == "bare":
        from bench.echo_app import app as bare

        return asyncio.run(_drive(bare, "127.0.0.1", requests, measured, concurrency))
    from app import main
    from app.config import load_settings
    from app.logsetup import configure_logging
    from app.main import create_app

    # No housekeeping: it is no request's work, and under valgrind its count depends on time.
    # Its start-up pass runs for seconds beside the warm-up and is cancelled at shutdown, so the
    # run without measured requests stops it part of the way through and the other finishes it;
    # its later passes come every minute of wall time. Either added tens of thousands of
    # instructions per request at 2,000 requests, depending on how fast the machine ran.
    main._housekeeping_forever = _no_housekeeping
    with open(os.devnull, "w") as log:
        configure_logging(log)  # access lines written as `serve` writes them
        settings = load_settings(config_path)
        app = create_app(settings)
        host = urlsplit(settings.public_url).netloc
        return asyncio.run(_drive_served(app, host, requests, measured, concurrency))


async def _no_housekeeping(shared: object) -> None:
    return None


def _request(line: str) -> Sent:
    """(bearer secret, path and query, form) of a pool line: bench/pool.py's write_get_pool
    (no form) or write_token_pool."""
    secret, _, rest = line.partition("\t")
    target, _, form = rest.partition("\t")
    return secret, target, form


async def _drive_served(
    app: FastAPI, host: str, requests: Sequence[Sent], measured: int, concurrency: int
) -> int:
    async with app.router.lifespan_context(app):
        status, body = await _send(app, host, *requests[0])
        if status != 200:
            print(f"{requests[0][1]} answered {status}: {body[:300]!r}", file=sys.stderr)
            return 1
        return await _drive(app, host, requests, measured, concurrency)


async def _drive(
    app: Asgi, host: str, requests: Sequence[Sent], measured: int, concurrency: int
) -> int:
    """The warm-up, then the measured requests, each in rounds of `concurrency` at once (so the
    rounds of the warm-up are the same whether requests are measured or not)."""
    for first, count in (*_rounds(0, WARMUP, concurrency), *_rounds(WARMUP, measured, concurrency)):
        chosen = [requests[number % len(requests)] for number in range(first, first + count)]
        answers = await asyncio.gather(*(_send(app, host, *request) for request in chosen))
        for (_, target, form), (status, body) in zip(chosen, answers, strict=True):
            if status != 200 or _KEY.search(body) is None:
                method = "POST" if form else "GET"
                print(f"{method} {target} answered {status}: {body[:300]!r}", file=sys.stderr)
                return 1
    return 0


def _rounds(first: int, total: int, size: int) -> list[tuple[int, int]]:
    """(first request number, count) of each round of at most `size`, covering `total`."""
    return [
        (start, min(size, first + total - start)) for start in range(first, first + total, size)
    ]


async def _send(app: Asgi, host: str, secret: str, target: str, form: str) -> tuple[int, bytes]:
    """One request through `app` as uvicorn would call it, a POST of `form` if there is one,
    else a GET: (status, body)."""
    path, _, query = target.partition("?")
    body = form.encode()
    headers = [(b"host", host.encode()), (b"authorization", f"Bearer {secret}".encode())]
    if body:
        headers += [(b"content-type", FORM.encode()), (b"content-length", str(len(body)).encode())]
    scope: dict[str, Any] = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST" if body else "GET",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": query.encode(),
        "root_path": "",
        "headers": headers,
        "client": ("127.0.0.1", 40000),
        "server": ("127.0.0.1", 8000),
        "state": {},
    }
    messages: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": body, "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        messages.append(message)

    await app(scope, receive, send)
    return messages[0]["status"], b"".join(message.get("body", b"") for message in messages[1:])


if __name__ == "__main__":
    raise SystemExit(main())
