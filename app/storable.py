"""Text the database refuses, refused at the edge instead.

PostgreSQL stores no NUL character in text, and neither database can store an unpaired surrogate
(it is not UTF-8). Such a value reaching a statement fails that statement, and with it whatever
shares it, as a database error. So every surface checks text from outside before any statement:
the integration API through `StorableText` (its 422 problem JSON), the MCP endpoint and the
pages with `unstorable_reason`, each answering in its own wire format. An identity claim, the
subject of every principal stored, is checked with `unstorable_subject_reason` wherever it comes
in (an access token, the browser login's ID token).
"""

from __future__ import annotations

from typing import Annotated

from pydantic import AfterValidator

MAX_SUBJECT_LENGTH = 255  # the subject columns (String(255)): flows, connections, login sessions


def unstorable_reason(text: str, *, allow_nul: bool = False) -> str | None:
    """What in `text` the database would refuse, or None: an unpaired surrogate (what the JSON
    escape `\\ud800` decodes to; no UTF-8 encoder writes one) or, unless `allow_nul`, a NUL."""
    if not allow_nul and "\x00" in text:
        return "a NUL character (\\u0000)"
    if not text.isascii():
        try:
            text.encode()
        except UnicodeEncodeError:
            return "an unpaired surrogate (\\ud800-\\udfff)"
    return None


def unstorable_subject_reason(subject: str) -> str | None:
    """What keeps `subject` from being a stored principal's subject, or None: it must be 1-255
    characters (the columns' width) of text the database takes (`unstorable_reason`)."""
    if not subject:
        return "no character"
    if len(subject) > MAX_SUBJECT_LENGTH:
        return f"more than {MAX_SUBJECT_LENGTH} characters"
    return unstorable_reason(subject)


def _storable(text: str) -> str:
    reason = unstorable_reason(text)
    if reason:
        raise ValueError(f"the value must not hold {reason}")
    return text


StorableText = Annotated[str, AfterValidator(_storable)]
