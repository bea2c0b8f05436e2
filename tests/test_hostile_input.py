"""L3: hostile text in a request gets a specific answer, never the server's own 500.

Lone surrogates (`\\ud800` as JSON text: valid JSON syntax, but no encoder can write the string
back) in the JSON-RPC id, method and params, in /api/v1 bodies, and in header values: a 4xx in
the surface's own shape (JSON-RPC error, problem JSON). NUL characters: refused (422) in /api/v1
bodies and queries, whose strings reach the database (PostgreSQL text cannot hold a NUL); in MCP
tool arguments a NUL is a character like any other, and the tool answers it. In every case the
broker log shows no traceback.
"""

from __future__ import annotations

import json
from typing import Any

import httpx2
import pytest

from .integration_api.test_api import fresh_name, register
from .support.broker import BrokerProcess, LogWindow
from .support.clients import request_body, request_headers
from .support.http import local_client
from .support.raw_http import exchange, request_head

pytestmark = pytest.mark.both_databases

SURROGATE = "\\ud800"  # as it appears in the JSON text
LOW_SURROGATE = "\\udfff"
NUL = "\\u0000"


def mcp_text(body: dict[str, Any], *replacements: tuple[str, str]) -> bytes:
    """`body` as JSON text with each placeholder replaced by raw JSON escape text."""
    text = json.dumps(body)
    for placeholder, escaped in replacements:
        text = text.replace(placeholder, escaped)
    return text.encode()


SURROGATE_CASES = {
    "surrogate_in_id": (request_body("tools/list", request_id="ID"), [("ID", SURROGATE)]),
    "surrogate_in_method": (request_body("tools/lisM"), [("M", SURROGATE)]),
    "surrogate_in_params": (
        request_body("tools/call", {"name": "list_providers", "arguments": {"x": "V"}}),
        [("V", LOW_SURROGATE)],
    ),
    "surrogate_in_meta_version": (
        request_body("tools/list", version="VERSION"),
        [("VERSION", SURROGATE)],
    ),
}


async def post_mcp(broker: BrokerProcess, token: str, body: dict[str, Any], text: bytes) -> Any:
    async with local_client(timeout=30) as http:
        return await http.post(broker.mcp_url, content=text, headers=request_headers(body, token))


@pytest.mark.parametrize("case", sorted(SURROGATE_CASES))
async def test_L3_mcp_lone_surrogate_gets_a_json_rpc_400(
    broker: BrokerProcess, token_for: Any, case: str
) -> None:
    """Before, in the id: uvicorn's plain 500 (the answer could not be encoded) and a traceback
    in the log."""
    body, replacements = SURROGATE_CASES[case]
    window = LogWindow(broker)
    response = await post_mcp(
        broker, token_for(fresh_name("hostile")), body, mcp_text(body, *replacements)
    )
    assert response.status_code == 400, response.text
    answer = response.json()
    assert answer["jsonrpc"] == "2.0"
    assert "id" not in answer
    assert answer["error"]["code"] in (-32600, -32020), answer
    await window.wait_for("POST /mcp")
    assert "Traceback" not in window.text()


NUL_CASES = {
    "nul_in_id": (request_body("tools/list", request_id="ID"), [("ID", NUL)]),
    "nul_in_unknown_provider": (
        request_body("tools/call", {"name": "connect_account", "arguments": {"provider": "P"}}),
        [("P", NUL)],
    ),
    "nul_in_scope": (
        request_body(
            "tools/call",
            {"name": "connect_account", "arguments": {"provider": "github", "scopes": ["S"]}},
        ),
        [("S", f"repo{NUL}")],
    ),
    "nul_in_disconnect": (
        request_body("tools/call", {"name": "disconnect_account", "arguments": {"provider": "P"}}),
        [("P", f"github{NUL}")],
    ),
}


