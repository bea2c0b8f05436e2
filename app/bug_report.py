"""The log text of an unexpected exception: where it happened, without what it said.

An exception's message can hold any value the failing code had at hand (a pydantic error echoes
its input, a KeyError its key), and a token or key among them would end up in the log. So the
broker logs the traceback's frames (file, line, function, source line) and each exception's
type, for the whole chain (causes and contexts, and an exception group's members, each with its
own chain, indented under the group as the standard text does), and withholds every message.
"""

from __future__ import annotations

import traceback

TRACEBACK_HEADER = "Traceback (most recent call last):\n"
WITHHELD = "(message withheld: it may hold secrets)"
CAUSE = "\nThe above exception was the direct cause of the following exception:\n\n"
CONTEXT = "\nDuring handling of the above exception, another exception occurred:\n\n"


def redacted_traceback(exc: BaseException) -> str:
    """The standard traceback text of `exc` and the exceptions it chains, messages withheld."""
    return _chain_text(exc, seen=set())


def _chain_text(exc: BaseException, *, seen: set[int]) -> str:
    parts: list[str] = []
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        parts.append(_exception_text(current, seen=seen))
        if current.__cause__ is not None:
            parts.append(CAUSE)
            current = current.__cause__
        elif current.__context__ is not None and not current.__suppress_context__:
            parts.append(CONTEXT)
            current = current.__context__
        else:
            current = None
    # the chain was walked from the newest exception back; the standard text reads oldest first
    return "".join(reversed(parts)).rstrip("\n")


def _exception_text(exc: BaseException, *, seen: set[int]) -> str:
    """One exception's frames and type; a group's members follow, each in its own box."""
    frames = ""
    if exc.__traceback__ is not None:
        frames = TRACEBACK_HEADER + "".join(traceback.format_tb(exc.__traceback__))
    text = f"{frames}{_type_name(exc)}: {WITHHELD}\n"
    if not isinstance(exc, BaseExceptionGroup):
        return text
    members = exc.exceptions
    boxes = []
    for number, member in enumerate(members, start=1):
        body = _chain_text(member, seen=seen) if id(member) not in seen else "(shown above)"
        boxes.append(f"+---------------- {number} of {len(members)} ----------------\n")
        boxes.append(_prefixed(body, "| ") + "\n")
    boxes.append("+------------------------------------\n")
    return _prefixed(text + "".join(boxes), "  ")


def _prefixed(text: str, prefix: str) -> str:
    """Every line of `text` behind `prefix`, blank ones included, no trailing spaces."""
    return "\n".join((prefix + line).rstrip() for line in text.split("\n"))


def _type_name(exc: BaseException) -> str:
    """As the standard text names it: builtins bare, anything else with its module."""
    kind = type(exc)
    if kind.__module__ == "builtins":
        return kind.__qualname__
    return f"{kind.__module__}.{kind.__qualname__}"
