"""L9. The SQLite database holds sealed credentials and service-secret digests: `migrate` and
`serve` create its directory 0700 and its files (the database, its -wal and -shm) 0600, as the
`dev` playground keeps ./data; a directory the operator made keeps the mode they gave it."""

from __future__ import annotations

import stat
from pathlib import Path

from app.db import private_sqlite_file

from .conftest import DEMO_PROVIDER
from .support.broker import BrokerConfig, start_broker
from .support.http import local_client
from .support.idp import IdpProcess


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


async def test_L9_serve_creates_the_sqlite_directory_0700_and_its_files_0600(
    idp: IdpProcess, workdir: Path, tmp_path: Path
) -> None:
    directory = tmp_path / "state" / "broker"
    database = directory / "broker.db"
    config = BrokerConfig(issuer=idp.issuer, providers={"demo": DEMO_PROVIDER})
    broker = start_broker(config, workdir, name="l9", database_url=f"sqlite:///{database}")
    try:
        async with local_client() as http:  # a write: the WAL is in use
            assert (await http.get(f"{broker.url}/readyz")).status_code == 200
        files = sorted(path.name for path in directory.iterdir())
        modes = {name: mode(directory / name) for name in files}
    finally:
        broker.stop()

    assert mode(directory) == 0o700
    assert {"broker.db", "broker.db-wal", "broker.db-shm"} <= set(files)
    assert modes == dict.fromkeys(files, 0o600)


def test_L9_an_existing_directory_keeps_its_mode(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o750)
    shared.chmod(0o750)

    private_sqlite_file(str(shared / "broker.db"))

    assert mode(shared) == 0o750
    assert mode(shared / "broker.db") == 0o600
