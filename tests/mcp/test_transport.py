"""Streamable HTTP transport and JSON-RPC envelope of POST /mcp (SECURITY.md §3.2, B1-B20).

HTTP status policy pinned here (SECURITY.md §3): a body that is not one valid JSON-RPC request is
answered 400 with -32700/-32600, echoing the id only when it could be read; header and _meta
problems are 400 (-32020, -32021, -32022, -32602 for missing _meta fields); an unknown method
is 404 -32601; other bad params (an unknown tool) are -32602 at HTTP 200. Tests that could have
side effects call `connect_account` for a user of their own and assert afterwards that no flow
row exists for them.
"""

from __future__ import annotations

import asyncio
import json
import secrets
from collections.abc import AsyncIterator
from typing import Any

import httpx2
import pytest
from sqlalchemy.ext.asyncio import AsyncEngine

from ..conftest import count_rows
from ..support.broker import BrokerProcess
from ..support.clients import McpHttp, request_body, request_headers
from ..support.schema import validate, validate_response

BROKER_TOOLS = {"connect_account", "list_connections", "disconnect_account", "list_providers"}
URL_CAPABILITY: dict[str, Any] = {"elicitation": {"url": {}}}
TWO_MIB = 2 * 1024 * 1024


def fresh_user(label: str) -> str:
    """A subject no other test on the shared broker has used, so row counts are this test's."""
    return f"{label}-{secrets.token_hex(4)}"


def connect_body(**overrides: Any) -> dict[str, Any]:
    """The canonical side-effecting request: round 1 of connect_account creates a flow row."""
    return request_body(
        "tools/call", {"name": "connect_account", "arguments": {"provider": "demo"}}, **overrides
    )


async def flows_of(db: AsyncEngine, user: str) -> int:
    return await count_rows(db, "flows", subject=user)


SCHEMA_FOR_CODE = {
    -32020: "HeaderMismatchError",
    -32021: "MissingRequiredClientCapabilityError",
    -32022: "UnsupportedProtocolVersionError",
}


def rpc_error(response: httpx2.Response, status: int, code: int) -> dict[str, Any]:
    """The schema-valid JSON-RPC error object of `response`, after checking status and code."""
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json")
    body: dict[str, Any] = response.json()
    validate_response(body)
    if code in SCHEMA_FOR_CODE:
        validate(body, SCHEMA_FOR_CODE[code])
    assert body["error"]["code"] == code, body
    error: dict[str, Any] = body["error"]
    return error


async def post_raw(
    mcp: McpHttp, content: bytes, token: str, headers: dict[str, str] | None = None
) -> httpx2.Response:
    """POST bytes that are not a well-formed request, with the canonical tools/list headers."""
    base = request_headers(request_body("tools/list"), token)
    return await mcp.http.post(mcp.mcp_url, content=content, headers={**base, **(headers or {})})


# ---------------------------------------------------------------------------------------------
# Baseline: what a well-formed client gets
# ---------------------------------------------------------------------------------------------


async def test_server_discover_describes_a_tools_server(mcp: McpHttp, token_for: Any) -> None:
    """server/discover is mandatory in 2026-07-28: versions, capabilities, cache hints, info."""
    body = request_body("server/discover")

    response = await mcp.post(body, token=token_for(fresh_user("discover")))

    assert response.status_code == 200, response.text
    answer = response.json()
    validate(answer, "JSONRPCResultResponse")
    result = answer["result"]
    validate(result, "DiscoverResult")
    assert answer["id"] == body["id"]
    assert result["resultType"] == "complete"
    assert result["supportedVersions"] == ["2026-07-28"]
    assert isinstance(result["capabilities"]["tools"], dict)
    assert isinstance(result["ttlMs"], int) and result["ttlMs"] > 0
    assert result["cacheScope"] == "public"
    server_info = result["_meta"]["io.modelcontextprotocol/serverInfo"]
    assert server_info["name"] and server_info["version"]


