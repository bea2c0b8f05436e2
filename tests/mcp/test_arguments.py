"""The one validator of `tools/call` arguments, driven by each tool's advertised inputSchema."""

from __future__ import annotations

from typing import Any

import pytest

from app.mcp import arguments
from app.mcp.arguments import check_arguments, compile_arguments_schema
from app.mcp.protocol import INVALID_PARAMS, JsonRpcError
from app.mcp.registry import Tool, ToolCall, ToolRegistry, ToolResult

# The shape of the conformance suite's JSON Schema 2020-12 fixture: $defs/$ref, allOf, if/then.
RICH_SCHEMA: dict[str, Any] = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "type": "object",
    "$defs": {
        "address": {
            "$anchor": "address",
            "type": "object",
            "properties": {"street": {"type": "string"}, "zip": {"type": "string"}},
            "required": ["street"],
        }
    },
    "properties": {
        "name": {"type": "string", "minLength": 2},
        "mode": {"enum": ["fast", "safe"]},
        "count": {"type": "integer", "maximum": 10},
        "address": {"$ref": "#/$defs/address"},
    },
    "if": {"properties": {"mode": {"const": "safe"}}, "required": ["mode"]},
    "then": {"required": ["address"]},
    "additionalProperties": False,
}


def refusal(arguments: Any, schema: dict[str, Any] = RICH_SCHEMA) -> str:
    with pytest.raises(JsonRpcError) as caught:
        check_arguments("rich", compile_arguments_schema(schema), arguments)
    assert caught.value.code == INVALID_PARAMS
    assert caught.value.data == {"reason": "invalid_arguments"}
    return caught.value.message


def test_L13_arguments_the_schema_accepts_pass() -> None:
    validator = compile_arguments_schema(RICH_SCHEMA)

    check_arguments("rich", validator, {"name": "ok", "mode": "safe", "address": {"street": "x"}})
    check_arguments("rich", validator, {})


@pytest.mark.parametrize(
    ("arguments", "expected"),
    [
        ({"name": "x"}, "name must be at least 2 characters long"),
        ({"count": 11}, "count must be at most 10"),
        ({"count": 1.5}, "count must be of type integer"),
        ({"mode": "slow"}, "mode must be one of: fast, safe"),
        ({"address": {}}, "missing required argument address.street"),
        ({"mode": "safe"}, "missing required argument address"),
        ({"address": {"street": 5}}, "address.street must be of type string"),
        ([], "arguments must be of type object"),
    ],
)
def test_L13_each_broken_rule_is_named_with_its_argument(arguments: Any, expected: str) -> None:
    assert refusal(arguments) == f"Invalid arguments for tool rich: {expected}"


def test_L13_a_rule_without_its_own_wording_still_names_the_argument_not_the_value() -> None:
    schema = {"type": "object", "properties": {"token": {"not": {"type": "string"}}}}

    message = refusal({"token": "sk_live_CANARY_in_a_value"}, schema)

    assert (
        message == "Invalid arguments for tool rich: token does not satisfy the schema's 'not' rule"
    )


def test_L13_a_tool_with_an_invalid_input_schema_cannot_be_registered() -> None:
    async def handler(_call: ToolCall) -> ToolResult:
        return ToolResult(text="never")

    broken = Tool(
        name="broken",
        description="x",
        handler=handler,
        input_schema={"type": "object", "properties": {"a": {"type": "no-such-type"}}},
    )

    with pytest.raises(ValueError, match="invalid inputSchema"):
        ToolRegistry().add(broken)


def test_a_pass_of_a_freed_validator_never_answers_for_a_new_one() -> None:
    """A new validator may be given a freed one's id: the passes kept for the freed one (a
    string `n` accepted) must not answer for the new one (`n` an integer)."""
    strings = {"type": "object", "properties": {"n": {"type": "string"}}}
    integers = {"type": "object", "properties": {"n": {"type": "integer"}}}
    for _ in range(20):  # CPython hands a freed object's address to the next one of its size
        old = compile_arguments_schema(strings)
        check_arguments("t", old, {"n": "x"})
        del old
        new = compile_arguments_schema(integers)
        with pytest.raises(JsonRpcError):
            check_arguments("t", new, {"n": "x"})


def test_a_pass_is_remembered_and_a_refusal_never_is() -> None:
    """The verdict cache (docs/adr/0006) keeps only arguments the schema accepted: the same
    refused arguments are refused every time, and an accepted set is remembered."""
    validator = compile_arguments_schema(
        {"type": "object", "properties": {"n": {"type": "integer"}}, "additionalProperties": False}
    )

    def kept() -> set[bytes]:
        return {key for owner, key in arguments._passed if owner == id(validator)}

    for _ in range(2):
        with pytest.raises(JsonRpcError):
            check_arguments("t", validator, {"n": "x"})
    assert kept() == set()
    check_arguments("t", validator, {"n": 1})
    check_arguments("t", validator, {"n": 1})
    assert kept() == {b'{"n":1}'}
    check_arguments("t", validator, {"n": 2**70})  # no JSON orjson writes: checked, not kept
    with pytest.raises(JsonRpcError):
        check_arguments("t", validator, {"n": 1.5})
    assert kept() == {b'{"n":1}'}
