"""Waiting for a flow to leave its open states, bounded, without holding a database connection."""

from __future__ import annotations

import asyncio
import contextlib

from app.auth.principal import Principal
from app.connect import service as flows
from app.connect.notify import FlowNotifier
from app.connect.service import FlowRead
from app.direct import DirectStore


async def wait_for_flow(
    store: DirectStore,
    notifier: FlowNotifier,
    flow_id: str,
    principal: Principal,
    wait_seconds: float,
) -> FlowRead | None:
    """The flow (and its connection) once it is no longer open, or as it stands after
    `wait_seconds`.

    A finished flow (most retries) is answered from one read, without subscribing; an open one is
    read again once subscribed, so a completion between the two reads still wakes the wait.
    """
    loop = asyncio.get_running_loop()
    deadline = loop.time() + wait_seconds
    read = await flows.read_for(store, flow_id=flow_id, principal=principal)
    if read is None or not read.flow.is_open or wait_seconds <= 0:
        return read
    with notifier.subscribe(flow_id) as changed:
        while True:
            changed.clear()
            read = await flows.read_for(store, flow_id=flow_id, principal=principal)
            remaining = deadline - loop.time()
            if read is None or not read.flow.is_open or remaining <= 0:
                return read
            # `timeout`, not `wait_for`: no task of its own for each of thousands of waiters
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(remaining):
                    await changed.wait()
