"""service clients

Revision ID: 0002
Revises: 0001
Create Date: 2026-12-02 10:21:33.961780
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0002"
down_revision: str | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "service_clients",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("name", sa.String(length=64), nullable=False),
        sa.Column("secret_digest", sa.String(length=64), nullable=False),
        sa.Column("providers", sa.Text(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("revoked_at", sa.DateTime(timezone=True), nullable=True),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_service_clients")),
        sa.UniqueConstraint("name", name=op.f("uq_service_clients_name")),
        sa.UniqueConstraint("secret_digest", name=op.f("uq_service_clients_secret_digest")),
    )


def downgrade() -> None:
    op.drop_table("service_clients")
