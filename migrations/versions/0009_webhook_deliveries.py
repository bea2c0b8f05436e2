"""webhook deliveries

Each configured webhook's place in the stream of audit events (`webhook_deliveries`), and on
`audit_events` what that stream needs: on PostgreSQL the id of the transaction that wrote each
row (`txid`, a server default: the inserts are unchanged), read in (txid, id) order; on SQLite
AUTOINCREMENT ids, never used twice (an erasure may delete the newest event).

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-06 20:00:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0009"
down_revision: str | None = "0008"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

HAS_TXID = sa.text("txid IS NOT NULL")
CURRENT_TXID = sa.text("(pg_current_xact_id()::text)::bigint")


def upgrade() -> None:
    sqlite = op.get_bind().dialect.name == "sqlite"
    if sqlite:
        with op.batch_alter_table(
            "audit_events", recreate="always", table_kwargs={"sqlite_autoincrement": True}
        ) as batch:
            batch.add_column(sa.Column("txid", sa.BigInteger(), nullable=True))
    else:
        op.add_column(
            "audit_events",
            sa.Column("txid", sa.BigInteger(), nullable=True, server_default=CURRENT_TXID),
        )
    op.create_index(
        "ix_audit_events_txid",
        "audit_events",
        ["txid", "id"],
        unique=False,
        sqlite_where=HAS_TXID,
        postgresql_where=HAS_TXID,
    )
    op.create_table(
        "webhook_deliveries",
        sa.Column("webhook", sa.String(length=64), nullable=False),
        sa.Column("after_txid", sa.BigInteger(), nullable=False),
        sa.Column("after_id", sa.BigInteger(), nullable=False),
        sa.Column("head_id", sa.BigInteger(), nullable=True),
        sa.Column("attempts", sa.Integer(), nullable=False),
        sa.Column("last_error", sa.String(length=64), nullable=True),
        sa.Column("next_attempt_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("webhook", name=op.f("pk_webhook_deliveries")),
    )


def downgrade() -> None:
    op.drop_table("webhook_deliveries")
    op.drop_index("ix_audit_events_txid", table_name="audit_events")
    if op.get_bind().dialect.name == "sqlite":
        with op.batch_alter_table(
            "audit_events", recreate="always", table_kwargs={"sqlite_autoincrement": False}
        ) as batch:
            batch.drop_column("txid")
    else:
        op.drop_column("audit_events", "txid")
