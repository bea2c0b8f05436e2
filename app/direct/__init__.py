"""Direct driver access for the few statements on the request hot paths.

Every MCP tool call and integration-API credential fetch runs one to three small indexed
statements. Through SQLAlchemy's asyncio layer each costs about a millisecond of CPU (session,
greenlet bridging, and on SQLite a thread hand-off per DBAPI call); straight through the drivers
it costs tens of microseconds. So these statements, and only these, bypass the ORM:

    find_connection  the default account's sealed credential for (issuer, subject, provider,
                     audience), and how many accounts the user holds there
    insert_flow      a new connect flow, unless the user already has too many open ones, or
                     an open one of the same call to reuse
    get_flow_and_connection
                     a flow by id, with its owner's connection for its provider (MCP retries,
                     the integration API's resume, and the bounded wait)
    still_open       which of the flows the process's waiting retries wait for are still open
                     (one statement for all of them, every poll interval: app/connect/notify.py)
    find_service     a live sibling service by the digest of its secret
    find_service_and_own_connection
                     both at once, for the integration API's credential fetch

On PostgreSQL the calls of one event-loop turn share one statement (batching.py); on SQLite the
reads of one turn share one read transaction, and the inserts one commit.

The statements are not written here: they are app/tables/'s Core statements, compiled once per
driver (compiled.py) and read by column name (records.py). Everything else (pages, transitions,
refresh under a row lock, the CLI) runs on SQLAlchemy sessions.
"""

from __future__ import annotations

from app.direct.factory import open_direct_store
from app.direct.records import (
    ConnectionRecord,
    DirectStore,
    FlowRecord,
    NewFlow,
    ServiceRecord,
    StoreUnavailable,
)

__all__ = [
    "ConnectionRecord",
    "DirectStore",
    "FlowRecord",
    "NewFlow",
    "ServiceRecord",
    "StoreUnavailable",
    "open_direct_store",
]
