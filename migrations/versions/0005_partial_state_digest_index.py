"""index state digests only where there is one

Only a flow waiting at an OAuth provider has a state digest; every other flow (all API-key flows,
and every flow once done) has none. A unique constraint indexed all those NULLs too, one more
index entry written per flow insert and update; a partial unique index keeps only real digests.

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-02 23:45:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0005"
down_revision: str | None = "0004"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

HAS_DIGEST = sa.text("state_digest IS NOT NULL")


def upgrade() -> None:
    with op.batch_alter_table("flows", schema=None) as batch_op:
        batch_op.drop_constraint("uq_flows_state_digest", type_="unique")
    op.create_index(
        "uq_flows_state_digest",
        "flows",
        ["state_digest"],
        unique=True,
        sqlite_where=HAS_DIGEST,
        postgresql_where=HAS_DIGEST,
    )


def downgrade() -> None:
    op.drop_index("uq_flows_state_digest", table_name="flows")
    with op.batch_alter_table("flows", schema=None) as batch_op:
        batch_op.create_unique_constraint("uq_flows_state_digest", ["state_digest"])
