"""count open flows per user and audience

The cap on a user's open flows is per audience: a sibling service's flows no longer use up the
places of the user's MCP client (nor another service's). The owner index takes the audience
after the owner, so the count still reads the index alone.

Revision ID: 0012
Revises: 0011
Create Date: 2026-12-07 21:00:00
"""

from collections.abc import Sequence

from alembic import op

revision: str = "0012"
down_revision: str | None = "0011"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

OWNER_OPEN = "ix_flows_owner_open"


def upgrade() -> None:
    with op.batch_alter_table("flows", schema=None) as batch_op:
        batch_op.drop_index(OWNER_OPEN)
        batch_op.create_index(
            OWNER_OPEN, ["issuer", "subject", "audience", "status", "expires_at"], unique=False
        )


def downgrade() -> None:
    with op.batch_alter_table("flows", schema=None) as batch_op:
        batch_op.drop_index(OWNER_OPEN)
        batch_op.create_index(
            OWNER_OPEN, ["issuer", "subject", "status", "expires_at"], unique=False
        )
