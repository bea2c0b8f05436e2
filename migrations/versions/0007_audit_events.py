"""audit events

Every lifecycle event (flows, connections, services, keys), written in the transaction of the
change it records; swept after `[audit] retention_days`.

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-06 05:30:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0007"
down_revision: str | None = "0006"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "audit_events",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("occurred_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("event", sa.String(length=64), nullable=False),
        sa.Column("actor_kind", sa.String(length=16), nullable=False),
        sa.Column("actor_id", sa.String(length=511), nullable=False),
        sa.Column("issuer", sa.String(length=255), nullable=True),
        sa.Column("subject", sa.String(length=255), nullable=True),
        sa.Column("provider", sa.String(length=64), nullable=True),
        sa.Column("audience", sa.String(length=64), nullable=True),
        sa.Column("account_label", sa.String(length=255), nullable=True),
        sa.Column("detail", sa.String(length=128), nullable=True),
        sa.Column("request_id", sa.String(length=32), nullable=True),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_audit_events")),
    )
    op.create_index(
        op.f("ix_audit_events_occurred_at"), "audit_events", ["occurred_at"], unique=False
    )
    op.create_index(
        "ix_audit_events_user", "audit_events", ["issuer", "subject", "occurred_at"], unique=False
    )


def downgrade() -> None:
    op.drop_index("ix_audit_events_user", table_name="audit_events")
    op.drop_index(op.f("ix_audit_events_occurred_at"), table_name="audit_events")
    op.drop_table("audit_events")
