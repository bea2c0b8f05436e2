"""The fixture tools the official MCP conformance suite calls, built on the broker's tool API.

Every tool goes through `app.mcp.registry` like a real tool, so the suite exercises the broker's
own MRTR framework: `InputRequired.state` is sealed into `requestState` and handed back as
`call.state` on the retry, a tampered state is refused with -32602 before the handler runs, and an
input request for a capability the client did not declare becomes -32021 (MRTR server rule 7).
Names and keys follow the scenario sources of `@modelcontextprotocol/conformance` 0.2.0-alpha.12
(`src/scenarios/server/input-required-result.ts`, `stateless.ts`).
"""

from __future__ import annotations

import asyncio
from typing import Any

from app.mcp.registry import InputRequired, ToolCall, ToolHandler, ToolRegistry, ToolResult

__all__ = ["conformance_registry"]

STATE_MARKER = "conformance-state-v1"  # what request-state and tampered-state tools seal


def _form(message: str, field: str, kind: str = "string") -> dict[str, Any]:
    """A bare form-mode `elicitation/create` request asking for one required field."""
    return {
        "method": "elicitation/create",
        "params": {
            "message": message,
            "requestedSchema": {
                "type": "object",
                "properties": {field: {"type": kind}},
                "required": [field],
            },
        },
    }


def _sampling(text: str, max_tokens: int) -> dict[str, Any]:
    return {
        "method": "sampling/createMessage",
        "params": {
            "messages": [{"role": "user", "content": {"type": "text", "text": text}}],
            "maxTokens": max_tokens,
        },
    }


ROOTS_REQUEST: dict[str, Any] = {"method": "roots/list", "params": {}}


def _accepted(call: ToolCall, key: str, field: str, kind: type = str) -> Any:
    """The `field` of an accepted form answer under `key`, or None when there is no usable one."""
    answer = call.input_responses.get(key)
    if not isinstance(answer, dict) or answer.get("action") != "accept":
        return None
    content = answer.get("content")
    value = content.get(field) if isinstance(content, dict) else None
    return value if isinstance(value, kind) else None


def _sampled_text(call: ToolCall, key: str) -> str | None:
    """The text of a `CreateMessageResult` answer under `key`."""
    answer = call.input_responses.get(key)
    content = answer.get("content") if isinstance(answer, dict) else None
    text = content.get("text") if isinstance(content, dict) else None
    return text if isinstance(text, str) else None


def _roots(call: ToolCall, key: str) -> list[str] | None:
    """The root URIs of a `ListRootsResult` answer under `key`."""
    answer = call.input_responses.get(key)
    roots = answer.get("roots") if isinstance(answer, dict) else None
    if not isinstance(roots, list):
        return None
    return [str(root.get("uri")) for root in roots if isinstance(root, dict)]


async def elicitation(call: ToolCall) -> ToolResult | InputRequired:
    """Ask for a name (key `user_name`); any call carrying an accepted name completes."""
    name = _accepted(call, "user_name", "name")
    if name is None:
        return InputRequired({"user_name": _form("What is your name?", "name")})
    return ToolResult(text=f"Hello, {name}!")


async def sampling(call: ToolCall) -> ToolResult | InputRequired:
    """Ask the client's model a question (key `capital_question`); its answer completes."""
    answer = _sampled_text(call, "capital_question")
    if answer is None:
        question = _sampling("What is the capital of France?", 100)
        return InputRequired({"capital_question": question})
    return ToolResult(text=f"The model answered: {answer}")


async def list_roots(call: ToolCall) -> ToolResult | InputRequired:
    """Ask for the client's roots (key `client_roots`); the list completes."""
    roots = _roots(call, "client_roots")
    if roots is None:
        return InputRequired({"client_roots": ROOTS_REQUEST})
    return ToolResult(text="Client roots: " + (", ".join(roots) or "none"))


async def request_state(call: ToolCall) -> ToolResult | InputRequired:
    """Completes only when the sealed state came back intact alongside the confirmation."""
    confirmed = _accepted(call, "confirm", "ok", bool)
    if call.state != STATE_MARKER or confirmed is None:
        return InputRequired({"confirm": _form("Please confirm", "ok", "boolean")}, STATE_MARKER)
    return ToolResult(text=f"state-ok: confirmed={str(confirmed).lower()}")


async def multiple_inputs(call: ToolCall) -> ToolResult | InputRequired:
    """Elicitation, sampling and roots in one round; completes when all three answered."""
    name = _accepted(call, "user_name", "name")
    greeting = _sampled_text(call, "greeting")
    roots = _roots(call, "client_roots")
    if call.state != STATE_MARKER or name is None or greeting is None or roots is None:
        requests = {
            "user_name": _form("What is your name?", "name"),
            "greeting": _sampling("Generate a greeting", 50),
            "client_roots": ROOTS_REQUEST,
        }
        return InputRequired(requests, STATE_MARKER)
    return ToolResult(text=f"{greeting} {name} (roots: {', '.join(roots) or 'none'})")


