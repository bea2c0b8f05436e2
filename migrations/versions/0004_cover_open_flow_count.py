"""cover the open-flow count with the owner index

The per-user cap on open flows counts a user's flows by status that have not expired. With
expires_at in the index that count reads the index alone instead of one table row per flow.

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-02 19:00:00
"""

from collections.abc import Sequence

from alembic import op

revision: str = "0004"
down_revision: str | None = "0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("flows", schema=None) as batch_op:
        batch_op.create_index(
            "ix_flows_owner_open", ["issuer", "subject", "status", "expires_at"], unique=False
        )
        batch_op.drop_index("ix_flows_owner_status")


def downgrade() -> None:
    with op.batch_alter_table("flows", schema=None) as batch_op:
        batch_op.create_index(
            "ix_flows_owner_status", ["issuer", "subject", "status"], unique=False
        )
        batch_op.drop_index("ix_flows_owner_open")