@pytest.mark.parametrize("case", sorted(NUL_CASES))
async def test_L3_mcp_nul_is_answered_not_a_5xx(
    broker: BrokerProcess, token_for: Any, case: str
) -> None:
    body, replacements = NUL_CASES[case]
    window = LogWindow(broker)
    response = await post_mcp(
        broker, token_for(fresh_name("hostile")), body, mcp_text(body, *replacements)
    )
    assert response.status_code < 500, response.text
    answer = response.json()
    assert answer["jsonrpc"] == "2.0"
    assert "result" in answer or response.status_code >= 400, answer
    await window.wait_for("POST /mcp")
    assert "Traceback" not in window.text()
    assert "unavailable" not in window.text()


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("authorization", b"Bearer \xed\xa0\x80"),
        ("mcp-method", b"tools/\xed\xa0\x80"),
        ("mcp-protocol-version", b"\xed\xa0\x80"),
        ("mcp-name", b"=?base64?7aCA?="),  # base64 of the UTF-8 form of a lone surrogate
    ],
)
async def test_L3_mcp_hostile_header_gets_a_4xx(
    broker: BrokerProcess, token_for: Any, name: str, value: bytes
) -> None:
    body = request_body("tools/call", {"name": "list_providers", "arguments": {}})
    headers = request_headers(body, token_for(fresh_name("hostile")))
    raw = {k.lower(): v.encode() for k, v in headers.items()}
    raw[name] = value
    content = json.dumps(body).encode()
    raw["content-length"] = str(len(content)).encode()
    head = b"POST /mcp HTTP/1.1\r\nHost: 127.0.0.1:%d\r\n" % broker.config.port
    head += b"".join(k.encode() + b": " + v + b"\r\n" for k, v in raw.items()) + b"\r\n"
    window = LogWindow(broker)
    answer = await exchange(broker.config.port, head, [content])
    assert 400 <= answer.status < 500, answer.body
    assert "error" in json.loads(answer.body)
    await window.wait_for("POST /mcp")
    assert "Traceback" not in window.text()


@pytest.fixture(scope="module")
def secret(broker: BrokerProcess) -> str:
    return register(broker, fresh_name("hostile")).secret


API_BODY_CASES = {
    "surrogate_in_subject": ("SUBJECT", SURROGATE),
    "nul_in_subject": ("SUBJECT", f"a{NUL}b"),
    "surrogate_in_issuer": ("ISSUER", SURROGATE),
    "surrogate_in_capabilities": ("CAPABILITY", LOW_SURROGATE),
    "nul_in_client_name": ("CLIENT", NUL),
}


@pytest.mark.parametrize("case", sorted(API_BODY_CASES))
async def test_L3_api_hostile_body_gets_a_problem_4xx(
    broker: BrokerProcess, secret: str, case: str
) -> None:
    placeholder, escaped = API_BODY_CASES[case]
    body = {
        "user": {"issuer": "ISSUER", "subject": "SUBJECT"},
        "client_capabilities": {"elicitation": {"url": {}}, "experimental": {"x": "CAPABILITY"}},
        "client_name": "CLIENT",
    }
    text = json.dumps(body).replace(placeholder, escaped)
    content = text.replace("ISSUER", broker.config.issuer).replace("SUBJECT", fresh_name("s"))
    window = LogWindow(broker)
    async with local_client(timeout=30) as http:
        response = await http.post(
            f"{broker.url}/api/v1/connections/demo/require",
            content=content.encode(),
            headers={"Authorization": f"Bearer {secret}", "Content-Type": "application/json"},
        )
    assert 400 <= response.status_code < 500, response.text
    assert response.headers["content-type"] == "application/problem+json"
    await window.wait_for("POST /api/v1")
    assert "Traceback" not in window.text()


@pytest.mark.parametrize("path", ["/api/v1/credentials/demo", "/api/v1/connections"])
@pytest.mark.parametrize("field", ["issuer", "subject"])
async def test_L3_api_nul_in_query_gets_a_422(
    broker: BrokerProcess, secret: str, path: str, field: str
) -> None:
    """Before: the NUL reached the database (PostgreSQL refuses it: a 503) or a lookup."""
    values = {"issuer": broker.config.issuer, "subject": fresh_name("s")}
    query = str(httpx2.QueryParams(values)).replace(f"{field}=", f"{field}=a%00", 1)
    head = request_head(
        "GET", f"{path}?{query}", broker.config.port, {"Authorization": f"Bearer {secret}"}
    )
    window = LogWindow(broker)
    answer = await exchange(broker.config.port, head)
    assert answer.status == 422, answer.body
    assert answer.headers["content-type"] == "application/problem+json"
    assert json.loads(answer.body)["errors"][0]["loc"] == ["query", field]
    await window.wait_for(f"GET {path}")
    assert "Traceback" not in window.text()


async def test_L3_api_hostile_secret_gets_a_401(broker: BrokerProcess) -> None:
    head = b"GET /api/v1/connections?issuer=x&subject=y HTTP/1.1\r\n"
    head += b"Host: 127.0.0.1:%d\r\nAuthorization: Bearer cbs_\xed\xa0\x80\x00\r\n\r\n" % (
        broker.config.port
    )
    answer = await exchange(broker.config.port, head)
    assert answer.status in (400, 401), answer.body
