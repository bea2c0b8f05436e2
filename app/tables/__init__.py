"""Every statement on a table, written once in SQLAlchemy Core: one module per table.

`flows`, `connections` and `service_clients`: the sessions execute these statements, and the
direct store (app/direct/) compiles the very same ones once per dialect at start-up. A hot
statement is built from the values it compares with, so its one-call form (bound parameters) and
its batched form (arrays `unnest`ed) are the same definition fed from two sources.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import ColumnElement, Integer, Select, Text, literal

Rows = Select[*tuple[Any, ...]]  # a SELECT of any columns


def inline(value: str | int) -> ColumnElement[Any]:
    """A constant written into the statement's text (the same on every driver), not bound."""
    if isinstance(value, str):
        return literal(str(value), type_=Text, literal_execute=True)  # str(): not an enum
    return literal(value, type_=Integer, literal_execute=True)
