"""Compact JSON encoding for the hot paths (orjson), with the standard library as the fallback
for the few values orjson refuses (integers beyond 64 bits, which a client may send as an id)."""

from __future__ import annotations

import json
from typing import Any

import orjson


def dumps(value: Any, *, sort_keys: bool = False) -> bytes:
    """Compact UTF-8 JSON, like `json.dumps(value, separators=(",", ":"), ensure_ascii=False)`
    (with `sort_keys`, object keys in sorted order)."""
    try:
        return orjson.dumps(value, option=orjson.OPT_SORT_KEYS if sort_keys else None)
    except TypeError:  # orjson.JSONEncodeError is a TypeError
        text = json.dumps(value, separators=(",", ":"), ensure_ascii=False, sort_keys=sort_keys)
        return text.encode()


def loads(document: bytes | str) -> Any:
    """Parse JSON (orjson: raises a ValueError subclass for anything that is not JSON)."""
    return orjson.loads(document)
