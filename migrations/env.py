"""Alembic environment: async, URL from `config.attributes["url"]`, metadata from app.models."""

import asyncio

from alembic import context
from sqlalchemy.engine import Connection

from app.db import create_engine
from app.models import Base

config = context.config


def run_migrations(connection: Connection) -> None:
    context.configure(
        connection=connection,
        target_metadata=Base.metadata,
        compare_type=True,
        render_as_batch=connection.dialect.name == "sqlite",
    )
    with context.begin_transaction():
        context.run_migrations()


async def run_online() -> None:
    engine = create_engine(config.attributes["url"], pool_size=1, bounded=False)
    async with engine.connect() as connection:
        await connection.run_sync(run_migrations)
        await connection.commit()
    await engine.dispose()


if context.is_offline_mode():
    raise SystemExit("offline migrations are not supported; run `connect-broker migrate`")
asyncio.run(run_online())
