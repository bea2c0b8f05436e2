"""Validate what the broker emits against the official 2026-07-28 JSON Schema (tests/data/spec)."""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path
from typing import Any

from jsonschema import Draft202012Validator
from referencing import Registry, Resource

SCHEMA_PATH = Path(__file__).resolve().parents[1] / "data" / "spec" / "2026-07-28" / "schema.json"
SCHEMA_SHA256 = "ef70b61f99b6d2e5e3b46863822eab08dff6a45bedc7a08914e0e5b133f40203"  # SOURCE.md
SCHEMA_ID = "urn:mcp:2026-07-28"


@cache
def _registry() -> Registry[Any]:
    document: dict[str, Any] = json.loads(SCHEMA_PATH.read_text())
    registry: Registry[Any] = Registry().with_resource(SCHEMA_ID, Resource.from_contents(document))
    return registry


def validate(instance: Any, definition: str) -> None:
    """Raise jsonschema.ValidationError unless `instance` is a valid `definition`."""
    schema = {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "$ref": f"{SCHEMA_ID}#/$defs/{definition}",
    }
    Draft202012Validator(schema, registry=_registry()).validate(instance)


def validate_response(body: dict[str, Any], result_kind: str | None = None) -> None:
    """A JSON-RPC response: errors as JSONRPCErrorResponse, results by their resultType."""
    if "error" in body:
        validate(body, "JSONRPCErrorResponse")
        return
    validate(body, "JSONRPCResultResponse")
    result = body["result"]
    if result_kind is None:
        result_kind = (
            "InputRequiredResult"
            if result.get("resultType") == "input_required"
            else "CallToolResult"
        )
    validate(result, result_kind)
