"""Text from outside (client names, IdP and provider names, account labels) made safe to show.

Escaping stops markup, not deception: a bidi control (U+202E) in a client's name reverses the
broker's own sentence around it, and invisible characters make two names look alike. Such
characters are shown visibly instead (`[U+202E]`), line breaks and other spacing become one
space, and a value longer than its limit is cut with an ellipsis.
"""

from __future__ import annotations

import unicodedata

NAME_LIMIT = 100
# Cc controls, Cf format characters (bidi controls, zero-width joiners), surrogates, private-use
# and unassigned code points, line and paragraph separators: never shown as themselves.
HIDDEN_CATEGORIES = frozenset({"Cc", "Cf", "Cs", "Co", "Cn", "Zl", "Zp"})
SPACES = frozenset("\t\n\r\x0b\x0c\x85\u2028\u2029")


def display_text(value: object, limit: int | None = NAME_LIMIT) -> str:
    """`value` as text a person can read as it is: invisible characters shown as `[U+XXXX]`,
    spacing as one plain space, at most `limit` characters (None: no limit)."""
    text = "" if value is None else str(value)
    if text.isascii() and text.isprintable():  # the common case: nothing to neutralise
        return _cut(text, limit)
    parts: list[str] = []
    for char in text:
        if char in SPACES or (unicodedata.category(char) == "Zs" and char != " "):
            if not parts or parts[-1] != " ":
                parts.append(" ")
        elif unicodedata.category(char) in HIDDEN_CATEGORIES:
            parts.append(f"[U+{ord(char):04X}]")
        else:
            parts.append(char)
    return _cut("".join(parts), limit)


def _cut(text: str, limit: int | None) -> str:
    if limit is None or len(text) <= limit:
        return text
    return text[: limit - 1] + "…"
