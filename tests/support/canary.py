"""The canary sweep (SECURITY.md I1): every test that handles a secret uses a value containing
"CANARY", so one grep over every broker and IdP log, and over a dump of the session broker's
database, proves none of them leaked in plaintext.

The sweep must see what every test wrote, also the tests other pytest-xdist workers ran, so it is
not a test: the session broker dumps its database when the session ends (`write_dump`), and the
process that started the run sweeps once all workers are done (`sweep`, from tests/conftest.py).
"""

from __future__ import annotations

from pathlib import Path

from sqlalchemy import text

from app.db import create_engine

from .broker import run_sync

CANARY = "CANARY"
DUMP_NAME = "session-broker.dump"
DUMPED_TABLES = ("flows", "connections", "login_sessions")


def canary_hits(body: str) -> list[str]:
    return [line[:200] for line in body.splitlines() if CANARY in line]


def write_dump(database_url: str, path: Path) -> None:
    """Every row of the tables that hold what users sent, one repr per line, into `path`."""

    async def dump() -> None:
        engine = create_engine(database_url, pool_size=1)
        lines: list[str] = []
        try:
            async with engine.connect() as connection:
                for table in DUMPED_TABLES:
                    rows = (await connection.execute(text(f"SELECT * FROM {table}"))).all()
                    lines += [repr(row) for row in rows]
        finally:
            await engine.dispose()
        path.write_text("\n".join(lines))

    run_sync(dump)


def sweep(artifacts: Path, since: float) -> list[str] | None:
    """What leaked into the logs under `artifacts` or a session broker dump written at or after
    `since` (a time.time()); None when no session broker ran in this run (nothing to sweep)."""
    dumps = [path for path in artifacts.rglob(DUMP_NAME) if path.stat().st_mtime >= since]
    if not dumps:
        return None
    logs = {path: path.read_text(errors="replace") for path in sorted(artifacts.rglob("*.log"))}
    problems = [] if logs else [f"no logs were collected under {artifacts}"]
    problems += [f"{path}: {hit}" for path, body in logs.items() for hit in canary_hits(body)]
    problems += [
        f"{path}: {CANARY} in the database" for path in dumps if CANARY in path.read_text()
    ]
    return problems