async def test_tools_list_offers_the_four_broker_tools(mcp: McpHttp, token_for: Any) -> None:
    """DESIGN §4: the broker's own tools, as a schema-valid ListToolsResult."""
    response = await mcp.post(request_body("tools/list"), token=token_for(fresh_user("list")))

    assert response.status_code == 200, response.text
    answer = response.json()
    validate(answer, "JSONRPCResultResponse")
    validate(answer["result"], "ListToolsResult")
    names = {tool["name"] for tool in answer["result"]["tools"]}
    assert names >= BROKER_TOOLS


# ---------------------------------------------------------------------------------------------
# B1-B6: bodies that are not one valid JSON-RPC request
# ---------------------------------------------------------------------------------------------


async def test_b1_malformed_json_is_a_parse_error(mcp: McpHttp, token_for: Any) -> None:
    """B1. A truncated body is -32700 at HTTP 400, without an id (none could be read)."""
    response = await post_raw(mcp, b'{"jsonrpc":"2.0",', token_for(fresh_user("b1")))

    rpc_error(response, 400, -32700)
    assert "id" not in response.json()


async def test_b2_deeply_nested_json_is_a_parse_error(mcp: McpHttp, token_for: Any) -> None:
    """B2. Python's json raises RecursionError on deep nesting; it must not become a 500."""
    depth = 100_000

    response = await post_raw(mcp, b"[" * depth + b"]" * depth, token_for(fresh_user("b2")))

    rpc_error(response, 400, -32700)
    assert "id" not in response.json()


async def test_b3_batch_is_refused_without_running_any_element(
    mcp: McpHttp, token_for: Any, db: AsyncEngine
) -> None:
    """B3. 2026-07-28 carries one message per POST: a batch is one -32600 error, nothing runs."""
    user = fresh_user("b3")
    batch = [request_body("tools/list"), connect_body()]

    response = await post_raw(mcp, json.dumps(batch).encode(), token_for(user))

    rpc_error(response, 400, -32600)
    assert isinstance(response.json(), dict)
    assert "id" not in response.json()
    assert await flows_of(db, user) == 0


async def test_b4_response_object_is_an_invalid_request(mcp: McpHttp, token_for: Any) -> None:
    """B4. Clients never POST responses; a result object is -32600, echoing its id."""
    content = b'{"jsonrpc":"2.0","id":1,"result":{}}'

    response = await post_raw(mcp, content, token_for(fresh_user("b4")))

    rpc_error(response, 400, -32600)
    assert response.json()["id"] == 1


@pytest.mark.parametrize(
    "content",
    [
        b'{"jsonrpc":"2.0","id":7,"method":5}',
        b'{"jsonrpc":"2.0","id":"seven","method":""}',
        b'{"jsonrpc":"1.0","id":7,"method":"tools/list"}',
        b'{"id":7,"method":"tools/list"}',
    ],
    ids=["method-not-a-string", "method-empty", "jsonrpc-1.0", "jsonrpc-missing"],
)
async def test_an_invalid_request_whose_id_could_be_read_echoes_it(
    mcp: McpHttp, token_for: Any, content: bytes
) -> None:
    """spec/DIGEST.md §2.2: an error echoes the request id; it is left out only when it could
    not be read (B1-B3, B5, B6)."""
    response = await post_raw(mcp, content, token_for(fresh_user("id-echo")))

    rpc_error(response, 400, -32600)
    assert response.json()["id"] == json.loads(content)["id"]


async def test_b5_null_id_is_an_invalid_request(mcp: McpHttp, token_for: Any) -> None:
    """B5. MCP request ids are strings or integers, never null."""
    body = request_body("tools/list")
    body["id"] = None

    response = await post_raw(mcp, json.dumps(body).encode(), token_for(fresh_user("b5")))

    rpc_error(response, 400, -32600)
    assert "id" not in response.json()


