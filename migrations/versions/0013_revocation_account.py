"""pending_revocations: the upstream account whose token is queued

A provider whose token revocation ends the user's whole grant (RFC 7009 at Google, say) would end
another connection of the same upstream account with it. Each attempt therefore checks, when it
is made, whether a connection (of any user, through any audience) holds the account; for that the
queued row names it. Rows queued before name no account and are revoked as they were queued to.

Revision ID: 0013
Revises: 0012
Create Date: 2026-12-07 23:10:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0013"
down_revision: str | None = "0012"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("pending_revocations") as batch:
        batch.add_column(sa.Column("account_id", sa.String(255), nullable=False, server_default=""))


def downgrade() -> None:
    with op.batch_alter_table("pending_revocations") as batch:
        batch.drop_column("account_id")
