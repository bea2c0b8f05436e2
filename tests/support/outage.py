"""Taking a broker's database away and giving it back, for outage tests (SECURITY.md I2, J2).

PostgreSQL goes away for real: the broker reaches it through a TCP relay that is cut, then opened
again. An SQLite file cannot be taken from a process that has it open; what an unavailable SQLite
database looks like to the broker is a write lock it cannot get (another connection holds it), so
reads go on and writes fail once `busy_timeout` runs out.
"""

from __future__ import annotations

import asyncio
import contextlib
import sqlite3
from pathlib import Path

from .broker import BrokerProcess
from .idp import free_port

PG_PORT = 5432


class TcpProxy:
    """A loopback TCP relay standing for a database that goes away (`cut`) or hangs (`stall`:
    connections are accepted and bytes read, but nothing is passed on until `flow`, as with a
    SIGSTOPped server whose kernel still queues what it is sent)."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.port = free_port()
        self.server: asyncio.Server | None = None
        self.writers: set[asyncio.StreamWriter] = set()
        self.flowing = asyncio.Event()
        self.flowing.set()

    def stall(self) -> None:
        self.flowing.clear()

    def flow(self) -> None:
        self.flowing.set()

    async def start(self) -> None:
        """Listen (again, after `cut`: the database is back)."""
        self.server = await asyncio.start_server(self._relay, "127.0.0.1", self.port)

    async def cut(self) -> None:
        assert self.server is not None
        self.server.close()
        for writer in list(self.writers):
            writer.close()
        self.writers.clear()
        await self.server.wait_closed()

    async def _relay(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        upstream_reader, upstream_writer = await asyncio.open_connection(
            "127.0.0.1", self.target_port
        )
        self.writers.update((writer, upstream_writer))

        async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            with contextlib.suppress(OSError, ConnectionError):
                while data := await src.read(65536):
                    await self.flowing.wait()
                    dst.write(data)
                    await dst.drain()
            dst.close()

        await asyncio.gather(pipe(reader, upstream_writer), pipe(upstream_reader, writer))


async def behind_proxy(broker: BrokerProcess) -> TcpProxy:
    """Restart the (PostgreSQL) broker with its database reached through a new relay."""
    proxy = TcpProxy(PG_PORT)
    await proxy.start()
    config = broker.config_path.read_text()
    broker.config_path.write_text(config.replace(f"127.0.0.1:{PG_PORT}", f"127.0.0.1:{proxy.port}"))
    broker.stop()
    await asyncio.to_thread(broker.restart)
    return proxy


class DatabaseOutage:
    """`begin` takes the broker's database away, `end` gives it back (see the module doc)."""

    def __init__(self, broker: BrokerProcess, proxy: TcpProxy | None) -> None:
        self._path = None if proxy else Path(broker.database_url.removeprefix("sqlite:///"))
        self._proxy = proxy
        self._lock: sqlite3.Connection | None = None

    @classmethod
    async def arrange(cls, broker: BrokerProcess) -> DatabaseOutage:
        if broker.database_url.startswith("sqlite:///"):
            return cls(broker, None)
        return cls(broker, await behind_proxy(broker))

    async def begin(self, *, hang: bool = False) -> None:
        """The database goes away, or with `hang` stops answering (the same for SQLite)."""
        if self._proxy is not None:
            if hang:
                self._proxy.stall()
            else:
                await self._proxy.cut()
            return
        assert self._path is not None
        self._lock = sqlite3.connect(self._path, isolation_level=None)
        self._lock.execute("BEGIN EXCLUSIVE")

    async def end(self) -> None:
        if self._proxy is not None:
            self._proxy.flow()
            if self._proxy.server is None or not self._proxy.server.is_serving():
                await self._proxy.start()
            return
        if self._lock is not None:
            self._lock.execute("ROLLBACK")
            self._lock.close()
            self._lock = None

    async def close(self) -> None:
        """Give the database back if it is still away, and stop the relay."""
        await self.end()
        if self._proxy is not None:
            await self._proxy.cut()
