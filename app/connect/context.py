"""What a connect round uses, and nothing more: both surfaces hand it to `require` and `rounds`."""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from app.config import Settings
from app.connect.notify import FlowNotifier
from app.connect.refresh import UsableCredentials
from app.direct import DirectStore


@dataclass(frozen=True, slots=True)
class RoundContext:
    settings: Settings
    store: DirectStore  # the flow and connection reads of every round
    sessionmaker: async_sessionmaker[AsyncSession]  # the client's decline, a consumed flow
    notifier: FlowNotifier  # wakes a waiting retry when the browser finishes
    credentials: UsableCredentials
