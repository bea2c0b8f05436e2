"""parse_body: compact bodies take orjson's path, everything else the standard library's; both
must read a body the same way and refuse the same bodies (B1, B2, B6)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from app.mcp.envelope import parse_body
from app.mcp.protocol import INVALID_REQUEST, PARSE_ERROR, JsonRpcError

META = {
    "io.modelcontextprotocol/protocolVersion": "2026-07-28",
    "io.modelcontextprotocol/clientCapabilities": {"elicitation": {"url": {}}},
}
ARGUMENT_SAMPLES: list[Any] = [
    {"provider": "demo"},
    {"text": "café ☕ 𝄞", "escapes": 'tab\t quote" slash/ nul\u0000'},
    {"numbers": [0, -1, 1.5, 1e300, 2**63 - 1, 2**64, -(2**70), 0.1, 1e-7]},
    {"nested": {"a": [{"b": None, "c": True, "d": False}], "empty": {}, "list": []}},
]


def request(arguments: Any) -> dict[str, Any]:
    params = {"name": "connect_account", "arguments": arguments, "_meta": META}
    return {"jsonrpc": "2.0", "id": 7, "method": "tools/call", "params": params}


@pytest.mark.parametrize("arguments", ARGUMENT_SAMPLES)
@pytest.mark.parametrize(
    "encode",
    [
        pytest.param(
            lambda v: json.dumps(v, separators=(",", ":"), ensure_ascii=False), id="compact"
        ),
        pytest.param(lambda v: json.dumps(v, separators=(",", ":")), id="compact-ascii"),
        pytest.param(json.dumps, id="spaced"),
    ],
)
def test_every_encoding_of_a_request_reads_as_the_standard_library_reads_it(
    arguments: Any, encode: Any
) -> None:
    body = encode(request(arguments)).encode()

    message = parse_body(body)

    expected = json.loads(body)
    assert message.id == 7
    assert message.method == "tools/call"
    assert message.params == expected["params"]
    assert json.dumps(message.params["arguments"]) == json.dumps(expected["params"]["arguments"])


@pytest.mark.parametrize(
    "body",
    [
        b'{"jsonrpc":"2.0","id":1,"id":2,"method":"ping"}',
        b'{"jsonrpc":"2.0","id":1,"method":"ping","params":{"a":1,"a":1}}',
        b'{"jsonrpc":"2.0","id":1,"method":"ping","params":{"x":[{"k":1,"k":2}]}}',
        b'{"jsonrpc": "2.0", "id": 1, "method": "ping", "method": "ping"}',
    ],
    ids=["top-level", "same-value", "inside-a-list", "spaced"],
)
def test_b6_a_duplicate_key_anywhere_is_an_invalid_request(body: bytes) -> None:
    with pytest.raises(JsonRpcError) as refused:
        parse_body(body)

    assert refused.value.code == INVALID_REQUEST
    assert "Duplicate keys" in refused.value.message


@pytest.mark.parametrize(
    "body",
    [
        b'{"jsonrpc":"2.0",',
        b'{"jsonrpc":"2.0","id":1,"method":"ping","params":{"x":NaN}}',
        b'{"jsonrpc":"2.0","id":1,"method":"ping","params":{"x":Infinity}}',
        b'{"jsonrpc":"2.0","id":1,"method":"ping","params":{"x":1e999}}',
        b'{"jsonrpc":"2.0", "id":1,"method":"ping","params":{"x":-1E+400}}',
        b'\xff{"jsonrpc":"2.0"}',
        b"[" * 5000 + b"]" * 5000,
    ],
    ids=["truncated", "nan", "infinity", "overflow", "overflow-spaced", "not-utf8", "deep"],
)
def test_b1_b2_what_is_not_json_is_a_parse_error(body: bytes) -> None:
    with pytest.raises(JsonRpcError) as refused:
        parse_body(body)

    assert refused.value.code == PARSE_ERROR
