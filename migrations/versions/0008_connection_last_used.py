"""connections: last used

The day a connection was last used, for `[connections] max_idle_days`. Written by the
housekeeping at most once a day per connection; NULL until then (its creation time counts).

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-06 05:40:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0008"
down_revision: str | None = "0007"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("connections") as batch:
        batch.add_column(sa.Column("last_used_at", sa.DateTime(timezone=True), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("connections") as batch:
        batch.drop_column("last_used_at")
