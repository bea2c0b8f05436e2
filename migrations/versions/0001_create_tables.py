"""create tables

Revision ID: 0001
Revises:
Create Date: 2026-12-02 09:53:27.690698
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0001"
down_revision: str | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:

    op.create_table(
        "connections",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("issuer", sa.String(length=255), nullable=False),
        sa.Column("subject", sa.String(length=255), nullable=False),
        sa.Column("provider", sa.String(length=64), nullable=False),
        sa.Column("audience", sa.String(length=64), nullable=False),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("sealed_credential", sa.Text(), nullable=False),
        sa.Column("key_id", sa.String(length=32), nullable=False),
        sa.Column("scopes", sa.Text(), nullable=False),
        sa.Column("account_label", sa.String(length=255), nullable=True),
        sa.Column("expires_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_connections")),
    )
    with op.batch_alter_table("connections", schema=None) as batch_op:
        batch_op.create_index(
            "uq_connections_owner_provider",
            ["issuer", "subject", "provider", "audience"],
            unique=True,
        )

    op.create_table(
        "flows",
        sa.Column("id", sa.String(length=64), nullable=False),
        sa.Column("issuer", sa.String(length=255), nullable=False),
        sa.Column("subject", sa.String(length=255), nullable=False),
        sa.Column("client_id", sa.String(length=255), nullable=False),
        sa.Column("client_name", sa.String(length=255), nullable=True),
        sa.Column("audience", sa.String(length=64), nullable=False),
        sa.Column("provider", sa.String(length=64), nullable=False),
        sa.Column("scopes", sa.Text(), nullable=False),
        sa.Column("tool_name", sa.String(length=128), nullable=False),
        sa.Column("args_digest", sa.String(length=64), nullable=False),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("state_digest", sa.String(length=64), nullable=True),
        sa.Column("sealed_pkce_verifier", sa.Text(), nullable=True),
        sa.Column("failure", sa.String(length=64), nullable=True),
        sa.Column("account_label", sa.String(length=255), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("expires_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("completed_at", sa.DateTime(timezone=True), nullable=True),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_flows")),
        sa.UniqueConstraint("state_digest", name=op.f("uq_flows_state_digest")),
    )
    with op.batch_alter_table("flows", schema=None) as batch_op:
        batch_op.create_index("ix_flows_status_expires_at", ["status", "expires_at"], unique=False)

    op.create_table(
        "login_sessions",
        sa.Column("id_digest", sa.String(length=64), nullable=False),
        sa.Column("issuer", sa.String(length=255), nullable=False),
        sa.Column("subject", sa.String(length=255), nullable=False),
        sa.Column("display_name", sa.String(length=255), nullable=True),
        sa.Column("auth_time", sa.DateTime(timezone=True), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("expires_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("id_digest", name=op.f("pk_login_sessions")),
    )
    with op.batch_alter_table("login_sessions", schema=None) as batch_op:
        batch_op.create_index(
            batch_op.f("ix_login_sessions_expires_at"), ["expires_at"], unique=False
        )


def downgrade() -> None:

    with op.batch_alter_table("login_sessions", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_login_sessions_expires_at"))

    op.drop_table("login_sessions")
    with op.batch_alter_table("flows", schema=None) as batch_op:
        batch_op.drop_index("ix_flows_status_expires_at")

    op.drop_table("flows")
    with op.batch_alter_table("connections", schema=None) as batch_op:
        batch_op.drop_index("uq_connections_owner_provider")

    op.drop_table("connections")
