"""connections: several accounts per provider

A user may connect several accounts of one provider (work and personal GitHub). `account_id` is
the account's identity at the provider; the unique index now includes it, so a grant for the same
upstream account replaces its connection and one for another account adds a connection.
Connections made before carry the empty id ("not known"): they keep working, and the next grant
whose account label matches takes them over. `selected_at` orders a user's accounts (the latest
connected or chosen is the default); `account_choices` remembers the account a user chose for an
MCP client.

Revision ID: 0010
Revises: 0009
Create Date: 2026-12-06 20:00:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0010"
down_revision: str | None = "0009"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

OWNER = ["issuer", "subject", "provider", "audience"]


def upgrade() -> None:
    with op.batch_alter_table("connections") as batch:
        batch.add_column(sa.Column("account_id", sa.String(255), nullable=False, server_default=""))
        batch.add_column(sa.Column("selected_at", sa.DateTime(timezone=True), nullable=True))
    op.execute("UPDATE connections SET selected_at = updated_at")
    with op.batch_alter_table("connections") as batch:
        batch.alter_column("selected_at", existing_type=sa.DateTime(timezone=True), nullable=False)
        batch.alter_column("account_id", existing_type=sa.String(255), server_default=None)
        batch.drop_index("uq_connections_owner_provider")
        batch.create_index("uq_connections_owner_account", [*OWNER, "account_id"], unique=True)
    op.create_table(
        "account_choices",
        sa.Column("issuer", sa.String(255), nullable=False),
        sa.Column("subject", sa.String(255), nullable=False),
        sa.Column("client_id", sa.String(255), nullable=False),
        sa.Column("provider", sa.String(64), nullable=False),
        sa.Column("account_id", sa.String(255), nullable=False),
        sa.Column("chosen_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint(
            "issuer", "subject", "client_id", "provider", name="pk_account_choices"
        ),
    )


def downgrade() -> None:
    """Keeps the latest selected account of each (user, provider, audience)."""
    op.drop_table("account_choices")
    op.execute(
        "DELETE FROM connections WHERE EXISTS (SELECT 1 FROM connections AS later"
        " WHERE later.issuer = connections.issuer AND later.subject = connections.subject"
        " AND later.provider = connections.provider AND later.audience = connections.audience"
        " AND (later.selected_at > connections.selected_at OR (later.selected_at ="
        " connections.selected_at AND later.id > connections.id)))"
    )
    with op.batch_alter_table("connections") as batch:
        batch.drop_index("uq_connections_owner_account")
        batch.create_index("uq_connections_owner_provider", OWNER, unique=True)
        batch.drop_column("selected_at")
        batch.drop_column("account_id")
