"""Compact JSON encoding for the hot paths (orjson), with the standard library as the fallback
for the few values orjson refuses (integers beyond 64 bits, which a client may send as an id)."""

from __future__ import annotations

import json
from typing import Any

import orjson

from app.storable import unstorable_reason


def dumps(value: Any, *, sort_keys: bool = False) -> bytes:
    """Compact UTF-8 JSON, like `json.dumps(value, separators=(",", ":"), ensure_ascii=False)`
    (with `sort_keys`, object keys in sorted order)."""
    try:
        return orjson.dumps(value, option=orjson.OPT_SORT_KEYS if sort_keys else None)
    except TypeError:  # orjson.JSONEncodeError is a TypeError
        text = json.dumps(value, separators=(",", ":"), ensure_ascii=False, sort_keys=sort_keys)
        return text.encode()


def unusable_text(document: Any, *, allow_nul: bool = False) -> str | None:
    """What makes a parsed document unfit to write back or to store, or None: the first string
    or key that `app.storable.unstorable_reason` refuses."""
    pending = [document]
    while pending:
        item = pending.pop()
        if isinstance(item, str):
            reason = unstorable_reason(item, allow_nul=allow_nul)
            if reason is not None:
                return reason
        elif isinstance(item, dict):
            pending += item.keys()
            pending += item.values()
        elif isinstance(item, list):
            pending += item
    return None


def may_hold_unusable_text(body: bytes, *, allow_nul: bool = False) -> bool:
    """False when the JSON text `body` holds no escape `unusable_text` could find; True sends it
    to the walk. In text read as strict UTF-8 a NUL or a surrogate can only be written as an
    escape: the caller refuses any other body first (`json.loads(bytes)` decodes with
    `surrogatepass`, and reads UTF-16 and UTF-32 too)."""
    return (not allow_nul and b"\\u0000" in body) or b"\\ud" in body or b"\\uD" in body


def loads(document: bytes | str) -> Any:
    """Parse JSON (orjson: raises a ValueError subclass for anything that is not JSON)."""
    return orjson.loads(document)
