"""Every table. The same schema on SQLite and PostgreSQL (built by the Alembic migrations)."""

from __future__ import annotations

import re
from datetime import UTC, datetime
from enum import StrEnum
from typing import Any

from sqlalchemy import (
    BigInteger,
    Boolean,
    DateTime,
    Index,
    Integer,
    MetaData,
    String,
    Text,
    TypeDecorator,
    text,
    true,
)
from sqlalchemy.engine import Dialect
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

NAMING_CONVENTION = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}


class UtcDateTime(TypeDecorator[datetime]):
    """Aware UTC datetimes on every backend (SQLite stores them naive)."""

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            raise ValueError("naive datetime")
        value = value.astimezone(UTC)
        return value.replace(tzinfo=None) if dialect.name == "sqlite" else value

    def process_result_value(self, value: Any, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        assert isinstance(value, datetime)
        return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING_CONVENTION)


class FlowStatus(StrEnum):
    pending = "pending"
    authorizing = "authorizing"
    exchanging = "exchanging"
    completed = "completed"
    consumed = "consumed"
    declined = "declined"
    cancelled = "cancelled"
    failed = "failed"
    expired = "expired"


BROKER_AUDIENCE = "mcp"  # the audience of what the broker's own MCP endpoint creates
# A registered service's name (`connect-broker service create`), also the audience of the
# connections that service makes
SERVICE_NAME = re.compile(r"[a-z][a-z0-9_-]{0,63}")
OPEN_FLOW_STATUSES = (FlowStatus.pending, FlowStatus.authorizing, FlowStatus.exchanging)
DONE_FLOW_STATUSES = (FlowStatus.completed, FlowStatus.consumed)


class Flow(Base):
    """One connect interaction: started by a tool call, finished in the user's browser."""

    __tablename__ = "flows"
    __table_args__ = (
        Index("ix_flows_status_expires_at", "status", "expires_at"),
        # the open-flow cap per user and audience counts from this index alone
        Index("ix_flows_owner_open", "issuer", "subject", "audience", "status", "expires_at"),
        # only flows waiting at an OAuth provider have a state digest: NULLs are not indexed
        Index(
            "uq_flows_state_digest",
            "state_digest",
            unique=True,
            sqlite_where=text("state_digest IS NOT NULL"),
            postgresql_where=text("state_digest IS NOT NULL"),
        ),
    )

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    issuer: Mapped[str] = mapped_column(String(255))
    subject: Mapped[str] = mapped_column(String(255))
    client_id: Mapped[str] = mapped_column(String(255))
    client_name: Mapped[str | None] = mapped_column(String(255))
    audience: Mapped[str] = mapped_column(String(64), default=BROKER_AUDIENCE)
    provider: Mapped[str] = mapped_column(String(64))
    scopes: Mapped[str] = mapped_column(Text, default="")
    tool_name: Mapped[str] = mapped_column(String(128))
    args_digest: Mapped[str] = mapped_column(String(64))
    status: Mapped[str] = mapped_column(String(16), default=FlowStatus.pending)
    state_digest: Mapped[str | None] = mapped_column(String(64))
    sealed_pkce_verifier: Mapped[str | None] = mapped_column(Text)
    failure: Mapped[str | None] = mapped_column(String(64))
    account_label: Mapped[str | None] = mapped_column(String(255))
    created_at: Mapped[datetime] = mapped_column(UtcDateTime)
    updated_at: Mapped[datetime] = mapped_column(UtcDateTime)
    expires_at: Mapped[datetime] = mapped_column(UtcDateTime)
    completed_at: Mapped[datetime | None] = mapped_column(UtcDateTime)

    def __repr__(self) -> str:
        return f"Flow(provider={self.provider!r}, status={self.status!r})"


class ConnectionStatus(StrEnum):
    active = "active"
    needs_reauth = "needs_reauth"


NO_ACCOUNT_ID = ""  # the provider did not say which account it is (API keys; connections of old)


