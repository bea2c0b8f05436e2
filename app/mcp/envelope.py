"""Reading one JSON-RPC message from a POST body and checking it against the MCP headers.

Order (spec/DIGEST.md §2.2, §10 q4): envelope → Mcp-Method header → params._meta (with the type
of a progressToken) → version header equals _meta version (-32020) → version supported (-32022)
→ Mcp-Name / Mcp-Param-*.
Notifications have no request _meta: for them only Mcp-Method and the version header are checked.
"""

from __future__ import annotations

import base64
import binascii
import json
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import orjson

from app.jsonbytes import may_hold_unusable_text, unusable_text
from app.mcp.protocol import (
    HEADER_MISMATCH,
    INVALID_PARAMS,
    INVALID_REQUEST,
    META_CLIENT_CAPABILITIES,
    META_PROGRESS_TOKEN,
    META_PROTOCOL_VERSION,
    PARSE_ERROR,
    SUPPORTED_VERSIONS,
    UNSUPPORTED_VERSION,
    JsonRpcError,
)

RequestId = str | int
ProgressToken = str | int
HeaderMap = Mapping[str, str]  # lower-case names; the first of repeated headers wins
NAMED_METHODS = {"tools/call": "name", "prompts/get": "name", "resources/read": "uri"}


@dataclass(slots=True)  # built per request; frozen would cost an object.__setattr__ per field
class Message:
    """A validated request (id set) or notification (id None)."""

    id: RequestId | None
    method: str
    params: dict[str, Any]
    meta: dict[str, Any]

    @property
    def capabilities(self) -> dict[str, Any]:
        caps: dict[str, Any] = self.meta[META_CLIENT_CAPABILITIES]
        return caps


def header_map(raw: Iterable[tuple[bytes, bytes]]) -> dict[str, str]:
    """An ASGI scope's headers as one dict, built once per request (each lookup in Starlette's
    `Headers` scans the list). ASGI names are lower-case already.

    A header sent more than once is one comma-separated value, as HTTP combines field lines
    (RFC 9110 §5.3): two `Mcp-Method` or `Mcp-Name` lines then match no method or tool and are
    refused, rather than the first being checked while a proxy acted on the last.
    """
    headers: dict[str, str] = {}
    repeated: dict[str, list[str]] = {}  # joined once at the end: joining at each line was
    for name, value in raw:  # quadratic, and a million repeats held the event loop for 26 s
        key, text = name.decode("latin-1"), value.decode("latin-1")
        if key in headers:
            repeated.setdefault(key, [headers[key]]).append(text)
        else:
            headers[key] = text
    for key, values in repeated.items():
        headers[key] = ", ".join(values)
    return headers


class _DuplicateKey(ValueError):
    pass


class _UnusableText(ValueError):
    """A string no answer could echo (app/jsonbytes.py `unusable_text`)."""


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    result = dict(pairs)
    if len(result) != len(pairs):
        raise _DuplicateKey()
    return result


def _no_constants(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _finite(text: str) -> float:
    """A number too large for a double (`1e999`) is refused, as orjson refuses it, rather than
    read as infinity, which no JSON answer could hold."""
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"{text[:32]} is out of range")
    return value


# One decoder for all requests: `json.loads` with hooks builds a decoder and scanner per call.
_DECODER = json.JSONDecoder(
    object_pairs_hook=_no_duplicates, parse_constant=_no_constants, parse_float=_finite
)


def _decode(body: bytes) -> Any:
    """The JSON document of `body`; duplicate keys raise `_DuplicateKey`.

    Clients send compact JSON, which orjson parses and writes back byte for byte. Equal bytes
    prove there was no duplicate key (orjson keeps one entry per key, so a duplicate would be
    missing from its output). Anything else (spaces, escapes written differently, a duplicate,
    a value orjson refuses) is parsed again by the standard library with the duplicate check,
    which decides what the body is.

    A string holding an unpaired surrogate raises `_UnusableText` (orjson refuses one, so only
    the standard library's path looks). A NUL is a character like any other here: tool
    arguments may carry one on to a provider.
    """
    try:
        document = orjson.loads(body)
    except orjson.JSONDecodeError:
        pass
    else:
        if orjson.dumps(document) == body:
            return document
    document = _DECODER.decode(body.decode("utf-8"))
    if may_hold_unusable_text(body, allow_nul=True):
        reason = unusable_text(document, allow_nul=True)
        if reason is not None:
            raise _UnusableText(reason)
    return document


NOT_JSON_RPC = 'Not a JSON-RPC 2.0 message (expected an object with "jsonrpc": "2.0")'


def parse_body(body: bytes) -> Message:
    """Parse one JSON-RPC message (not yet checked against headers).

    Raises:
        JsonRpcError: -32700 for bad JSON, -32600 for anything but a single valid request
            (also for an unpaired surrogate in any string: the id itself may be one, and no
            answer could echo it).
    """
    try:
        document = _decode(body)
    except _DuplicateKey:
        raise _invalid("Duplicate keys in a JSON object are not accepted") from None
    except _UnusableText as exc:
        raise _invalid(f"Strings must not hold {exc}") from None
    except (UnicodeDecodeError, ValueError, RecursionError):
        raise JsonRpcError(
            PARSE_ERROR, "Parse error: the body is not valid JSON", http_status=400
        ) from None
    if isinstance(document, list):
        raise _invalid("Batches are not supported: send one JSON-RPC message per request")
    if not isinstance(document, dict):
        raise _invalid(NOT_JSON_RPC)
    has_id = "id" in document
    request_id = document.get("id")
    readable_id = request_id if _is_string_or_integer(request_id) else None  # echoed in any error
    if document.get("jsonrpc") != "2.0":
        raise _invalid(
            NOT_JSON_RPC,
            request_id=readable_id,
        )
    method = document.get("method")
    if not isinstance(method, str) or not method:
        raise _invalid("Not a JSON-RPC request: a method is required", request_id=readable_id)
    if has_id and readable_id is None:
        raise _invalid("The request id must be a string or an integer", method=method)
    params = document.get("params")
    if params is not None and not isinstance(params, dict):
        raise JsonRpcError(
            INVALID_PARAMS,
            "params must be an object",
            http_status=400,
            request_id=request_id,
            method=method,
        )
    meta = (params or {}).get("_meta")
    return Message(
        id=request_id if has_id else None,
        method=method,
        params=params or {},
        meta=meta if isinstance(meta, dict) else {},
    )


