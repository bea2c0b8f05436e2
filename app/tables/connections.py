"""Every statement on `connections`.

The hot read (`HOT_COLUMNS`, labelled `connection_<column>`) is the same wherever a connection is
read beside something else: alone, with a flow, with the service that made it.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import (
    ColumnElement,
    Delete,
    Insert,
    Select,
    Text,
    Update,
    and_,
    bindparam,
    delete,
    func,
    or_,
    select,
    true,
    update,
)
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.dialects.postgresql import ARRAY

from app.auth.principal import Principal
from app.models import Connection
from app.tables import Rows, inline

PREFIX = "connection_"
HOT_COLUMNS = (
    Connection.id,
    Connection.status,
    Connection.sealed_credential,
    Connection.scopes,
    Connection.account_label,
    Connection.expires_at,
)
KEY = ("issuer", "subject", "provider", "audience")
Value = Any  # a column, or a value bound


def owned(issuer: Any, subject: Any, provider: Any, audience: Any) -> ColumnElement[bool]:
    """The connection of (issuer, subject, provider, audience): one probe of its unique index."""
    return and_(
        Connection.issuer == issuer,
        Connection.subject == subject,
        Connection.provider == provider,
        Connection.audience == audience,
    )


def with_connection(
    statement: Rows,
    issuer: Value,
    subject: Value,
    provider: Value,
    audience: Value,
    *,
    lateral: bool,
) -> Rows:
    """`statement` with the matching connection's HOT_COLUMNS added (NULL when there is none).

    `lateral` (PostgreSQL): through `LEFT JOIN LATERAL (… LIMIT 1)`, a probe of the unique index
    per row whatever the table statistics say, never a hash join over the whole table. Otherwise
    (SQLite) a plain left join on the same condition.
    """
    if lateral:
        found = (
            select(*HOT_COLUMNS).where(owned(issuer, subject, provider, audience)).limit(inline(1))
        )
        side = found.lateral("c")
        joined = statement.outerjoin(side, true())
        return joined.add_columns(*(side.c[c.key].label(PREFIX + c.key) for c in HOT_COLUMNS))
    joined = statement.outerjoin(Connection, owned(issuer, subject, provider, audience))
    return joined.add_columns(*(c.label(PREFIX + c.key) for c in HOT_COLUMNS))


def find_one() -> Rows:
    """The hot read of one connection, by the bound (issuer, subject, provider, audience)."""
    key = [bindparam(name, type_=Text) for name in KEY]
    return select(*(c.label(PREFIX + c.key) for c in HOT_COLUMNS)).where(owned(*key))


def find_many() -> Rows:
    """`find_one` for arrays of keys (one per call, bound as the arrays `issuer`, …): the call's
    position `n` (from 1), then the connection's columns (NULL when there is none)."""
    arrays = [bindparam(name, type_=ARRAY(Text)) for name in KEY]
    keys = func.unnest(*arrays).table_valued(*KEY, with_ordinality="n").render_derived(name="k")
    calls = select(keys.c.n).select_from(keys)
    return with_connection(calls, *(keys.c[name] for name in KEY), lateral=True)


def find(
    principal: Principal, provider: str, audience: str, *, for_update: bool
) -> Select[Connection]:
    statement = select(Connection).where(
        owned(principal.issuer, principal.subject, provider, audience)
    )
    return statement.with_for_update() if for_update else statement


def upsert(dialect: str, values: dict[str, Any]) -> Insert:
    """Insert the row, or replace all but its key and creation time."""
    insert = postgresql.insert if dialect == "postgresql" else sqlite.insert
    replaced = {k: v for k, v in values.items() if k not in (*KEY, "created_at")}
    return (
        insert(Connection)
        .values(**values)
        .on_conflict_do_update(index_elements=list(KEY), set_=replaced)
    )


def of_principal(principal: Principal, audience: str | None) -> Select[Connection]:
    """The principal's connections made through `audience` (None: any), in a stable order."""
    statement = select(Connection).where(
        Connection.issuer == principal.issuer, Connection.subject == principal.subject
    )
    if audience is not None:
        statement = statement.where(Connection.audience == audience)
    return statement.order_by(Connection.provider, Connection.audience)


def remove(principal: Principal, provider: str, audience: str) -> Delete:
    return delete(Connection).where(owned(principal.issuer, principal.subject, provider, audience))


def sealed_with_another_key(key_id: str) -> Select[Connection]:
    return select(Connection).where(Connection.key_id != key_id)


def of_user(issuer: str, subject: str) -> Select[Connection]:
    """Every connection of the user, through any audience, locked (PostgreSQL) for removal."""
    return (
        select(Connection)
        .where(Connection.issuer == issuer, Connection.subject == subject)
        .order_by(Connection.id)
        .with_for_update()
    )


def listing(
    *, issuer: str | None, subject: str | None, provider: str | None, audience: str | None
) -> Select[Connection]:
    """The connections matching every filter given, by user, provider and audience."""
    wanted = {
        Connection.issuer: issuer,
        Connection.subject: subject,
        Connection.provider: provider,
        Connection.audience: audience,
    }
    conditions = [column == value for column, value in wanted.items() if value is not None]
    return (
        select(Connection)
        .where(*conditions)
        .order_by(Connection.issuer, Connection.subject, Connection.provider, Connection.audience)
    )


def idle_since(cutoff: datetime, size: int) -> Select[Connection]:
    """Up to `size` connections neither used nor made since `cutoff`, locked (PostgreSQL),
    skipping rows another transaction holds."""
    last_seen = func.coalesce(Connection.last_used_at, Connection.created_at)
    return (
        select(Connection)
        .where(last_seen < cutoff)
        .order_by(Connection.id)
        .limit(size)
        .with_for_update(skip_locked=True)
    )


def mark_used(ids: list[int], day: datetime) -> Update:
    """Record `day` as the last use of the connections `ids` not recorded as used on it yet
    (another process may have)."""
    return (
        update(Connection)
        .where(
            Connection.id.in_(ids),
            or_(Connection.last_used_at.is_(None), Connection.last_used_at < day),
        )
        .values(last_used_at=day)
        .execution_options(synchronize_session=False)
    )
