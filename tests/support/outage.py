"""Taking a broker's database away and giving it back (SECURITY.md I2, J1, J2, J5).

PostgreSQL goes away for real: the broker reaches it through a TCP relay that is cut, then opened
again. An SQLite file cannot be taken from a process that has it open; what an unavailable SQLite
database looks like to the broker is a write lock it cannot get (another connection holds it), so
reads go on and writes fail once `busy_timeout` runs out.
"""

from __future__ import annotations

import asyncio
import sqlite3
from pathlib import Path

from .broker import BrokerProcess
from .relay import TcpRelay

PG_PORT = 5432


async def behind_proxy(broker: BrokerProcess) -> TcpRelay:
    """Restart the (PostgreSQL) broker with its database reached through a new relay."""
    proxy = TcpRelay(PG_PORT)
    await proxy.start()
    config = broker.config_path.read_text()
    broker.config_path.write_text(config.replace(f"127.0.0.1:{PG_PORT}", f"127.0.0.1:{proxy.port}"))
    broker.stop()
    await asyncio.to_thread(broker.restart)
    return proxy


class DatabaseOutage:
    """`begin` takes the broker's database away, `end` gives it back (see the module doc)."""

    def __init__(self, broker: BrokerProcess, proxy: TcpRelay | None) -> None:
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