def _invalid(
    message: str, *, method: str | None = None, request_id: str | int | None = None
) -> JsonRpcError:
    return JsonRpcError(
        INVALID_REQUEST, message, http_status=400, method=method, request_id=request_id
    )


def check_message(message: Message, headers: HeaderMap) -> None:
    """Validate _meta, the version and the MCP headers against the body (notifications: headers).

    Raises:
        JsonRpcError: -32020, -32602 or -32022 (all HTTP 400).
    """
    if _header(headers, "mcp-method") != message.method:
        raise _mismatch("The Mcp-Method header is missing or differs from the body's method")
    if message.id is None:
        _check_notification_version(headers)
        return
    meta = message.params.get("_meta")
    if not isinstance(meta, dict):
        raise _bad_meta("params._meta is required on every request")
    version = meta.get(META_PROTOCOL_VERSION)
    if not isinstance(version, str) or not version:
        raise _bad_meta(f"params._meta[{META_PROTOCOL_VERSION!r}] is required")
    if not isinstance(meta.get(META_CLIENT_CAPABILITIES), dict):
        raise _bad_meta(f"params._meta[{META_CLIENT_CAPABILITIES!r}] must be an object")
    if META_PROGRESS_TOKEN in meta and not _is_string_or_integer(meta[META_PROGRESS_TOKEN]):
        raise _bad_meta(f"params._meta.{META_PROGRESS_TOKEN} must be a string or an integer")
    if _header(headers, "mcp-protocol-version") != version:
        raise _mismatch("The MCP-Protocol-Version header is missing or differs from params._meta")
    if version not in SUPPORTED_VERSIONS:
        raise _unsupported(version)
    name_field = NAMED_METHODS.get(message.method)
    if name_field is not None:
        value = message.params.get(name_field)
        if not isinstance(value, str) or _header(headers, "mcp-name") != value:
            raise _mismatch(f"The Mcp-Name header is missing or differs from params.{name_field}")


def _is_string_or_integer(value: object) -> bool:
    """Schema `RequestId` and `ProgressToken`: a string or an integer (a boolean is neither)."""
    return isinstance(value, str) or (isinstance(value, int) and not isinstance(value, bool))


def _check_notification_version(headers: HeaderMap) -> None:
    """Notifications carry no request _meta (schema NotificationParams): only the header counts."""
    version = _header(headers, "mcp-protocol-version")
    if not version:
        raise _mismatch("The MCP-Protocol-Version header is required")
    if version not in SUPPORTED_VERSIONS:
        raise _unsupported(version)


def check_param_headers(
    headers: HeaderMap, schema: dict[str, Any], arguments: dict[str, Any]
) -> None:
    """Arguments annotated `x-mcp-header` must be mirrored in `Mcp-Param-<Name>` (SEP-2243).

    Raises:
        JsonRpcError: -32020 when a mirrored header is missing or differs.
    """
    for prop_name, prop in (schema.get("properties") or {}).items():
        if not isinstance(prop, dict) or "x-mcp-header" not in prop:
            continue
        header = _header(headers, f"mcp-param-{prop['x-mcp-header']}".lower())
        value = arguments.get(prop_name)
        if value is None:
            if header is not None:
                raise _mismatch(f"Mcp-Param-{prop['x-mcp-header']} sent without the argument")
            continue
        expected = json.dumps(value) if not isinstance(value, str) else value
        if header is None or not _same_value(header, expected, value):
            raise _mismatch(f"Mcp-Param-{prop['x-mcp-header']} is missing or differs")


def _same_value(header: str, expected: str, value: Any) -> bool:
    if isinstance(value, int | float) and not isinstance(value, bool):
        try:
            return float(header) == float(value)
        except ValueError:
            return False
    return header == expected


def _header(headers: HeaderMap, name: str) -> str | None:
    raw = headers.get(name)
    if raw is None:
        return None
    value = raw.strip()
    if value.startswith("=?base64?") and value.endswith("?="):
        try:
            return base64.b64decode(value[9:-2], validate=True).decode("utf-8")
        except (binascii.Error, UnicodeDecodeError):
            return None
    return value


def _mismatch(message: str) -> JsonRpcError:
    return JsonRpcError(HEADER_MISMATCH, message, http_status=400)


def _unsupported(version: str) -> JsonRpcError:
    return JsonRpcError(
        UNSUPPORTED_VERSION,
        "Unsupported protocol version",
        http_status=400,
        data={"supported": list(SUPPORTED_VERSIONS), "requested": version},
    )


def _bad_meta(message: str) -> JsonRpcError:
    return JsonRpcError(INVALID_PARAMS, message, http_status=400)
