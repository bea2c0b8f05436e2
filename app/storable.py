"""Text the database refuses, refused at the edge instead.

PostgreSQL stores no NUL character in text, and neither database can store an unpaired surrogate
(it is not UTF-8). Such a value reaching a statement fails that statement, and with it whatever
shares it, as a database error. So every surface checks text from outside before any statement:
the integration API through `StorableText` (its 422 problem JSON), the MCP endpoint and the
pages with `unstorable_reason`, each answering in its own wire format.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import AfterValidator


def unstorable_reason(text: str) -> str | None:
    """Why `text` cannot be stored, or None when it can."""
    if "\x00" in text:
        return "contains a NUL character"
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return "contains an unpaired surrogate (not valid Unicode)"
    return None


def _storable(text: str) -> str:
    reason = unstorable_reason(text)
    if reason:
        raise ValueError(f"the value {reason}")
    return text


StorableText = Annotated[str, AfterValidator(_storable)]
