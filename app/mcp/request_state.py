"""The sealed `requestState` that round-trips through the MCP client (MRTR server rules 4-5).

Format: `<payload>.<timestamp>.<signature>`, an itsdangerous `TimestampSigner` token (HMAC-SHA256,
key derived from the signing keys per purpose; every configured key verifies, the first one
signs) over the URL-safe base64 of the compact JSON payload. The payload is readable by the
client, so it carries only: a keyed digest of the principal, the OAuth client id, method, tool
name, a digest of the arguments, the flow id and input key, and small tool data. Never identity,
tokens or provider data. Whether the interaction finished lives in the flows table, not here.

Every state is checked on a hot path (each MCP retry), so the codec keeps itsdangerous's own
key derivation but runs it once, at start: the signer is built with the derived keys and
`key_derivation="none"`, which gives the same signatures for half the work per call.

Any failure is one JSON-RPC -32602 with a machine reason (`invalid`, `expired`,
`principal_mismatch`, `request_mismatch`); the blob itself is never logged.
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import logging
from dataclasses import dataclass
from typing import Any

from itsdangerous import BadData, SignatureExpired, TimestampSigner
from itsdangerous.encoding import base64_decode, base64_encode

from app import jsonbytes
from app.auth.principal import McpCaller
from app.crypto import Keyring, hmac_digest
from app.mcp.protocol import JsonRpcError, invalid_params

logger = logging.getLogger("broker.security")

MAX_STATE_LENGTH = 8192
SALT = "mcp.requestState.v1"
PRINCIPAL_CACHE_SIZE = 4096


@dataclass(frozen=True)
class StatePayload:
    """What a verified state says beyond its binding."""

    flow_id: str | None
    input_key: str | None
    data: Any


def arguments_digest(arguments: dict[str, Any]) -> str:
    """SHA-256 of the arguments as compact JSON with sorted keys."""
    return hashlib.sha256(jsonbytes.dumps(arguments, sort_keys=True)).hexdigest()


def _signer(keys: Keyring) -> TimestampSigner:
    """A signer whose keys are itsdangerous's own derivation of ours (salt SALT, SHA-256),
    computed here once instead of on every sign and verify."""
    derived = [
        TimestampSigner(key, salt=SALT, digest_method=hashlib.sha256).derive_key()
        for key in keys.derive("request-state")
    ]
    # itsdangerous signs with the last key of the list and verifies with all of them.
    return TimestampSigner(
        list(reversed(derived)),
        salt=SALT,
        key_derivation="none",
        digest_method=hashlib.sha256,
    )


class RequestStateCodec:
    def __init__(self, keys: Keyring, *, max_age: int) -> None:
        self._signer = _signer(keys)
        # every configured key, active first: a state issued before a rotation still verifies
        self._principal_keys = keys.derive("request-state-principal")
        self._max_age = max_age
        # A user's digests are the same on every request: remember the recent ones.
        self._macs_of = functools.lru_cache(maxsize=PRINCIPAL_CACHE_SIZE)(self._compute_macs)

    def _principal_macs(self, caller: McpCaller) -> tuple[str, ...]:
        """The principal's keyed digest under every configured key, the active key's first."""
        return self._macs_of(caller.principal.issuer, caller.principal.subject)

    def _compute_macs(self, issuer: str, subject: str) -> tuple[str, ...]:
        who = f"{issuer}|{subject}"
        return tuple(hmac_digest(key, who)[:32] for key in self._principal_keys)

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
            "p": self._principal_macs(caller)[0],
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
        state = self.sign(payload)
        if len(state) > MAX_STATE_LENGTH:
            raise ValueError("request state too large")
        return state

    def sign(self, payload: dict[str, Any]) -> str:
        """The signed, timestamped token of `payload`, whatever its size (`issue` checks that)."""
        return self._signer.sign(base64_encode(jsonbytes.dumps(payload))).decode("ascii")

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
            signed = self._signer.unsign(state, max_age=self._max_age)
            payload = jsonbytes.loads(base64_decode(signed))
        except SignatureExpired:
            raise self._reject("expired") from None
        except (BadData, ValueError):  # a bad signature, encoding or JSON
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
