"""The sealed `requestState` that round-trips through the MCP client (MRTR server rules 4-5).

Format: itsdangerous `URLSafeTimedSerializer` (HMAC-SHA256, salt per purpose, key derived from the
signing keys; every configured key verifies, the first one signs). The payload is readable by the
client, so it carries only: a keyed digest of the principal, the OAuth client id, method, tool name,
a digest of the arguments, the flow id and input key, and small tool data. Never identity, tokens
or provider data. Whether the interaction finished lives in the flows table, not here.

Any failure is one JSON-RPC -32602 with a machine reason (`invalid`, `expired`,
`principal_mismatch`, `request_mismatch`); the blob itself is never logged.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from itsdangerous import BadSignature, SignatureExpired, URLSafeTimedSerializer
from itsdangerous.encoding import base64_encode, want_bytes

from app.auth.principal import McpCaller
from app.crypto import Keyring
from app.jsonbytes import CompactJson
from app.mcp.protocol import JsonRpcError, invalid_params

logger = logging.getLogger("broker.security")

MAX_STATE_LENGTH = 8192
SALT = "mcp.requestState.v1"


@dataclass(frozen=True)
class StatePayload:
    """What a verified state says beyond its binding."""

    flow_id: str | None
    input_key: str | None
    data: Any


def arguments_digest(arguments: dict[str, Any]) -> str:
    canonical = json.dumps(arguments, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(canonical.encode()).hexdigest()


class _Serializer(URLSafeTimedSerializer):
    default_signer_kwargs = {"digest_method": hashlib.sha256}  # noqa: RUF012

    def dump_payload(self, obj: Any) -> bytes:
        """Base64 JSON without itsdangerous's zlib attempt: a state is a few hundred bytes,
        compressing it saves little and costs more than signing it. Loading still accepts both."""
        return base64_encode(want_bytes(self.serializer.dumps(obj, **self.serializer_kwargs)))


class RequestStateCodec:
    def __init__(
        self, keys: Keyring, *, max_age: int, clock: Callable[[], float] = time.time
    ) -> None:
        # itsdangerous signs with the last key of the list and verifies with all of them.
        secrets = list(reversed(keys.derive("request-state")))
        self._serializer = _Serializer(secrets, salt=SALT, serializer=CompactJson)
        # every configured key, active first: a state issued before a rotation still verifies
        self._principal_keys = keys.derive("request-state-principal")
        self._max_age = max_age
        self._clock = clock

    def _principal_macs(self, caller: McpCaller, *, active_only: bool = False) -> list[str]:
        who = f"{caller.principal.issuer}|{caller.principal.subject}".encode()
        keys = self._principal_keys[:1] if active_only else self._principal_keys
        return [hmac.new(key, who, hashlib.sha256).hexdigest()[:32] for key in keys]

    def issue(
        self,
        caller: McpCaller,
        *,
        method: str,
        name: str,
        arguments_digest: str,
        flow_id: str | None = None,
        input_key: str | None = None,
        data: Any = None,
    ) -> str:
        payload: dict[str, Any] = {
            "v": 1,
            "p": self._principal_macs(caller, active_only=True)[0],
            "c": caller.client_id,
            "m": method,
            "n": name,
            "a": arguments_digest,
        }
        if flow_id is not None:
            payload["f"] = flow_id
            payload["k"] = input_key
        if data is not None:
            payload["d"] = data
        state: str = self._serializer.dumps(payload)
        if len(state) > MAX_STATE_LENGTH:
            raise ValueError("request state too large")
        return state

    def verify(
        self, state: object, caller: McpCaller, *, method: str, name: str, arguments_digest: str
    ) -> StatePayload:
        """Check integrity, age, principal and request binding.

        Raises:
            JsonRpcError: -32602 with `data.reason`.
        """
        if not isinstance(state, str) or not state or len(state) > MAX_STATE_LENGTH:
            raise self._reject("invalid")
        try:
            payload = self._serializer.loads(state, max_age=self._max_age)
        except SignatureExpired:
            raise self._reject("expired") from None
        except BadSignature:
            raise self._reject("invalid") from None
        if not isinstance(payload, dict) or payload.get("v") != 1:
            raise self._reject("invalid")
        presented = str(payload.get("p"))
        if not any(hmac.compare_digest(presented, mac) for mac in self._principal_macs(caller)):
            raise self._reject("principal_mismatch")
        bound = (payload.get("c"), payload.get("m"), payload.get("n"), payload.get("a"))
        if bound != (caller.client_id, method, name, arguments_digest):
            raise self._reject("request_mismatch")
        flow_id = payload.get("f")
        input_key = payload.get("k")
        return StatePayload(
            flow_id=flow_id if isinstance(flow_id, str) else None,
            input_key=input_key if isinstance(input_key, str) else None,
            data=payload.get("d"),
        )

    @staticmethod
    def _reject(reason: str) -> JsonRpcError:
        logger.warning("request_state.invalid reason=%s", reason)
        return invalid_params("Invalid or expired requestState", reason=reason)