async def multi_round(call: ToolCall) -> ToolResult | InputRequired:
    """Round 1 asks `step1` (name), round 2 asks `step2` (colour) with a new state, then done."""
    state = call.state if isinstance(call.state, dict) else {}
    if state.get("step") == 2 and isinstance(state.get("name"), str):
        color = _accepted(call, "step2", "color")
        if color is not None:
            return ToolResult(text=f"{state['name']} likes {color}.")
        return _step_two(state["name"])
    name = _accepted(call, "step1", "name") if state.get("step") == 1 else None
    if name is not None:
        return _step_two(name)
    return InputRequired({"step1": _form("Step 1: What is your name?", "name")}, {"step": 1})


def _step_two(name: str) -> InputRequired:
    step = _form("Step 2: What is your favorite color?", "color")
    return InputRequired({"step2": step}, {"step": 2, "name": name})


async def tampered_state(call: ToolCall) -> ToolResult | InputRequired:
    """Completes on an intact state; a tampered one never gets here (the framework says -32602)."""
    if call.state != STATE_MARKER or _accepted(call, "confirm", "ok", bool) is None:
        return InputRequired({"confirm": _form("Please confirm", "ok", "boolean")}, STATE_MARKER)
    return ToolResult(text="state-ok")


async def capabilities(call: ToolCall) -> ToolResult | InputRequired:
    """Asks only through a declared capability: elicitation, else sampling, else roots."""
    answer = _accepted(call, "user_name", "name") or _sampled_text(call, "capital_question")
    roots = _roots(call, "client_roots")
    if answer is not None or roots is not None:
        return ToolResult(text=f"Answered: {answer if answer is not None else roots}")
    if call.has_capability("elicitation"):
        return InputRequired({"user_name": _form("What is your name?", "name")})
    if call.has_capability("sampling"):
        return InputRequired({"capital_question": _sampling("What is the capital of France?", 100)})
    if call.has_capability("roots"):
        return InputRequired({"client_roots": ROOTS_REQUEST})
    return ToolResult(text="The client declared no capability to ask for input.", is_error=True)


async def needs_sampling(call: ToolCall) -> ToolResult | InputRequired:
    """Needs sampling; without it the framework answers -32021 with `requiredCapabilities`."""
    answer = _sampled_text(call, "needs_sampling")
    if answer is None:
        return InputRequired({"needs_sampling": _sampling("Say something.", 20)})
    return ToolResult(text=f"Sampled: {answer}")


async def streaming_elicitation(call: ToolCall) -> ToolResult | InputRequired:
    """An elicitation that travels inside the result (MRTR), never as a request on a stream."""
    confirmed = _accepted(call, "confirmation", "ok", bool)
    if confirmed is None:
        return InputRequired({"confirmation": _form("Continue?", "ok", "boolean")})
    return ToolResult(text=f"confirmed={str(confirmed).lower()}")


async def logging_tool(call: ToolCall) -> ToolResult:
    """Would log if asked to; the broker sends no notifications, so it only answers."""
    return ToolResult(text="Logging tool ran; no log level was requested, so nothing was logged.")


async def custom_header(call: ToolCall) -> ToolResult:
    """Echo `region`, an argument mirrored in the `Mcp-Param-Region` header (SEP-2243)."""
    return ToolResult(text=f"region={call.arguments.get('region')}")


# A 1x1 red PNG and 0.01 s of 8 kHz mono silence as WAV, the smallest media the suite accepts.
PNG_BASE64 = (
    "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mP8z8DwHwAFBQIAX8jx0g"
    "AAAABJRU5ErkJggg=="
)
WAV_BASE64 = (
    "UklGRnQAAABXQVZFZm10IBAAAAABAAEAQB8AAEAfAAABAAgAZGF0YVAAAACAgICAgICAgICAgICAgICAgICAgICAgICA"
    "gICAgICAgICAgICAgICAgICAgICAgICAgICAgICAgICAgICAgICAgICAgICAgICAgICAgICAgA=="
)
IMAGE: dict[str, Any] = {"type": "image", "data": PNG_BASE64, "mimeType": "image/png"}


def _resource(uri: str, mime_type: str, text: str) -> dict[str, Any]:
    return {"type": "resource", "resource": {"uri": uri, "mimeType": mime_type, "text": text}}


async def simple_text(call: ToolCall) -> ToolResult:
    """Answers one text content item."""
    return ToolResult(text="This is a simple text response for testing.")


