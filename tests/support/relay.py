"""A loopback TCP relay for tests: a database that goes away or hangs, or a load balancer."""

from __future__ import annotations

import asyncio
import contextlib
import itertools

from .idp import free_port


class TcpRelay:
    """A loopback TCP relay. In front of a database it stands for one that goes away (`cut`) or
    hangs (`stall`: connections are accepted and bytes read, but nothing is passed on until
    `flow`, as with a SIGSTOPped server whose kernel still queues what it is sent). In front of
    several servers it is a round-robin load balancer: each new connection goes to the next.
    In front of a web server it can lose answers (`hold_answers`: requests are passed on, what
    comes back is kept until `cut` drops the connections)."""

    def __init__(self, *target_ports: int, port: int | None = None) -> None:
        self.targets = itertools.cycle(target_ports)
        self.assigned: list[int] = []  # the target of each connection, in order
        self.port = port or free_port()
        self.server: asyncio.Server | None = None
        self.writers: set[asyncio.StreamWriter] = set()
        self.flowing = asyncio.Event()
        self.flowing.set()
        self.answering = asyncio.Event()
        self.answering.set()

    def stall(self) -> None:
        self.flowing.clear()

    def flow(self) -> None:
        self.flowing.set()

    def hold_answers(self) -> None:
        self.answering.clear()

    async def start(self) -> None:
        """Listen (again, after `cut`: the database is back)."""
        self.server = await asyncio.start_server(self._relay, "127.0.0.1", self.port)

    async def cut(self) -> None:
        assert self.server is not None
        self.server.close()
        for writer in list(self.writers):
            writer.close()
        self.writers.clear()
        self.answering.set()  # what was held goes nowhere now: let the pipes finish
        await self.server.wait_closed()

    async def _relay(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        target = next(self.targets)
        self.assigned.append(target)
        upstream_reader, upstream_writer = await asyncio.open_connection("127.0.0.1", target)
        self.writers.update((writer, upstream_writer))

        async def pipe(
            src: asyncio.StreamReader, dst: asyncio.StreamWriter, *gates: asyncio.Event
        ) -> None:
            with contextlib.suppress(OSError, ConnectionError):
                while data := await src.read(65536):
                    for gate in gates:
                        await gate.wait()
                    if dst.is_closing():
                        break
                    dst.write(data)
                    await dst.drain()
            dst.close()

        await asyncio.gather(
            pipe(reader, upstream_writer, self.flowing),
            pipe(upstream_reader, writer, self.flowing, self.answering),
        )