class Connection(Base):
    """A user's standing grant to one account at a provider, as made through one audience (broker
    or sibling). A user may hold several accounts of one provider, told apart by `account_id`, the
    account's identity at the provider (GitHub's numeric user id, an ID token's `sub`)."""

    __tablename__ = "connections"
    __table_args__ = (
        Index(
            "uq_connections_owner_account",
            "issuer",
            "subject",
            "provider",
            "audience",
            "account_id",
            unique=True,
        ),
        # whether another connection holds the same upstream account (a revocation's scope)
        Index("ix_connections_provider_account", "provider", "account_id"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    issuer: Mapped[str] = mapped_column(String(255))
    subject: Mapped[str] = mapped_column(String(255))
    provider: Mapped[str] = mapped_column(String(64))
    audience: Mapped[str] = mapped_column(String(64), default=BROKER_AUDIENCE)
    status: Mapped[str] = mapped_column(String(16), default=ConnectionStatus.active)
    sealed_credential: Mapped[str] = mapped_column(Text)  # unsealed only in app/credentials.py
    key_id: Mapped[str] = mapped_column(String(32))
    scopes: Mapped[str] = mapped_column(Text, default="")
    account_label: Mapped[str | None] = mapped_column(String(255))
    account_id: Mapped[str] = mapped_column(String(255), default=NO_ACCOUNT_ID)
    expires_at: Mapped[datetime | None] = mapped_column(UtcDateTime)
    created_at: Mapped[datetime] = mapped_column(UtcDateTime)
    updated_at: Mapped[datetime] = mapped_column(UtcDateTime)
    # when the user last connected or chose this account: the latest is the default account
    selected_at: Mapped[datetime] = mapped_column(UtcDateTime)
    # the day (midnight UTC) it was last used, written by the housekeeping from what each
    # process noted (app/connect/idle.py), never by the credential fetch itself
    last_used_at: Mapped[datetime | None] = mapped_column(UtcDateTime)

    def __repr__(self) -> str:
        return f"Connection(id={self.id}, provider={self.provider!r}, status={self.status!r})"


class AccountChoice(Base):
    """The account a user chose for one MCP client (the access token's client id) and provider,
    kept until that account is disconnected."""

    __tablename__ = "account_choices"

    issuer: Mapped[str] = mapped_column(String(255), primary_key=True)
    subject: Mapped[str] = mapped_column(String(255), primary_key=True)
    client_id: Mapped[str] = mapped_column(String(255), primary_key=True)
    provider: Mapped[str] = mapped_column(String(64), primary_key=True)
    account_id: Mapped[str] = mapped_column(String(255))
    chosen_at: Mapped[datetime] = mapped_column(UtcDateTime)

    def __repr__(self) -> str:
        return f"AccountChoice(provider={self.provider!r})"


class PendingRevocation(Base):
    """A grant a disconnect deleted here but the provider has not yet confirmed revoking (or
    tokens the broker did not keep, whose first revocation failed).

    Written in the transaction that deletes the connection, with the connection's sealed tokens
    (same associated data), so a process that stops before the provider answers leaves the work
    behind: app/connect/revocations.py retries it until confirmed or given up.
    """

    __tablename__ = "pending_revocations"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    issuer: Mapped[str] = mapped_column(String(255))
    subject: Mapped[str] = mapped_column(String(255))
    provider: Mapped[str] = mapped_column(String(64))
    audience: Mapped[str] = mapped_column(String(64))
    sealed_credential: Mapped[str] = mapped_column(Text)  # unsealed only in app/credentials.py
    key_id: Mapped[str] = mapped_column(String(32))
    # False: revoke this token only (it replaced another of the same account, or the account is
    # not known); each attempt narrows it further while a connection holds the account
    whole_grant: Mapped[bool] = mapped_column(Boolean, server_default=true())
    # the upstream account (NO_ACCOUNT_ID: not known), for the attempt's check of its holders
    account_id: Mapped[str] = mapped_column(String(255), server_default=NO_ACCOUNT_ID)
    attempts: Mapped[int] = mapped_column(Integer, default=0)
    last_error: Mapped[str | None] = mapped_column(String(64))
    next_attempt_at: Mapped[datetime] = mapped_column(UtcDateTime, index=True)
    created_at: Mapped[datetime] = mapped_column(UtcDateTime)

    def __repr__(self) -> str:
        return f"PendingRevocation(id={self.id}, provider={self.provider!r})"


class LoginSession(Base):
    """A browser's login at the broker; the cookie holds a random id, this row its digest."""

    __tablename__ = "login_sessions"

    id_digest: Mapped[str] = mapped_column(String(64), primary_key=True)
    issuer: Mapped[str] = mapped_column(String(255))
    subject: Mapped[str] = mapped_column(String(255))
    display_name: Mapped[str | None] = mapped_column(String(255))
    auth_time: Mapped[datetime] = mapped_column(UtcDateTime)
    created_at: Mapped[datetime] = mapped_column(UtcDateTime)
    expires_at: Mapped[datetime] = mapped_column(UtcDateTime, index=True)


class ServiceClient(Base):
    """A sibling MCP server allowed to use the integration API; only a digest of its secret."""

    __tablename__ = "service_clients"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    name: Mapped[str] = mapped_column(String(64), unique=True)
    secret_digest: Mapped[str] = mapped_column(String(64), unique=True)
    providers: Mapped[str] = mapped_column(Text, default="")  # space-separated; empty = all
    created_at: Mapped[datetime] = mapped_column(UtcDateTime)
    revoked_at: Mapped[datetime | None] = mapped_column(UtcDateTime)

    def __repr__(self) -> str:
        return f"ServiceClient(name={self.name!r})"


class ActorKind(StrEnum):
    user = "user"  # the end user, through the broker's MCP endpoint or pages
    service = "service"  # a sibling MCP server, through the integration API
    operator = "operator"  # a person running the CLI or calling the admin API
    broker = "broker"  # the broker on its own: refreshes, sweeps, retries


class AuditEvent(Base):
    """One lifecycle event: who did what to whose connection or flow. Never a secret.

    `issuer`/`subject` name the user the event concerns (None for service and key events);
    `detail` is a short, broker-made reason (a failure code, a count), never request input.
    """

    __tablename__ = "audit_events"
    __table_args__ = (
        Index("ix_audit_events_user", "issuer", "subject", "occurred_at"),
        # the webhooks' reading order on PostgreSQL (app/tables/webhooks.py); empty on SQLite
        Index(
            "ix_audit_events_txid",
            "txid",
            "id",
            postgresql_where=text("txid IS NOT NULL"),
            sqlite_where=text("txid IS NOT NULL"),
        ),
        # SQLite: an id is never used twice, even after the newest event is deleted (erasure)
        {"sqlite_autoincrement": True},
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    # PostgreSQL: the id of the transaction that wrote the row (a server default set by the
    # migration, `pg_current_xact_id()`); NULL on SQLite, where writers take turns
    txid: Mapped[int | None] = mapped_column(BigInteger)
    occurred_at: Mapped[datetime] = mapped_column(UtcDateTime, index=True)
    event: Mapped[str] = mapped_column(String(64))
    actor_kind: Mapped[str] = mapped_column(String(16))
    actor_id: Mapped[str] = mapped_column(String(511))
    issuer: Mapped[str | None] = mapped_column(String(255))
    subject: Mapped[str | None] = mapped_column(String(255))
    provider: Mapped[str | None] = mapped_column(String(64))
    audience: Mapped[str | None] = mapped_column(String(64))
    account_label: Mapped[str | None] = mapped_column(String(255))
    detail: Mapped[str | None] = mapped_column(String(128))
    request_id: Mapped[str | None] = mapped_column(String(32))

    def __repr__(self) -> str:
        return f"AuditEvent(id={self.id}, event={self.event!r})"


class WebhookDelivery(Base):
    """Where one configured webhook is in the stream of audit events (app/webhooks/).

    The cursor (`after_txid`, `after_id`) is the last event delivered or given up; the event
    after it is the head, tried `attempts` times (counted for `head_id` only), next due at
    `next_attempt_at`, which a process claiming the webhook moves ahead for as long as it works.
    """

    __tablename__ = "webhook_deliveries"

    webhook: Mapped[str] = mapped_column(String(64), primary_key=True)
    after_txid: Mapped[int] = mapped_column(BigInteger, default=0)
    after_id: Mapped[int] = mapped_column(BigInteger, default=0)
    head_id: Mapped[int | None] = mapped_column(BigInteger)
    attempts: Mapped[int] = mapped_column(Integer, default=0)
    last_error: Mapped[str | None] = mapped_column(String(64))
    next_attempt_at: Mapped[datetime] = mapped_column(UtcDateTime)
    created_at: Mapped[datetime] = mapped_column(UtcDateTime)

    def __repr__(self) -> str:
        return f"WebhookDelivery(webhook={self.webhook!r}, after_id={self.after_id})"
