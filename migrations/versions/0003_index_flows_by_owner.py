"""index flows by owner

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-02 10:33:34.135014
"""

from collections.abc import Sequence

from alembic import op

revision: str = "0003"
down_revision: str | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("flows", schema=None) as batch_op:
        batch_op.create_index(
            "ix_flows_owner_status", ["issuer", "subject", "status"], unique=False
        )


def downgrade() -> None:
    with op.batch_alter_table("flows", schema=None) as batch_op:
        batch_op.drop_index("ix_flows_owner_status")
