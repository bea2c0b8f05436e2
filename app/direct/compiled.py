"""The tables' Core statements (app/tables/), compiled once for a driver.

A `Compiled` is the driver's SQL text for one statement, the order its parameters bind in, and
where each result column sits, by name: the store binds a call's values by name and reads a row by
name, and neither can drift from the statement's definition. Constants the statement carries (a
`LIMIT 1`'s parameter, say) are bound from the compiled statement itself.

A list bound to `IN` (`bindparam(…, expanding=True)`) needs one text per length: `compile_for`
takes the lengths to expand to, and the stores keep one `Compiled` per length.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from operator import itemgetter
from typing import Any

from sqlalchemy import Insert
from sqlalchemy.engine import Dialect

from app.tables import Rows

Row = Sequence[Any]
Statement = Rows | Insert


class Compiled:
    """One statement's text for one driver, its parameters in binding order, its columns."""

    __slots__ = ("_bind", "_constants", "_expanded", "columns", "sql")

    def __init__(
        self,
        statement: Statement,
        dialect: Dialect,
        *,
        expand: Mapping[str, int] | None = None,
    ) -> None:
        expand = expand or {}
        compiled = statement.compile(dialect=dialect)
        given = {
            name: [None] * expand[name] if bind.expanding else None
            for name, bind in compiled.binds.items()
            if bind.required
        }
        if set(expand) - set(given):
            raise ValueError(f"nothing to expand: {sorted(set(expand) - set(given))}")
        state = compiled.construct_expanded_state(given)
        order = state.positiontup or []
        self.sql: str = state.statement
        self._expanded = {
            name: [f"{name}_{n}" for n in range(1, count + 1)] for name, count in expand.items()
        }
        expanded = {item for names in self._expanded.values() for item in names}
        self._constants = {
            name: state.parameters[name]
            for name in order
            if name not in given and name not in expanded
        }
        self._bind = _getter(order)
        self.columns: dict[str, int] = _columns(statement)

    def values(self, params: Mapping[str, Any]) -> tuple[Any, ...]:
        """`params` (a value by parameter name; a list for an expanded one) in binding order."""
        merged = {**self._constants, **params}
        for name, names in self._expanded.items():
            merged.update(zip(names, params[name], strict=True))
        return self._bind(merged)

    def reader(self, names: Sequence[str]) -> Callable[[Row], tuple[Any, ...]]:
        """Reads the columns `names` of a row, in that order (KeyError for a name the statement
        does not return)."""
        return _getter([self.columns[name] for name in names])


def _getter(keys: Sequence[Any]) -> Callable[[Any], tuple[Any, ...]]:
    """`itemgetter`, always answering a tuple (itemgetter of one key answers the item alone)."""
    if len(keys) == 1:
        key = keys[0]
        return lambda items: (items[key],)
    if not keys:
        return lambda _items: ()
    return itemgetter(*keys)


def _columns(statement: Statement) -> dict[str, int]:
    keys = [str(column.key) for column in statement.exported_columns]
    if len(set(keys)) != len(keys):
        raise ValueError(f"two result columns share a name: {keys}")
    return {key: position for position, key in enumerate(keys)}
