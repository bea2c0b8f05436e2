"""A real broker process for tests: `connect-broker serve` with a generated TOML config.

The database is SQLite or PostgreSQL, chosen by `BROKER_TEST_DB` (`sqlite` default, `postgresql`);
each broker gets a fresh database built by `connect-broker migrate`. Logs go to a file the tests
can read (canary sweeps, security events).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import json
import os
import secrets
import signal
import subprocess
import time
from collections.abc import Callable, Coroutine, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from app import admin_commands
from app.config import load_serve_settings
from app.crypto import generate_key
from app.migrate import upgrade

from . import forked
from .idp import free_port

T = TypeVar("T")

PG_ADMIN = "postgresql://postgres@127.0.0.1:5432/test"
START_TIMEOUT = 30.0


def run_sync(make: Callable[[], Coroutine[Any, Any, None]]) -> None:
    """Run a coroutine to completion, also from code that is itself inside an event loop."""
    in_thread(lambda: asyncio.run(make()))


def in_thread(work: Callable[[], T]) -> T:
    """`work()`, on a thread of its own when this thread runs an event loop (work that runs its
    own loop, such as a CLI command's, cannot run on a thread that has one)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return work()
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(work).result()


def database_kind() -> str:
    kind = os.environ.get("BROKER_TEST_DB", "sqlite")
    if kind not in ("sqlite", "postgresql"):
        raise RuntimeError(f"BROKER_TEST_DB must be sqlite or postgresql, not {kind!r}")
    return kind


def fresh_database(workdir: Path, name: str, *, kind: str | None = None) -> str:
    """A new, empty database URL of `kind` (default: the configured kind)."""
    unique = f"{name}_{os.getpid()}_{secrets.token_hex(3)}"
    if (kind or database_kind()) == "sqlite":
        return f"sqlite:///{workdir / (unique + '.db')}"
    db_name = f"broker_test_{unique}"

    async def create() -> None:
        import asyncpg

        connection = await asyncpg.connect(PG_ADMIN.replace("postgresql://", "postgres://"))
        try:
            await connection.execute(f'CREATE DATABASE "{db_name}"')
        finally:
            await connection.close()

    run_sync(create)
    return f"postgresql://postgres@127.0.0.1:5432/{db_name}"


def drop_database(url: str) -> None:
    if url.startswith("sqlite:///"):
        for suffix in ("", "-wal", "-shm"):
            Path(url.removeprefix("sqlite:///") + suffix).unlink(missing_ok=True)
        return
    name = url.rsplit("/", 1)[1]

    async def drop() -> None:
        import asyncpg

        connection = await asyncpg.connect(PG_ADMIN.replace("postgresql://", "postgres://"))
        try:
            await connection.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        finally:
            await connection.close()

    run_sync(drop)


# The suite's brokers serve many users, and many wrong tokens, all from 127.0.0.1: budgets high
# enough never to refuse, still checked on every request. tests/test_rate_limits.py sets its own.
UNREACHED_LIMITS = {
    "user_requests_per_minute": 10_000_000,
    "user_burst": 1_000_000,
    "failed_auths_per_minute": 10_000_000,
    "failed_auth_burst": 1_000_000,
}


def toml_value(value: Any) -> str:
    return json.dumps(value)


@dataclass
class BrokerConfig:
    issuer: str
    port: int = 0
    login_client_id: str = "broker-login"
    login_client_secret: str = "broker-login-secret"
    identity_claim: str = "sub"
    required_scopes: list[str] = field(default_factory=list)
    retry_wait_seconds: float = 3
    signing: list[str] = field(default_factory=lambda: [generate_key("s1")])
    encryption: list[str] = field(default_factory=lambda: [generate_key("e1")])
    providers: dict[str, dict[str, Any]] = field(default_factory=dict)
    services: dict[str, dict[str, Any]] = field(default_factory=dict)
    webhooks: dict[str, dict[str, Any]] = field(default_factory=dict)
    extra: dict[str, dict[str, Any]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.port:
            self.port = free_port()

    @property
    def public_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def mcp_url(self) -> str:
        return f"{self.public_url}/mcp"

    def render(self, database_url: str) -> str:
        identity = {
            "issuer": self.issuer,
            "identity_claim": self.identity_claim,
            "login_client_id": self.login_client_id,
            "login_client_secret": self.login_client_secret,
            "required_scopes": self.required_scopes,
        }
        sections: dict[str, dict[str, Any]] = {
            "server": {
                "public_url": self.public_url,
                "retry_wait_seconds": self.retry_wait_seconds,
            },
            "database": {"url": database_url},
            "identity": identity,
            "keys": {"signing": self.signing, "encryption": self.encryption},
            "limits": dict(UNREACHED_LIMITS),
        }
        for name, table in self.extra.items():  # `extra` adds sections, and keys to these
            sections[name] = {**sections.get(name, {}), **table}
        lines: list[str] = []
        for section, values in sections.items():
            lines.append(f"[{section}]")
            lines += [f"{key} = {toml_value(value)}" for key, value in values.items()]
        for name, values in self.providers.items():
            lines.append(f"[providers.{name}]")
            nested = {k: v for k, v in values.items() if isinstance(v, dict)}
            lines += [f"{k} = {toml_value(v)}" for k, v in values.items() if k not in nested]
            for key, table in nested.items():
                lines.append(f"[providers.{name}.{key}]")
                lines += [f"{k} = {toml_value(v)}" for k, v in table.items()]
        for kind, named in (("services", self.services), ("webhooks", self.webhooks)):
            for name, values in named.items():
                lines.append(f"[{kind}.{name}]")
                lines += [f"{k} = {toml_value(v)}" for k, v in values.items()]
        return "\n".join(lines) + "\n"


LOG_WAIT_SECONDS = 5.0  # how long a test waits for an expected broker log line


@dataclass
class BrokerProcess:
    config: BrokerConfig
    config_path: Path
    log_path: Path
    database_url: str
    process: forked.ForkedCommand

    @property
    def url(self) -> str:
        return self.config.public_url

    @property
    def mcp_url(self) -> str:
        return self.config.mcp_url

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    async def wait_for_log(self, needle: str, count: int = 1, *, since: int = 0) -> str:
        """The log from offset `since`, once it holds `needle` at least `count` times (or after
        LOG_WAIT_SECONDS). The broker writes its lines at the end of an event-loop turn, and a
        request's access line after its response, so a test holding the response can be ahead
        of the file; reading at once would be a race."""
        deadline = time.monotonic() + LOG_WAIT_SECONDS
        while (text := self.log()[since:]).count(needle) < count and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        return text

    async def log_shows(self, needle: str) -> bool:
        return needle in await self.wait_for_log(needle)

    def wait_until_serving(self) -> None:
        """Return once /healthz answers; a process that exits or never answers is an error."""
        try:
            self.process.wait_until_serving(self.url, self.log_path, START_TIMEOUT, "broker")
        except RuntimeError:
            self.stop()  # if it still runs
            raise

    def kill(self) -> None:
        """SIGKILL: no shutdown work, as in a crash or an OOM kill."""
        self.process.kill()
        self.process.wait(5)

    def restart(self) -> None:
        """Serve again from the same config and database (after `stop` or `kill`); the log file
        goes on, so offsets taken before stay valid."""
        self.process = _serve(self.config, self.config_path, self.log_path)
        self.wait_until_serving()

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(5)


class LogWindow:
    """The broker log lines written after this point. What a test expects to find is waited for
    (`wait_for`, `shows`; see `BrokerProcess.wait_for_log`); `text` is for what must be absent."""

    def __init__(self, broker: BrokerProcess) -> None:
        self._broker = broker
        self._start = len(broker.log())

    def text(self) -> str:
        return self._broker.log()[self._start :]

    async def wait_for(self, needle: str, count: int = 1) -> str:
        return await self._broker.wait_for_log(needle, count, since=self._start)

    async def shows(self, needle: str) -> bool:
        return needle in await self.wait_for(needle)


def cli(
    *args: str, config_path: Path, env: dict[str, str] | None = None, timeout: float = 60
) -> subprocess.CompletedProcess[str]:
    """`connect-broker --config CONFIG_PATH ARGS`, forked (tests/support/forked.py)."""
    return forked.run(
        ["--config", str(config_path), *args],
        env={**os.environ, **(env or {})},
        timeout=timeout,
    )


def migrate(database_url: str) -> None:
    """What `connect-broker migrate` does, in a thread of this process (it runs its own event
    loop): one Python start less for every broker a test starts."""
    in_thread(lambda: upgrade(database_url))


def create_service(broker: BrokerProcess, name: str, providers: tuple[str, ...] = ()) -> str:
    """What `connect-broker service create NAME --providers …` does, in this process (one Python
    start less per service): the service's secret. The command itself, its arguments and output,
    is tested in tests/integration_api/test_services.py."""
    settings = load_serve_settings(str(broker.config_path))
    return in_thread(lambda: admin_commands.create_service(settings, name, providers))


def start_broker(
    config: BrokerConfig, workdir: Path, *, name: str = "broker", database_url: str | None = None
) -> BrokerProcess:
    """Migrate a fresh database (or `database_url`) and serve it."""
    workdir.mkdir(parents=True, exist_ok=True)
    database_url = database_url or fresh_database(workdir, name)
    config_path = workdir / f"{name}-{config.port}.toml"
    config_path.write_text(config.render(database_url))
    migrate(database_url)
    return _launch(config, config_path, workdir / f"{name}-{config.port}.log", database_url)


def serve_replica(broker: BrokerProcess, *, name: str = "replica", **changes: Any) -> BrokerProcess:
    """One more `serve` process on the broker's database and keys (no migration), on a port of
    its own. Its public URL follows its port unless the config sets `server.public_url` (replicas
    behind one balancer share it). `changes` replace fields of the broker's BrokerConfig."""
    config = dataclasses.replace(broker.config, port=free_port(), **changes)
    config_path = broker.config_path.with_name(f"{name}-{config.port}.toml")
    config_path.write_text(config.render(broker.database_url))
    return _launch(config, config_path, config_path.with_suffix(".log"), broker.database_url)


def _launch(
    config: BrokerConfig, config_path: Path, log_path: Path, database_url: str
) -> BrokerProcess:
    """Serve with a fresh log, and return once the process answers."""
    log_path.write_bytes(b"")
    broker = BrokerProcess(
        config, config_path, log_path, database_url, _serve(config, config_path, log_path)
    )
    broker.wait_until_serving()
    return broker


def _serve(config: BrokerConfig, config_path: Path, log_path: Path) -> forked.ForkedCommand:
    """`connect-broker serve` on the config's port, forked (tests/support/forked.py), its output
    appended to the log."""
    return forked.start(
        ["--config", str(config_path), "serve", "--port", str(config.port)], stdout=log_path
    )


@contextlib.contextmanager
def running_broker(
    config: BrokerConfig, workdir: Path, *, name: str = "broker", keep_database: bool = False
) -> Iterator[BrokerProcess]:
    broker = start_broker(config, workdir, name=name)
    try:
        yield broker
    finally:
        broker.stop()
        if not keep_database:
            drop_database(broker.database_url)
