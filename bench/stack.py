"""The processes of a benchmark run: IdP, database, broker, bare reference; all on 127.0.0.1.

Every start waits a bounded time for readiness; every context manager stops its process (SIGTERM,
then SIGKILL) or drops its database on exit, failure included.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import asyncpg
import httpx2

from tests.support.broker import BrokerConfig
from tests.support.idp import IDP_DIR

REPO = Path(__file__).resolve().parents[1]
PG_ADMIN = "postgres://postgres@127.0.0.1:5432/postgres"
PG_URL = "postgresql://postgres@127.0.0.1:5432/{name}"
START_TIMEOUT = 30.0
STOP_TIMEOUT = 10.0
NPM_TIMEOUT = 600.0
MIGRATE_TIMEOUT = 120.0
PG_TIMEOUT = 30.0


class StackError(RuntimeError):
    """A process or database of the benchmark could not be set up."""


@dataclass(frozen=True)
class Pinning:
    """Command prefixes that pin the servers and wrk to different CPUs (or nothing)."""

    server: tuple[str, ...] = ()
    client: tuple[str, ...] = ()
    description: str = "none (--pin puts the servers on CPU 0 and wrk on CPU 1)"

    @classmethod
    def choose(cls, wanted: bool) -> Pinning:
        if not wanted:
            return cls()
        taskset = shutil.which("taskset")
        if taskset is None:
            return cls(description="none: --pin was given but taskset is not installed")
        return cls(
            server=(taskset, "-c", "0"),
            client=(taskset, "-c", "1"),
            description="servers on CPU 0, wrk on CPU 1 (taskset)",
        )


def ensure_idp_installed() -> None:
    """Install the test IdP's node modules (`npm ci --prefix tests/idp`) when missing."""
    if (IDP_DIR / "node_modules" / "oidc-provider").is_dir():
        return
    npm = shutil.which("npm")
    if npm is None:
        raise StackError("npm is not installed; the benchmark's IdP (tests/idp) needs Node.js")
    done = subprocess.run(
        [npm, "ci", "--prefix", str(IDP_DIR)],
        capture_output=True,
        text=True,
        timeout=NPM_TIMEOUT,
        check=False,
    )
    if done.returncode != 0:
        raise StackError(f"npm ci --prefix {IDP_DIR} failed:\n{done.stderr}")


@contextlib.contextmanager
def fresh_database(kind: str, workdir: Path) -> Iterator[str]:
    """A new empty database URL of `kind` (sqlite or postgresql), dropped on exit."""
    if kind == "sqlite":
        yield f"sqlite:///{workdir / 'bench-sqlite.db'}"
        return
    name = f"broker_bench_{os.getpid()}_{secrets.token_hex(3)}"
    asyncio.run(_pg_admin(f'CREATE DATABASE "{name}"'))
    try:
        yield PG_URL.format(name=name)
    finally:
        asyncio.run(_pg_admin(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))


async def _pg_admin(statement: str) -> None:
    try:
        async with asyncio.timeout(PG_TIMEOUT):
            connection = await asyncpg.connect(PG_ADMIN, timeout=5)
            try:
                await connection.execute(statement)
            finally:
                await connection.close()
    except (OSError, TimeoutError, asyncpg.PostgresError) as exc:
        raise StackError(f"PostgreSQL at {PG_ADMIN}: {statement!r} failed: {exc!r}") from exc


@contextlib.contextmanager
def running_broker(
    config: BrokerConfig, database_url: str, workdir: Path, *, name: str, pin: Pinning
) -> Iterator[subprocess.Popen[bytes]]:
    """Migrate, then `connect-broker serve --workers 1` (log in `workdir/<name>.log`).

    Its configuration is `config_file(workdir, name)`, for further CLI commands.
    """
    config_path = migrated_config(config, database_url, workdir, name)
    serve = [*pin.server, *_cli(config_path), "serve", "--port", str(config.port), "--workers", "1"]
    log_path = workdir / f"{name}.log"
    with running_process(serve, log_path, http_ok(f"{config.public_url}/healthz"), name) as process:
        yield process


def migrated_config(config: BrokerConfig, database_url: str, workdir: Path, name: str) -> Path:
    """`config_file(workdir, name)`, written for `database_url`, and that database migrated."""
    config_path = config_file(workdir, name)
    config_path.write_text(config.render(database_url))
    migrated = subprocess.run(
        [*_cli(config_path), "migrate"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=MIGRATE_TIMEOUT,
        check=False,
    )
    if migrated.returncode != 0:
        raise StackError(f"migrate failed:\n{migrated.stderr}")
    return config_path


def config_file(workdir: Path, name: str) -> Path:
    return workdir / f"{name}.toml"


def _cli(config_path: Path) -> list[str]:
    return [sys.executable, "-m", "app.cli", "--config", str(config_path)]


def create_service(config_path: Path, name: str) -> str:
    """`connect-broker service create <name>` on that configuration's database: the secret."""
    done = subprocess.run(
        [*_cli(config_path), "service", "create", name],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=MIGRATE_TIMEOUT,
        check=False,
    )
    lines = done.stdout.splitlines()
    if done.returncode != 0 or len(lines) != 1:
        raise StackError(f"service create {name} failed ({done.returncode}):\n{done.stderr}")
    return lines[0].strip()


@contextlib.contextmanager
def running_echo(port: int, workdir: Path, *, pin: Pinning) -> Iterator[subprocess.Popen[bytes]]:
    """The bare reference app (bench/echo_app.py) on `http://127.0.0.1:<port>`."""
    command = [*pin.server, sys.executable, "-m", "bench.echo_app", "--port", str(port)]
    with running_process(command, workdir / "echo.log", accepts(port), "echo app") as process:
        yield process


@contextlib.contextmanager
def running_process(
    command: list[str], log_path: Path, ready: Callable[[], bool], name: str
) -> Iterator[subprocess.Popen[bytes]]:
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            command, cwd=REPO, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT
        )
    try:
        _wait_ready(process, ready, log_path, name)
        yield process
    finally:
        stop(process)


def _wait_ready(
    process: subprocess.Popen[bytes], ready: Callable[[], bool], log_path: Path, name: str
) -> None:
    deadline = time.monotonic() + START_TIMEOUT
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise StackError(f"{name} exited with {process.returncode}:\n{log_path.read_text()}")
        if ready():
            return
        time.sleep(0.1)
    raise StackError(f"{name} not ready within {START_TIMEOUT:.0f}s:\n{log_path.read_text()}")


def stop(process: subprocess.Popen[bytes]) -> None:
    """SIGTERM, a bounded wait, then SIGKILL."""
    if process.poll() is not None:
        return
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(STOP_TIMEOUT)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait(STOP_TIMEOUT)


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU time of a process so far (Linux /proc), or None where unavailable."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    # fields[0] is field 3 of proc(5) (state): utime and stime are fields 14 and 15.
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def http_ok(url: str) -> Callable[[], bool]:
    def probe() -> bool:
        try:
            return httpx2.get(url, timeout=1, trust_env=False).status_code == 200
        except httpx2.HTTPError:
            return False

    return probe


def accepts(port: int) -> Callable[[], bool]:
    """uvicorn binds its socket only after the app's startup, so a connect means ready."""

    def probe() -> bool:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                return True
        except OSError:
            return False

    return probe
