"""The schema the suite validates against is the official file, byte for byte."""

from __future__ import annotations

import hashlib

from .schema import SCHEMA_PATH, SCHEMA_SHA256


def test_the_schema_copy_is_the_published_file() -> None:
    assert hashlib.sha256(SCHEMA_PATH.read_bytes()).hexdigest() == SCHEMA_SHA256