async def test_b6_duplicate_keys_are_an_invalid_request(
    mcp: McpHttp, token_for: Any, db: AsyncEngine
) -> None:
    """B6. The stdlib keeps the last duplicate key, so a proxy and the broker could disagree."""
    user = fresh_user("b6")
    meta = json.dumps(connect_body()["params"]["_meta"])
    content = (
        '{"jsonrpc":"2.0","id":1,"method":"tools/list","method":"tools/call",'
        f'"params":{{"name":"connect_account","arguments":{{"provider":"demo"}},"_meta":{meta}}}}}'
    ).encode()

    response = await post_raw(mcp, content, token_for(user), headers={"Mcp-Method": "tools/call"})

    rpc_error(response, 400, -32600)
    assert await flows_of(db, user) == 0


async def test_b6_duplicate_keys_in_compact_json_are_an_invalid_request(
    mcp: McpHttp, token_for: Any, db: AsyncEngine
) -> None:
    """B6, in the compact form real clients send (no spaces), with the duplicate nested."""
    user = fresh_user("b6c")
    params = connect_body()["params"]
    meta = json.dumps(params["_meta"], separators=(",", ":"))
    content = (
        '{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":"connect_account",'
        f'"arguments":{{"provider":"github","provider":"demo"}},"_meta":{meta}}}}}'
    ).encode()
    headers = {"Mcp-Method": "tools/call", "Mcp-Name": "connect_account"}

    response = await post_raw(mcp, content, token_for(user), headers=headers)

    rpc_error(response, 400, -32600)
    assert await flows_of(db, user) == 0


# ---------------------------------------------------------------------------------------------
# B7-B8: body size and media type
# ---------------------------------------------------------------------------------------------


def oversized_body() -> bytes:
    """A syntactically valid request padded to 2 MiB (the limit is 256 KiB)."""
    body = connect_body()
    body["params"]["arguments"]["padding"] = "x" * TWO_MIB
    return json.dumps(body).encode()


async def test_b7_oversized_body_with_content_length_is_refused(
    mcp: McpHttp, token_for: Any
) -> None:
    """B7. The declared length alone is enough to refuse with 413."""
    content = oversized_body()

    response = await post_raw(mcp, content, token_for(fresh_user("b7")))

    assert response.request.headers["content-length"] == str(len(content))
    rpc_error(response, 413, -32600)


async def test_b7_oversized_chunked_body_is_refused(mcp: McpHttp, token_for: Any) -> None:
    """B7. Without Content-Length the broker counts bytes while reading and stops at the limit."""
    content = oversized_body()

    async def chunks() -> AsyncIterator[bytes]:
        for start in range(0, len(content), 64 * 1024):
            yield content[start : start + 64 * 1024]

    base = request_headers(connect_body(), token_for(fresh_user("b7c")))
    response = await mcp.http.post(mcp.mcp_url, content=chunks(), headers=base)

    assert "content-length" not in response.request.headers
    assert response.request.headers["transfer-encoding"] == "chunked"
    rpc_error(response, 413, -32600)


async def test_b7_a_chunked_body_under_the_limit_is_read_whole(
    mcp: McpHttp, token_for: Any
) -> None:
    """B7 control: the byte counting reads every chunk of a body sent in pieces and answers it
    like the same body sent at once."""
    content = json.dumps(connect_body()).encode()

    async def chunks() -> AsyncIterator[bytes]:
        for start in range(0, len(content), 7):
            yield content[start : start + 7]

    base = request_headers(connect_body(), token_for(fresh_user("b7ok")))
    response = await mcp.http.post(mcp.mcp_url, content=chunks(), headers=base)

    assert response.request.headers["transfer-encoding"] == "chunked"
    assert response.status_code == 200
    assert response.json()["result"]["resultType"] == "input_required"


