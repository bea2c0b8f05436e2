"""Every statement on `connections`.

The hot read (`HOT_COLUMNS`, labelled `connection_<column>`, and `connection_accounts`) is the
same wherever a connection is read beside something else: alone, with a flow, with the service
that made it. A user may hold several accounts of one provider (one row each, told apart by
`account_id`): the hot read answers the default one, the latest selected (`DEFAULT_FIRST`), and
how many there are, so a user with one account costs no second read.
"""

from __future__ import annotations

from collections.abc import Mapping
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
    case,
    delete,
    func,
    or_,
    select,
    true,
    update,
)
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.dialects.postgresql import ARRAY
from sqlalchemy.orm import aliased

from app.auth.principal import Principal
from app.models import NO_ACCOUNT_ID, Connection
from app.tables import Rows, inline

PREFIX = "connection_"
HOT_COLUMNS = (
    Connection.id,
    Connection.status,
    Connection.sealed_credential,
    Connection.scopes,
    Connection.account_label,
    Connection.account_id,
    Connection.expires_at,
)
ACCOUNTS = "accounts"  # how many accounts the user holds there (labelled `connection_accounts`)
KEY = ("issuer", "subject", "provider", "audience")
Value = Any  # a column, or a value bound
DEFAULT_FIRST = (Connection.selected_at.desc(), Connection.id.desc())


def owned(
    issuer: Any, subject: Any, provider: Any, audience: Any, *, table: Any = Connection
) -> ColumnElement[bool]:
    """The connections of (issuer, subject, provider, audience), one per account: a range of
    the unique index."""
    return and_(
        table.issuer == issuer,
        table.subject == subject,
        table.provider == provider,
        table.audience == audience,
    )


def _default_of(key: tuple[Value, Value, Value, Value]) -> Rows:
    """The key's connections, default account first, each with how many there are."""
    return (
        select(*HOT_COLUMNS, func.count().over().label(ACCOUNTS))
        .where(owned(*key))
        .order_by(*DEFAULT_FIRST)
        .limit(inline(1))
    )


def with_connection(
    statement: Rows,
    issuer: Value,
    subject: Value,
    provider: Value,
    audience: Value,
    *,
    lateral: bool,
    present: Any = None,
) -> Rows:
    """`statement` with the matching default connection's HOT_COLUMNS and account count added
    (NULL and 0 when there is none).

    `lateral` (PostgreSQL): through `LEFT JOIN LATERAL (… ORDER BY … LIMIT 1)`, a probe of the
    unique index per row whatever the table statistics say, never a hash join over the whole
    table. Otherwise (SQLite) a plain left join on the same condition and `_latest_of_group`:
    one aggregate row, kept only when the statement found its row (`present`, a column of it
    never NULL, e.g. its primary key, counts more than nothing; cheaper than a GROUP BY).
    """
    key = (issuer, subject, provider, audience)
    if lateral:
        side = _default_of(key).lateral("c")
        joined = statement.outerjoin(side, true())
        return joined.add_columns(
            *(side.c[c.key].label(PREFIX + c.key) for c in HOT_COLUMNS),
            side.c[ACCOUNTS].label(PREFIX + ACCOUNTS),
        )
    joined = statement.outerjoin(Connection, owned(*key))
    return _latest_of_group(joined).having(func.count(present) > inline(0))


def _latest_of_group(statement: Rows) -> Rows:
    """SQLite: `max(selected_at)` beside the connection's columns makes them the latest
    selected row's (a bare column in an aggregate query takes its values from the row holding
    the maximum: sqlite.org/lang_select.html#bareagg), and `count` the accounts, in one pass
    over the index range without a sort. Twice cheaper than `ORDER BY … LIMIT 1` and a
    correlated count; PostgreSQL has no such rule and takes `_default_of`."""
    return statement.add_columns(
        *(c.label(PREFIX + c.key) for c in HOT_COLUMNS),
        func.count(Connection.id).label(PREFIX + ACCOUNTS),
        func.max(Connection.selected_at).label(PREFIX + "selected_at"),
    )


def find_one() -> Rows:
    """The hot read of the default connection, by the bound (issuer, subject, provider,
    audience), with how many accounts the user holds there (SQLite: one row, its id NULL when
    there is none)."""
    key = [bindparam(name, type_=Text) for name in KEY]
    return _latest_of_group(select().select_from(Connection).where(owned(*key)))


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
    """The default account's connection (`for_update`: locked, PostgreSQL)."""
    return _locked(accounts(principal, provider, audience).limit(1), for_update)


def by_id(connection_id: int, *, for_update: bool) -> Select[Connection]:
    return _locked(select(Connection).where(Connection.id == connection_id), for_update)


def _locked(statement: Select[Connection], for_update: bool) -> Select[Connection]:
    """`statement` locking its rows (PostgreSQL) and reading them afresh: a row the session
    read before the lock was granted may have changed meanwhile (a refresh committed), and the
    session would otherwise keep the values it read then."""
    if not for_update:
        return statement
    return statement.with_for_update().execution_options(populate_existing=True)