async def image_content(call: ToolCall) -> ToolResult:
    """Answers one PNG image content item."""
    return ToolResult(content=(IMAGE,))


async def audio_content(call: ToolCall) -> ToolResult:
    """Answers one WAV audio content item."""
    return ToolResult(content=({"type": "audio", "data": WAV_BASE64, "mimeType": "audio/wav"},))


async def embedded_resource(call: ToolCall) -> ToolResult:
    """Answers one embedded text resource."""
    text = "This is an embedded resource content."
    return ToolResult(content=(_resource("test://embedded-resource", "text/plain", text),))


async def mixed_content(call: ToolCall) -> ToolResult:
    """Answers text, an image and an embedded resource together."""
    data = '{"test":"data","value":123}'
    resource = _resource("test://mixed-content-resource", "application/json", data)
    return ToolResult(text="Multiple content types test:", content=(IMAGE, resource))


async def error_handling(call: ToolCall) -> ToolResult:
    """Always fails as a tool (isError), never as a JSON-RPC error."""
    return ToolResult(text="This tool intentionally returns an error for testing", is_error=True)


PROGRESS_STEPS = (0, 50, 100)  # of 100, about 50 ms apart, as the scenario describes
PROGRESS_PAUSE_SECONDS = 0.05


async def with_progress(call: ToolCall) -> ToolResult:
    """Reports progress 0, 50 and 100 of 100, about 50 ms apart, then answers."""
    for step, done in enumerate(PROGRESS_STEPS):
        if step:
            await asyncio.sleep(PROGRESS_PAUSE_SECONDS)
        await call.report_progress(done, total=100)
    return ToolResult(text=f"Done after {len(PROGRESS_STEPS)} progress steps.")


async def json_schema_2020_12(call: ToolCall) -> ToolResult:
    """Advertises a JSON Schema 2020-12 inputSchema ($defs, $anchor, allOf, if/then/else)."""
    return ToolResult(text="ok")


# The suite's `json-schema-2020-12` fixture schema, verbatim (it checks that nothing is dropped).
JSON_SCHEMA_2020_12: dict[str, Any] = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "type": "object",
    "$defs": {
        "address": {
            "$anchor": "addressDef",
            "type": "object",
            "properties": {"street": {"type": "string"}, "city": {"type": "string"}},
        }
    },
    "properties": {
        "name": {"type": "string"},
        "address": {"$ref": "#/$defs/address"},
        "contactMethod": {"type": "string", "enum": ["phone", "email"]},
        "phone": {"type": "string"},
        "email": {"type": "string"},
    },
    "allOf": [{"anyOf": [{"required": ["phone"]}, {"required": ["email"]}]}],
    "if": {"properties": {"contactMethod": {"const": "phone"}}, "required": ["contactMethod"]},
    "then": {"required": ["phone"]},
    "else": {"required": ["email"]},
    "additionalProperties": False,
}

CUSTOM_HEADER_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"region": {"type": "string", "x-mcp-header": "Region"}},
    "required": ["region"],
}

FIXTURES: tuple[tuple[str, ToolHandler], ...] = (
    ("test_input_required_result_elicitation", elicitation),
    ("test_input_required_result_sampling", sampling),
    ("test_input_required_result_list_roots", list_roots),
    ("test_input_required_result_request_state", request_state),
    ("test_input_required_result_multiple_inputs", multiple_inputs),
    ("test_input_required_result_multi_round", multi_round),
    ("test_input_required_result_tampered_state", tampered_state),
    ("test_input_required_result_capabilities", capabilities),
    ("test_missing_capability", needs_sampling),
    ("test_streaming_elicitation", streaming_elicitation),
    ("test_logging_tool", logging_tool),
    ("test_simple_text", simple_text),
    ("test_image_content", image_content),
    ("test_audio_content", audio_content),
    ("test_embedded_resource", embedded_resource),
    ("test_multiple_content_types", mixed_content),
    ("test_error_handling", error_handling),
    ("test_tool_with_progress", with_progress),
)


def conformance_registry() -> ToolRegistry:
    """A registry holding every fixture tool (the broker adds its own tools after these)."""
    registry = ToolRegistry()
    for name, handler in FIXTURES:
        summary = (handler.__doc__ or name).strip().splitlines()[0]
        registry.tool(name, description=f"Conformance fixture: {summary}")(handler)
    registry.tool(
        "test_custom_header",
        description="Conformance fixture: " + (custom_header.__doc__ or "").splitlines()[0],
        input_schema=CUSTOM_HEADER_SCHEMA,
    )(custom_header)
    registry.tool(
        "json_schema_2020_12_tool",
        description="Tool with JSON Schema 2020-12 features",
        input_schema=JSON_SCHEMA_2020_12,
    )(json_schema_2020_12)
    return registry