async def test_b7_a_body_past_the_integration_apis_cap_is_read_within_the_mcp_cap(
    mcp: McpHttp, token_for: Any
) -> None:
    """B7 control: /mcp caps its body at `server.max_body_bytes` (256 KiB), in JSON-RPC; the
    app-wide cap of the other routes (`server.max_api_body_bytes`, 64 KiB) leaves it alone."""
    body = connect_body()
    body["params"]["arguments"]["padding"] = "x" * (128 * 1024)

    response = await mcp.post(body, token=token_for(fresh_user("b7mid")))

    assert response.status_code == 200, response.text
    assert response.json()["error"]["code"] == -32602  # read whole: the argument is refused


async def test_b8_wrong_content_type_is_refused(
    mcp: McpHttp, token_for: Any, db: AsyncEngine
) -> None:
    """B8. text/plain makes a cross-site "simple request" possible; only application/json runs."""
    user = fresh_user("b8")

    response = await mcp.post(
        connect_body(), token=token_for(user), headers={"Content-Type": "text/plain"}
    )

    rpc_error(response, 415, -32600)
    assert await flows_of(db, user) == 0


# ---------------------------------------------------------------------------------------------
# B9-B13: protocol version, MCP headers, _meta and client capabilities
# ---------------------------------------------------------------------------------------------


async def test_b9_unsupported_version_names_the_supported_ones(
    mcp: McpHttp, token_for: Any
) -> None:
    """B9. Header and _meta agree on a version we do not speak: -32022 with both data fields."""
    body = request_body("tools/list", version="1900-01-01")

    response = await mcp.post(body, token=token_for(fresh_user("b9")))

    error = rpc_error(response, 400, -32022)
    assert error["data"] == {"supported": ["2026-07-28"], "requested": "1900-01-01"}
    assert response.json()["id"] == body["id"]


@pytest.mark.parametrize(
    ("header", "meta_version"),
    [(None, "2026-07-28"), ("2026-07-28", "2025-11-25")],
    ids=["header-missing", "header-differs-from-meta"],
)
async def test_b10_version_header_missing_or_different_is_a_header_mismatch(
    mcp: McpHttp, token_for: Any, header: str | None, meta_version: str
) -> None:
    """B10. MCP-Protocol-Version must be present and equal _meta's version (checked first)."""
    body = request_body("tools/list", version=meta_version)
    headers = {"MCP-Protocol-Version": header} if header else {}
    drop = () if header else ("MCP-Protocol-Version",)

    response = await mcp.post(body, token=token_for(fresh_user("b10")), headers=headers, drop=drop)

    rpc_error(response, 400, -32020)
    assert response.json()["id"] == body["id"]


@pytest.mark.parametrize(
    "mcp_name", ["disconnect_account", None], ids=["name-differs", "name-missing"]
)
async def test_b11_mcp_name_mismatch_runs_no_tool(
    mcp: McpHttp, token_for: Any, db: AsyncEngine, mcp_name: str | None
) -> None:
    """B11. A proxy may authorise on Mcp-Name; the body must not run a different tool."""
    user = fresh_user("b11")
    headers = {"Mcp-Name": mcp_name} if mcp_name else {}
    drop = () if mcp_name else ("Mcp-Name",)

    response = await mcp.post(connect_body(), token=token_for(user), headers=headers, drop=drop)

    rpc_error(response, 400, -32020)
    assert await flows_of(db, user) == 0


async def test_b11_mcp_method_mismatch_runs_nothing(
    mcp: McpHttp, token_for: Any, db: AsyncEngine
) -> None:
    """B11 (method variant). Mcp-Method must equal the body's method as well."""
    user = fresh_user("b11m")

    response = await mcp.post(
        connect_body(), token=token_for(user), headers={"Mcp-Method": "tools/list"}
    )

    rpc_error(response, 400, -32020)
    assert await flows_of(db, user) == 0


