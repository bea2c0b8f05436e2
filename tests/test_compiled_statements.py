"""The direct store runs the tables' own Core statements (app/tables/), compiled per driver, and
reads their rows by column name: moving or adding a column in a statement cannot shift a field."""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime
from typing import Any

import pytest
from sqlalchemy import Insert, Select

from app.direct import postgres as postgres_store
from app.direct import sqlite as sqlite_store
from app.direct.compiled import Compiled
from app.direct.records import RowReader
from app.tables import Rows
from app.tables import audit as audit_table
from app.tables import connections as connections_table
from app.tables import flows as flows_table
from app.tables import services as services_table

pytestmark = pytest.mark.both_databases

KEY = ("issuer-value", "subject-value", "provider-value", "audience-value")
DIALECTS = {"sqlite": sqlite_store.DIALECT, "postgresql": postgres_store.DIALECT}


def named_row(compiled: Compiled) -> list[str]:
    """A row whose every value is its own column's name."""
    row = [""] * len(compiled.columns)
    for name, position in compiled.columns.items():
        row[position] = name
    return row


def as_time(value: Any) -> datetime:
    return value  # type: ignore[no-any-return] # the row's names stand in for times


def reversed_columns(statement: Rows) -> Rows:
    return statement.with_only_columns(*reversed(list(statement.selected_columns)))


def same_order(statement: Rows) -> Rows:
    return statement


READS: dict[str, tuple[Callable[[], Rows], str]] = {
    "find_connection_one": (connections_table.find_one, "sqlite"),
    "find_connection_many": (connections_table.find_many, "postgresql"),
    "read_flow_one": (flows_table.read_one, "sqlite"),
    "read_flow_many": (flows_table.read_many, "postgresql"),
    "reusable_flow_sqlite": (flows_table.reusable_one, "sqlite"),
    "reusable_flow_postgresql": (flows_table.reusable_one, "postgresql"),
    "find_service_with_connection_one": (services_table.find_with_connection_one, "sqlite"),
    "find_service_with_connection_many": (services_table.find_with_connection_many, "postgresql"),
}


def compiled_read(name: str, order: Callable[[Rows], Rows]) -> tuple[Compiled, RowReader]:
    build, dialect = READS[name]
    expand = {"digests": 2} if name == "find_service_with_connection_one" else None
    compiled = Compiled(order(build()), DIALECTS[dialect], expand=expand)
    return compiled, RowReader(compiled, as_time)


@pytest.mark.parametrize("order", [same_order, reversed_columns])
@pytest.mark.parametrize("name", ["find_connection_one", "find_connection_many"])
def test_a_connection_is_read_by_column_name(name: str, order: Callable[[Rows], Rows]) -> None:
    compiled, read = compiled_read(name, order)
    record = read.connection(KEY, named_row(compiled))
    assert record is not None
    assert (record.issuer, record.subject, record.provider, record.audience) == KEY
    fields = (
        *("id", "status", "sealed_credential", "scopes", "account_label", "account_id"),
        *("expires_at", "accounts"),
    )
    assert [getattr(record, field) for field in fields] == [f"connection_{f}" for f in fields]


@pytest.mark.parametrize("order", [same_order, reversed_columns])
@pytest.mark.parametrize("name", ["read_flow_one", "read_flow_many"])
def test_a_flow_and_its_connection_are_read_by_column_name(
    name: str, order: Callable[[Rows], Rows]
) -> None:
    compiled, read = compiled_read(name, order)
    flow, connection = read.flow_and_connection(named_row(compiled))
    fields = [
        *("id", "issuer", "subject", "client_id", "client_name", "audience", "provider"),
        *("scopes", "status", "account_label", "failure", "expires_at"),
    ]
    assert [getattr(flow, field) for field in fields] == fields
    assert connection is not None
    assert (connection.issuer, connection.provider) == ("issuer", "provider")
    assert connection.sealed_credential == "connection_sealed_credential"
    assert connection.expires_at == "connection_expires_at"


