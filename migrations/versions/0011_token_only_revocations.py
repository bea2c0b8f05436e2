"""pending_revocations: whole grant or the token only

GitHub's grant revocation ends every token of the OAuth app for that GitHub account: the account's
other connections (through another service, or of another user) with it. A revocation queued
while such a connection remains now revokes its own token only (`whole_grant` false); the last
connection of the account still revokes the whole grant. Revocations queued before keep revoking
the whole grant, as they were queued to. An index on connections (provider, account_id) finds
the account's other connections without reading the table.

Revision ID: 0011
Revises: 0010
Create Date: 2026-12-07 18:45:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0011"
down_revision: str | None = "0010"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_index("ix_connections_provider_account", "connections", ["provider", "account_id"])
    with op.batch_alter_table("pending_revocations") as batch:
        batch.add_column(
            sa.Column("whole_grant", sa.Boolean(), nullable=False, server_default=sa.true())
        )


def downgrade() -> None:
    with op.batch_alter_table("pending_revocations") as batch:
        batch.drop_column("whole_grant")
    op.drop_index("ix_connections_provider_account", table_name="connections")