@pytest.mark.parametrize(
    ("header", "second"),
    [("Mcp-Method", "tools/list"), ("Mcp-Name", "disconnect_account")],
    ids=["method", "name"],
)
async def test_b11_a_repeated_mcp_header_runs_nothing(
    mcp: McpHttp, token_for: Any, db: AsyncEngine, header: str, second: str
) -> None:
    """B11 (repeated variant). The body's header first, then another value: a proxy acting on
    the last line must not see one request while the broker runs another. Repeated lines are
    one comma-separated value (RFC 9110 §5.3), which matches nothing: -32020."""
    user = fresh_user("b11r")
    body = connect_body()
    headers = [*request_headers(body, token_for(user)).items(), (header, second)]

    response = await mcp.http.post(mcp.mcp_url, content=json.dumps(body).encode(), headers=headers)

    rpc_error(response, 400, -32020)
    assert response.json()["id"] == body["id"]
    assert await flows_of(db, user) == 0


@pytest.mark.parametrize(
    "missing",
    [
        "io.modelcontextprotocol/clientCapabilities",
        "io.modelcontextprotocol/protocolVersion",
        "_meta",
    ],
)
async def test_b12_missing_meta_fields_are_invalid_params(
    mcp: McpHttp, token_for: Any, db: AsyncEngine, missing: str
) -> None:
    """B12. Every request carries _meta with version and capabilities: else -32602 at 400."""
    user = fresh_user("b12")
    body = connect_body()
    if missing == "_meta":
        del body["params"]["_meta"]
    else:
        del body["params"]["_meta"][missing]

    response = await mcp.post(body, token=token_for(user))

    rpc_error(response, 400, -32602)
    assert await flows_of(db, user) == 0


@pytest.mark.parametrize(
    "capabilities",
    [{}, {"elicitation": {}}, {"elicitation": {"form": {}}}],
    ids=["none", "empty-elicitation", "form-only"],
)
async def test_b13_client_without_url_elicitation_gets_missing_capability(
    mcp: McpHttp, token_for: Any, db: AsyncEngine, capabilities: dict[str, Any]
) -> None:
    """B13. URL mode only for clients that declare elicitation.url (an empty object = form)."""
    user = fresh_user("b13")

    response = await mcp.post(connect_body(capabilities=capabilities), token=token_for(user))

    error = rpc_error(response, 400, -32021)
    assert error["data"] == {"requiredCapabilities": URL_CAPABILITY}
    assert "/connect/" not in response.text
    assert await flows_of(db, user) == 0


# ---------------------------------------------------------------------------------------------
# B14-B17: methods, tools and legacy traffic
# ---------------------------------------------------------------------------------------------


async def test_b14_unknown_method_is_not_found_with_404(mcp: McpHttp, token_for: Any) -> None:
    """B14. 2026-07-28 Streamable HTTP: -32601 travels with HTTP 404 and echoes the id."""
    body = request_body("tools/explode")

    response = await mcp.post(body, token=token_for(fresh_user("b14")))

    rpc_error(response, 404, -32601)
    assert response.json()["id"] == body["id"]


async def test_b15_unknown_tool_is_invalid_params_at_200(mcp: McpHttp, token_for: Any) -> None:
    """B15. An unknown tool is -32602 "Unknown tool", answered with HTTP 200 (our policy)."""
    body = request_body("tools/call", {"name": "nope", "arguments": {}})

    response = await mcp.post(body, token=token_for(fresh_user("b15")))

    error = rpc_error(response, 200, -32602)
    assert error["message"].startswith("Unknown tool")
    assert response.json()["id"] == body["id"]


@pytest.mark.parametrize("method", ["GET", "DELETE"])
async def test_b16_get_and_delete_are_method_not_allowed(
    mcp: McpHttp, token_for: Any, method: str
) -> None:
    """B16. No GET stream and no session to delete in 2026-07-28: 405, never an SSE stream."""
    headers = {
        "Authorization": f"Bearer {token_for(fresh_user('b16'))}",
        "Accept": "text/event-stream",
        "MCP-Protocol-Version": "2026-07-28",
    }

    response = await mcp.http.request(method, mcp.mcp_url, headers=headers)

    assert response.status_code == 405
    assert "POST" in response.headers["allow"]
    assert not response.headers.get("content-type", "").startswith("text/event-stream")