@pytest.mark.parametrize("order", [same_order, reversed_columns])
@pytest.mark.parametrize("name", ["reusable_flow_sqlite", "reusable_flow_postgresql"])
def test_a_reusable_flow_is_read_by_column_name(name: str, order: Callable[[Rows], Rows]) -> None:
    compiled, read = compiled_read(name, order)
    flow = read.flow(named_row(compiled))
    fields = [
        *("id", "issuer", "subject", "client_id", "client_name", "audience", "provider"),
        *("scopes", "status", "account_label", "failure", "expires_at"),
    ]
    assert [getattr(flow, field) for field in fields] == fields


@pytest.mark.parametrize("order", [same_order, reversed_columns])
@pytest.mark.parametrize(
    "name", ["find_service_with_connection_one", "find_service_with_connection_many"]
)
def test_a_service_and_its_connection_are_read_by_column_name(
    name: str, order: Callable[[Rows], Rows]
) -> None:
    compiled, read = compiled_read(name, order)
    service, connection = read.service_and_connection(KEY[:3], named_row(compiled))
    assert (service.name, service.providers) == ("name", "providers")
    assert connection is not None
    assert connection.audience == "name"  # the service's own connection
    assert connection.scopes == "connection_scopes"


def test_a_row_without_a_connection_reads_as_none() -> None:
    compiled, read = compiled_read("read_flow_one", same_order)
    row: list[Any] = named_row(compiled)
    for name, position in compiled.columns.items():
        if name.startswith(connections_table.PREFIX):
            row[position] = None
    _, connection = read.flow_and_connection(row)
    assert connection is None


def test_a_reader_refuses_a_statement_missing_a_column_it_reads() -> None:
    statement = flows_table.read_one()
    without = statement.with_only_columns(
        *(column for column in statement.selected_columns if column.key != "failure")
    )
    with pytest.raises(KeyError):
        RowReader(Compiled(without, sqlite_store.DIALECT), as_time)


@pytest.mark.parametrize(
    ("statement", "dialect"),
    [(flows_table.insert_one, "sqlite"), (flows_table.insert_many, "postgresql")],
)
def test_the_open_statuses_are_written_into_the_insert_on_both_drivers(
    statement: Callable[[], Insert], dialect: str
) -> None:
    sql = Compiled(statement(), DIALECTS[dialect]).sql
    assert "status IN ('pending', 'authorizing', 'exchanging')" in sql


def test_parameters_bind_by_name_in_the_statement_s_order() -> None:
    compiled = sqlite_store.FIND_CONNECTION
    params = dict(zip(connections_table.KEY, KEY, strict=True))
    assert compiled.values(params) == KEY
    assert compiled.values(dict(reversed(params.items()))) == KEY


def test_an_expanded_list_takes_one_parameter_per_item() -> None:
    compiled = Compiled(services_table.find_one(), sqlite_store.DIALECT, expand={"digests": 3})
    assert compiled.sql.count("?") == 4  # three digests; the OFFSET sqlite adds to a LIMIT
    assert compiled.values({"digests": ["a", "b", "c"]})[:3] == ("a", "b", "c")
    with pytest.raises(ValueError, match="shorter"):
        compiled.values({"digests": ["a", "b"]})


def test_the_stores_run_the_statements_of_the_tables() -> None:
    """No second text: each store's statement is the compiled table statement."""
    pairs: list[tuple[Compiled, Select[Any] | Insert, str]] = [
        (sqlite_store.FIND_CONNECTION, connections_table.find_one(), "sqlite"),
        (sqlite_store.INSERT_FLOW, flows_table.insert_one(), "sqlite"),
        (sqlite_store.RECORD_NEW_FLOW, audit_table.for_new_flow(), "sqlite"),
        (sqlite_store.GET_FLOW_AND_CONNECTION, flows_table.read_one(), "sqlite"),
        (sqlite_store.FIND_REUSABLE_FLOW, flows_table.reusable_one(), "sqlite"),
        (postgres_store.FIND_REUSABLE_FLOW, flows_table.reusable_one(), "postgresql"),
        (postgres_store.FIND_CONNECTIONS, connections_table.find_many(), "postgresql"),
        (
            postgres_store.INSERT_FLOWS,
            audit_table.with_new_flows(flows_table.insert_many()),
            "postgresql",
        ),
        (postgres_store.GET_FLOWS_AND_CONNECTIONS, flows_table.read_many(), "postgresql"),
    ]
    for compiled, statement, dialect in pairs:
        assert compiled.sql == Compiled(statement, DIALECTS[dialect]).sql