def replace_if_unchanged(connection_id: int, sealed: str, values: Mapping[str, Any]) -> Update:
    """Set `values` on the connection if its sealed credential is still `sealed`: nobody
    refreshed, re-sealed, replaced or removed it since it was read (a compare-and-set; SQLite
    takes no row lock)."""
    return (
        update(Connection)
        .where(Connection.id == connection_id, Connection.sealed_credential == sealed)
        .values(**values)
        .execution_options(synchronize_session=False)
    )


def accounts(principal: Principal, provider: str, audience: str) -> Select[Connection]:
    """Every account of the principal at `provider` through `audience`, the default first."""
    return (
        select(Connection)
        .where(owned(principal.issuer, principal.subject, provider, audience))
        .order_by(*DEFAULT_FIRST)
    )


def upsert(dialect: str, values: dict[str, Any]) -> Insert:
    """Insert the row, or replace all but its key, account and creation time (the same upstream
    account connected again)."""
    insert = postgresql.insert if dialect == "postgresql" else sqlite.insert
    unique = (*KEY, "account_id")
    replaced = {k: v for k, v in values.items() if k not in (*unique, "created_at")}
    return (
        insert(Connection)
        .values(**values)
        .on_conflict_do_update(index_elements=list(unique), set_=replaced)
    )


def _adoptable(key: tuple[str, str, str, str], account_id: str, label: str) -> ColumnElement[bool]:
    """A connection of `key` made before accounts were told apart (empty `account_id`), with the
    account label of a new grant of `account_id`, while that account is not connected: the
    grant takes it over (`adopt_unidentified`) rather than adding a second row for it."""
    other = aliased(Connection)
    taken = select(other.id).where(owned(*key, table=other), other.account_id == account_id)
    return and_(
        Connection.account_id == NO_ACCOUNT_ID,
        Connection.account_label == label,
        ~taken.exists(),
    )


def replaced_by_grant(
    principal: Principal, provider: str, audience: str, account_id: str, label: str | None
) -> Select[Connection]:
    """The user's connection a new grant of the upstream account `account_id` (labelled
    `label`) is about to replace: the one of that account, or the unidentified one it adopts.
    Locked (PostgreSQL) until the transaction ends."""
    key = (principal.issuer, principal.subject, provider, audience)
    same = Connection.account_id == account_id
    replaced = same if label is None else or_(same, _adoptable(key, account_id, label))
    return _locked(select(Connection).where(owned(*key), replaced), for_update=True)


def adopt_unidentified(
    principal: Principal, provider: str, audience: str, account_id: str, label: str
) -> Update:
    """Give the unidentified connection a new grant of `account_id` takes over (`_adoptable`)
    that id: the grant then replaces it."""
    key = (principal.issuer, principal.subject, provider, audience)
    return (
        update(Connection)
        .where(owned(*key), _adoptable(key, account_id, label))
        .values(account_id=account_id)
        .execution_options(synchronize_session=False)
    )


def select_account(connection_id: int, now: datetime) -> Update:
    """Make the connection its user's default account at its provider."""
    return (
        update(Connection)
        .where(Connection.id == connection_id)
        .values(selected_at=now)
        .execution_options(synchronize_session=False)
    )


def of_principal(principal: Principal, audience: str | None) -> Select[Connection]:
    """The principal's connections made through `audience` (None: any), in a stable order."""
    statement = select(Connection).where(
        Connection.issuer == principal.issuer, Connection.subject == principal.subject
    )
    if audience is not None:
        statement = statement.where(Connection.audience == audience)
    return statement.order_by(Connection.provider, Connection.audience, *DEFAULT_FIRST)


def remove(connection_id: int) -> Delete:
    return delete(Connection).where(Connection.id == connection_id)


def holds_account(provider: str, account_id: str) -> Select[tuple[bool]]:
    """Whether a connection holds the upstream account `account_id` at `provider`, for any user
    and through any audience (how far revoking one of its tokens may reach)."""
    holders = select(Connection.id).where(
        Connection.provider == provider, Connection.account_id == account_id
    )
    return select(holders.exists())


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
        .order_by(
            Connection.issuer,
            Connection.subject,
            Connection.provider,
            Connection.audience,
            *DEFAULT_FIRST,
        )
    )


def idle_since(cutoff: datetime, size: int) -> Select[Connection]:
    """Up to `size` connections neither used nor connected or chosen by their user since
    `cutoff` (the later of `last_used_at` and `selected_at`: a grant of the same account again
    counts as activity), locked (PostgreSQL), skipping rows another transaction holds."""
    used_last = Connection.last_used_at > Connection.selected_at  # NULL when never used
    last_seen = case((used_last, Connection.last_used_at), else_=Connection.selected_at)
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
