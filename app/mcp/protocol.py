"""MCP 2026-07-28 wire constants and the JSON-RPC error type (spec/DIGEST.md §2, §3, §8)."""

from __future__ import annotations

from typing import Any

from app.limits import retry_after

PROTOCOL_VERSION = "2026-07-28"
SUPPORTED_VERSIONS = (PROTOCOL_VERSION,)

META_PROTOCOL_VERSION = "io.modelcontextprotocol/protocolVersion"
META_CLIENT_CAPABILITIES = "io.modelcontextprotocol/clientCapabilities"
META_CLIENT_INFO = "io.modelcontextprotocol/clientInfo"
META_SERVER_INFO = "io.modelcontextprotocol/serverInfo"
# asks for notifications/progress (app/mcp/progress.py)
META_PROGRESS_TOKEN = "progressToken"  # noqa: S105 (a protocol key, not a secret)
LEGACY_HANDSHAKE = "initialize"  # removed in 2026-07-28 (SEP-2575); refused with our versions

PARSE_ERROR = -32700  # body is not JSON
INVALID_REQUEST = -32600  # not a single valid JSON-RPC request (batches included)
METHOD_NOT_FOUND = -32601  # over HTTP answered with 404 (Streamable HTTP, 2026-07-28)
INVALID_PARAMS = -32602  # bad params, missing _meta, unknown tool, bad requestState
INTERNAL_ERROR = -32603
HEADER_MISMATCH = -32020  # MCP-* headers missing or disagreeing with the body (SEP-2243)
MISSING_CAPABILITY = -32021  # data.requiredCapabilities (basic/index.mdx)
UNSUPPORTED_VERSION = -32022  # data.supported + data.requested (basic/versioning.mdx)
RATE_LIMITED = -31029  # ours (outside JSON-RPC's reserved range): over HTTP 429 + Retry-After


class JsonRpcError(Exception):
    """An error answered as a JSON-RPC error object with a chosen HTTP status."""

    def __init__(
        self,
        code: int,
        message: str,
        *,
        http_status: int = 200,
        data: Any = None,
        headers: dict[str, str] | None = None,
        request_id: str | int | None = None,
        method: str | None = None,
    ) -> None:
        super().__init__(message)
        # the request's id and method, for errors raised before the request was fully read
        self.request_id = request_id
        self.method = method
        self.code = code
        self.message = message
        self.http_status = http_status
        self.data = data
        self.headers = headers or {}

    def to_error(self) -> dict[str, Any]:
        error: dict[str, Any] = {"code": self.code, "message": self.message}
        if self.data is not None:
            error["data"] = self.data
        return error


def refusing_initialize(exc: JsonRpcError) -> JsonRpcError:
    """`exc` as the answer to an `initialize` request: it names the versions this server speaks.

    2026-07-28 has no handshake, so every `initialize` is refused; the versioning rules ask that
    such an error name the supported versions. SDKs in their legacy mode show users only the
    message, so it says so in words too, and `data.supported` says it to programs. The code and
    the HTTP status stay what the request earned (the conformance suite checks them).
    """
    versions = ", ".join(SUPPORTED_VERSIONS)
    data = exc.data if isinstance(exc.data, dict) else {}
    return JsonRpcError(
        exc.code,
        f"This server speaks MCP {versions} only, which has no initialize handshake: use a client "
        f"that supports MCP {versions} ({exc.message})",
        http_status=exc.http_status,
        data={**data, "supported": list(SUPPORTED_VERSIONS)},
        headers=exc.headers,
        request_id=exc.request_id,
        method=exc.method,
    )


def invalid_params(
    message: str, *, reason: str | None = None, http_status: int = 200
) -> JsonRpcError:
    return JsonRpcError(
        INVALID_PARAMS,
        message,
        http_status=http_status,
        data={"reason": reason} if reason else None,
    )


def missing_capability(required: dict[str, Any]) -> JsonRpcError:
    return JsonRpcError(
        MISSING_CAPABILITY,
        "This request needs a client capability that was not declared",
        http_status=400,
        data={"requiredCapabilities": required},
    )


def rate_limited(message: str, seconds: float) -> JsonRpcError:
    """A refusal for a spent budget (app/limits.py): HTTP 429 and when to try again."""
    wait = retry_after(seconds)
    return JsonRpcError(
        RATE_LIMITED,
        f"{message}; retry after {wait} s",
        http_status=429,
        data={"retryAfterSeconds": int(wait)},
        headers={"Retry-After": wait},
    )
