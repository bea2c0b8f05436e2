"""`tools/call` arguments checked against the tool's advertised `inputSchema` (servers MUST).

One validator for every tool (broker, provider and custom tools alike), compiled once per tool
from the very schema `tools/list` advertises: JSON Schema 2020-12 through `jsonschema`, so what a
tool advertises (`$defs`, `allOf`, `if`/`then`/`else`, ...) is what is enforced. Messages name the
argument and the rule it breaks, never the value that was sent: an argument may be a secret.
"""

from __future__ import annotations

import re
from collections import OrderedDict
from typing import Any

import orjson
from jsonschema import Draft202012Validator
from jsonschema.exceptions import ValidationError, best_match

from app.mcp.protocol import JsonRpcError, invalid_params

ArgumentsValidator = Draft202012Validator
# An unexpected argument's name is repeated only when it looks like a name, not like a value.
_PLAIN_NAME = re.compile(r"^[A-Za-z][A-Za-z0-9_]{0,31}$")
# Keywords whose (schema-side) value is worth repeating in the message.
_LIMITS = {
    "minLength": "must be at least {} characters long",
    "maxLength": "must be at most {} characters long",
    "minimum": "must be at least {}",
    "maximum": "must be at most {}",
    "exclusiveMinimum": "must be greater than {}",
    "exclusiveMaximum": "must be less than {}",
    "minItems": "must have at least {} items",
    "maxItems": "must have at most {} items",
    "minProperties": "must have at least {} members",
    "maxProperties": "must have at most {} members",
    "pattern": "must match the pattern {}",
    "multipleOf": "must be a multiple of {}",
}


def compile_arguments_schema(schema: dict[str, Any]) -> ArgumentsValidator:
    """The validator of a tool's `inputSchema`.

    Raises:
        jsonschema.SchemaError: the schema itself is not valid JSON Schema 2020-12.
    """
    Draft202012Validator.check_schema(schema)
    return Draft202012Validator(schema)


# Arguments a tool's schema accepted, by their canonical JSON: most calls repeat a few small
# argument sets (`{"provider": "github"}`), and a verdict depends on nothing else. Only passes are
# kept, so a refused value never decides another request's answer (docs/adr/0006). An entry
# holds its validator: while the entry lives, no other validator can be given the same id.
PASSED_LIMIT = 4096
PASSED_KEY_BYTES = 512  # larger arguments are validated every time, never kept
_passed: OrderedDict[tuple[int, bytes], ArgumentsValidator] = OrderedDict()


def check_arguments(tool_name: str, validator: ArgumentsValidator, arguments: Any) -> None:
    """Refuse arguments the tool's schema does not accept.

    Raises:
        JsonRpcError: -32602 naming the first (most relevant) argument at fault.
    """
    try:
        canonical = orjson.dumps(arguments, option=orjson.OPT_SORT_KEYS)
    except orjson.JSONEncodeError:  # e.g. an integer past 64 bits: checked, never kept
        canonical = b""
    key = (id(validator), canonical)
    if canonical and _passed.get(key) is validator:
        return
    if validator.is_valid(arguments):  # the common case, at half the cost of best_match
        if canonical and len(canonical) <= PASSED_KEY_BYTES:
            _passed[key] = validator
            if len(_passed) > PASSED_LIMIT:
                _passed.popitem(last=False)
        return
    error = best_match(validator.iter_errors(arguments))
    if error is not None:
        raise _refusal(tool_name, error)


def _refusal(tool_name: str, error: ValidationError) -> JsonRpcError:
    return invalid_params(
        f"Invalid arguments for tool {tool_name}: {describe(error)}", reason="invalid_arguments"
    )


def describe(error: ValidationError) -> str:
    """One sentence about `error` built from the schema and the argument path, not the value."""
    where = _path(error.absolute_path)
    keyword = str(error.validator)
    rule: Any = error.validator_value
    instance: Any = error.instance
    if keyword == "required" and isinstance(instance, dict):
        missing = [name for name in rule if name not in instance]
        names = ", ".join(_join(where, str(name)) for name in missing)
        return f"missing required argument {names}"
    if keyword == "additionalProperties" and isinstance(instance, dict):
        schema: Any = error.schema
        known = schema.get("properties", {}) if isinstance(schema, dict) else {}
        extra = [name for name in instance if name not in known]
        accepted = ", ".join(sorted(known)) or "none"
        if all(_PLAIN_NAME.match(name) for name in extra):
            names = ", ".join(_join(where, name) for name in extra)
            return f"unexpected argument {names} (accepted: {accepted})"
        return f"an unexpected argument (accepted: {accepted})"
    subject = where or "arguments"
    if keyword == "type":
        kinds = " or ".join(rule) if isinstance(rule, list) else str(rule)
        return f"{subject} must be of type {kinds}"
    if keyword == "enum" and isinstance(rule, list) and all(_scalar(v) for v in rule):
        return f"{subject} must be one of: " + ", ".join(map(str, rule))
    if keyword in _LIMITS and _scalar(rule):
        return f"{subject} " + _LIMITS[keyword].format(rule)
    return f"{subject} does not satisfy the schema's {keyword!r} rule"


def _scalar(value: Any) -> bool:
    return isinstance(value, str | int | float | bool) and len(str(value)) <= 64


def _path(parts: Any) -> str:
    text = ""
    for part in parts:
        text = f"{text}[{part}]" if isinstance(part, int) else _join(text, str(part))
    return text


def _join(prefix: str, name: str) -> str:
    if not _PLAIN_NAME.match(name):
        name = "(argument)"
    return f"{prefix}.{name}" if prefix else name