async def test_the_endpoint_with_a_trailing_slash_is_not_found_never_redirected(
    mcp: McpHttp, token_for: Any
) -> None:
    """/mcp/ is not the endpoint: 404 like any unknown path, not a redirect to /mcp (a client
    would then talk to an endpoint other than the resource its tokens are for)."""
    body = request_body("tools/list")
    headers = request_headers(body, token_for(fresh_user("slash")))

    response = await mcp.http.post(mcp.mcp_url + "/", json=body, headers=headers)

    assert response.status_code == 404, response.text
    assert "location" not in response.headers
    assert response.json() == {"detail": "Not Found"}


async def test_b17_legacy_session_header_is_ignored_and_never_echoed(
    mcp: McpHttp, token_for: Any
) -> None:
    """B17. Sessions are gone: Mcp-Session-Id is ignored, and none is minted or echoed."""
    response = await mcp.post(
        request_body("tools/list"),
        token=token_for(fresh_user("b17")),
        headers={"Mcp-Session-Id": "abc"},
    )

    assert response.status_code == 200, response.text
    validate(response.json()["result"], "ListToolsResult")
    assert "mcp-session-id" not in response.headers


# ---------------------------------------------------------------------------------------------
# B18-B19: Origin and Host (DNS rebinding)
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("origin", ["https://evil.example", "null"])
async def test_b18_foreign_origin_is_forbidden(
    mcp: McpHttp, token_for: Any, db: AsyncEngine, origin: str
) -> None:
    """B18. A present Origin that is not ours is refused with 403 before anything runs."""
    user = fresh_user("b18")

    response = await mcp.post(connect_body(), token=token_for(user), headers={"Origin": origin})

    rpc_error(response, 403, -32600)
    assert "id" not in response.json()
    assert await flows_of(db, user) == 0


async def test_b18_own_origin_is_accepted(
    mcp: McpHttp, token_for: Any, broker: BrokerProcess
) -> None:
    """B18 (control). A browser-based client on the broker's own origin is served."""
    response = await mcp.post(
        request_body("tools/list"),
        token=token_for(fresh_user("b18ok")),
        headers={"Origin": broker.url},
    )

    assert response.status_code == 200, response.text


@pytest.mark.parametrize(
    "extra", [{}, {"Origin": "http://evil.example.com"}], ids=["host-only", "host-and-origin"]
)
async def test_b19_foreign_host_is_refused(
    mcp: McpHttp, token_for: Any, db: AsyncEngine, extra: dict[str, str]
) -> None:
    """B19. Host allow-list (conformance `dns-rebinding-protection`): 4xx and nothing runs."""
    user = fresh_user("b19")

    response = await mcp.post(
        connect_body(), token=token_for(user), headers={"Host": "evil.example.com", **extra}
    )

    assert 400 <= response.status_code < 500
    assert "evil.example.com" not in response.text
    assert await flows_of(db, user) == 0


async def test_b19_health_probes_answer_any_host_and_nothing_else_does(
    mcp: McpHttp, broker: BrokerProcess
) -> None:
    """B19. A container HEALTHCHECK or a Kubernetes probe addresses the process by its own IP and
    port: /healthz and /readyz answer whatever the Host; every other page still refuses it."""
    probe_host = {"Host": "10.1.2.3:8000"}

    health = await mcp.http.get(f"{broker.url}/healthz", headers=probe_host)
    ready = await mcp.http.get(f"{broker.url}/readyz", headers=probe_host)
    metadata = await mcp.http.get(
        f"{broker.url}/.well-known/oauth-protected-resource/mcp", headers=probe_host
    )
    login = await mcp.http.get(f"{broker.url}/login", headers=probe_host)
    page = await mcp.http.get(f"{broker.url}/healthz/../connections", headers=probe_host)

    assert (health.status_code, ready.status_code) == (200, 200)
    assert [metadata.status_code, login.status_code, page.status_code] == [421, 421, 421]


