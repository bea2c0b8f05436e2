"""Compact JSON encoding for the hot paths (orjson), with the standard library as the fallback
for the few values orjson refuses (integers beyond 64 bits, which a client may send as an id)."""

from __future__ import annotations

import json
from typing import Any

import orjson


def dumps(value: Any) -> bytes:
    """Compact UTF-8 JSON, like `json.dumps(value, separators=(",", ":"), ensure_ascii=False)`."""
    try:
        return orjson.dumps(value)
    except TypeError:  # orjson.JSONEncodeError is a TypeError
        return json.dumps(value, separators=(",", ":"), ensure_ascii=False).encode()


def loads(document: bytes | str) -> Any:
    """Parse JSON (orjson: raises a ValueError subclass for anything that is not JSON)."""
    return orjson.loads(document)