async def test_b19_forwarded_host_does_not_reach_the_elicitation_url(
    mcp: McpHttp, token_for: Any, broker: BrokerProcess
) -> None:
    """B19. The elicitation URL comes from public_url, never from request headers."""
    response = await mcp.post(
        connect_body(),
        token=token_for(fresh_user("b19f")),
        headers={"X-Forwarded-Host": "evil.example.com", "Forwarded": "host=evil.example.com"},
    )

    assert response.status_code == 200, response.text
    body = response.json()
    validate_response(body, "InputRequiredResult")
    (request,) = body["result"]["inputRequests"].values()
    assert request["params"]["url"].startswith(f"{broker.url}/connect/")
    assert "evil.example.com" not in response.text


# ---------------------------------------------------------------------------------------------
# B20: notifications
# ---------------------------------------------------------------------------------------------


def as_notification(body: dict[str, Any]) -> dict[str, Any]:
    return {key: value for key, value in body.items() if key != "id"}


async def test_b20_notification_is_accepted_with_an_empty_202(mcp: McpHttp, token_for: Any) -> None:
    """B20. A well-formed notification gets 202 and no body (we pin 202, not 400).

    Notifications carry no request _meta (schema NotificationParams), only the MCP headers.
    """
    body = {"jsonrpc": "2.0", "method": "notifications/cancelled", "params": {"requestId": 7}}
    validate(body, "CancelledNotification")

    response = await mcp.post(body, token=token_for(fresh_user("b20")))

    assert response.status_code == 202, response.text
    assert response.content == b""


@pytest.mark.parametrize(
    ("version", "code"), [(None, -32020), ("1900-01-01", -32022)], ids=["missing", "unsupported"]
)
async def test_b20_notification_without_a_usable_version_header_is_refused(
    mcp: McpHttp, token_for: Any, version: str | None, code: int
) -> None:
    """B20. The version header is required on every POST, notifications included (4xx, no id)."""
    body = {"jsonrpc": "2.0", "method": "notifications/cancelled", "params": {"requestId": 7}}
    headers = {"MCP-Protocol-Version": version} if version else {}
    drop = () if version else ("MCP-Protocol-Version",)

    response = await mcp.post(body, token=token_for(fresh_user("b20v")), headers=headers, drop=drop)

    rpc_error(response, 400, code)
    assert "id" not in response.json()


async def test_b20_notification_has_no_side_effect(
    mcp: McpHttp, token_for: Any, db: AsyncEngine
) -> None:
    """B20. A tools/call without an id is a notification: nothing runs, no flow is created."""
    user = fresh_user("b20n")

    response = await mcp.post(as_notification(connect_body()), token=token_for(user))

    assert response.status_code == 202
    assert response.content == b""
    assert await flows_of(db, user) == 0


async def test_an_idle_connection_stays_open_past_the_clients_keep_alive_expiry(
    broker: BrokerProcess,
) -> None:
    """A client that reuses its connection after 6 s idle (httpx, the MCP SDK's client, keeps one
    for 5 s) gets its answer: the broker does not close it meanwhile (app/cli.py)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", broker.config.port)
    request = f"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1:{broker.config.port}\r\n\r\n".encode()
    try:
        answers = []
        for pause in (0, 6):
            await asyncio.sleep(pause)
            writer.write(request)
            await writer.drain()
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), timeout=5)
            length = int(head.lower().split(b"content-length:")[1].split(b"\r\n")[0])
            await reader.readexactly(length)
            answers.append(head.split(b"\r\n")[0])
    finally:
        writer.close()
    assert answers == [b"HTTP/1.1 200 OK"] * 2
