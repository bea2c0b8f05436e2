"""The sealed `requestState` that round-trips through the MCP client (MRTR server rules 4-5).

Format: `<payload>.<timestamp>.<signature>`, an itsdangerous `TimestampSigner` token (HMAC-SHA256,
key derived from the signing keys per purpose; every configured key verifies, the first one
signs) over the URL-safe base64 of the compact JSON payload. The payload is readable by the
client, so it carries only: a keyed digest of the principal, the OAuth client id, method, tool
name, a digest of the arguments, the flow id and input key, and small tool data. Never identity,
tokens or provider data. Whether the interaction finished lives in the flows table, not here.

Every state is checked on a hot path (each MCP retry), so the codec derives its keys once, at
start, with itsdangerous's own derivation, and then signs and checks tokens of that exact layout
with HMAC-SHA256 and `hmac.compare_digest` directly: itsdangerous's general code path (byte
coercion, a fresh HMAC key setup per call, padding-tolerant decoding) cost twice as much.
Tests check tokens both ways against itsdangerous's `TimestampSigner`.

Any failure is one `StateRejected` with a machine reason (`invalid`, `expired`,
`principal_mismatch`, `request_mismatch`), which `/mcp` answers as JSON-RPC -32602 and the
integration API as its `invalid_request_state` problem; the blob itself is never logged.
"""

from __future__ import annotations

import binascii
import functools
import hashlib
import hmac
import logging
import time
from dataclasses import dataclass
from typing import Any

from itsdangerous import TimestampSigner

from app import jsonbytes
from app.auth.bearer import CACHE_SIZE as TOKEN_CACHE_SIZE
from app.auth.principal import McpCaller
from app.crypto import Keyring, hmac_digest, hmac_sha256

logger = logging.getLogger("broker.security")

MAX_STATE_LENGTH = 8192
SALT = "mcp.requestState.v1"
# as many users as the verified-token cache holds: smaller, a load of more users than the
# digest cache holds (and fewer than the token cache) would compute every digest again
PRINCIPAL_CACHE_SIZE = TOKEN_CACHE_SIZE


class StateRejected(Exception):
    """A `requestState` that cannot be used; `reason` says why, for the client."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


@dataclass(slots=True)  # built per request; frozen would cost an object.__setattr__ per field
class StatePayload:
    """What a verified state says beyond its binding."""

    flow_id: str | None
    input_key: str | None
    data: Any


def arguments_digest(arguments: dict[str, Any]) -> str:
    """SHA-256 of the arguments as compact JSON with sorted keys."""
    return hashlib.sha256(jsonbytes.dumps(arguments, sort_keys=True)).hexdigest()


def _state_keys(keys: Keyring) -> tuple[bytes, ...]:
    """The HMAC keys of our signing keys, active first: itsdangerous's derivation (salt SALT,
    SHA-256), as a `TimestampSigner(key, salt=SALT, digest_method=sha256)` would use them."""
    return tuple(
        TimestampSigner(key, salt=SALT, digest_method=hashlib.sha256).derive_key()
        for key in keys.derive("request-state")
    )


_URL_SAFE = bytes.maketrans(b"+/", b"-_")
_STANDARD = bytes.maketrans(b"-_", b"+/")


def _b64(data: bytes) -> bytes:
    """URL-safe base64 without padding, as itsdangerous writes it."""
    return binascii.b2a_base64(data, newline=False).translate(_URL_SAFE).rstrip(b"=")


def _unb64(data: bytes) -> bytes:
    """The bytes of `_b64` text. Only signed text is decoded, so no strictness is needed."""
    return binascii.a2b_base64(data.translate(_STANDARD) + b"=" * (-len(data) % 4))


class _Expired(Exception):
    pass


class _Invalid(Exception):
    pass


class RequestStateCodec:
    def __init__(self, keys: Keyring, *, max_age: int) -> None:
        self._keys = _state_keys(keys)
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
        now = int(time.time())
        stamp = now.to_bytes((now.bit_length() + 7) // 8, "big")  # as itsdangerous writes it
        value = b"%s.%s" % (_b64(jsonbytes.dumps(payload)), _b64(stamp))
        signature = _b64(hmac_sha256(self._keys[0], value))
        return (value + b"." + signature).decode("ascii")

    def _unsign(self, state: str) -> bytes:
        """The payload bytes of a token that one of our keys signed within max_age seconds."""
        try:
            token = state.encode("ascii")
        except UnicodeEncodeError:
            raise _Invalid() from None
        value, _, signature = token.rpartition(b".")
        if not any(
            hmac.compare_digest(_b64(hmac_sha256(key, value)), signature) for key in self._keys
        ):
            raise _Invalid()
        payload, _, stamp = value.rpartition(b".")
        try:
            issued = int.from_bytes(_unb64(stamp), "big")
            document = _unb64(payload)
        except (binascii.Error, ValueError):
            raise _Invalid() from None
        age = int(time.time()) - issued
        if age > self._max_age or age < 0:
            raise _Expired()
        return document

    def verify(
        self, state: object, caller: McpCaller, *, method: str, name: str, arguments_digest: str
    ) -> StatePayload:
        """Check integrity, age, principal and request binding.

        Raises:
            StateRejected: with its `reason`.
        """
        if not isinstance(state, str) or not state or len(state) > MAX_STATE_LENGTH:
            raise self._reject("invalid")
        try:
            payload = jsonbytes.loads(self._unsign(state))
        except _Expired:
            raise self._reject("expired") from None
        except (_Invalid, ValueError):  # a bad signature, encoding or JSON
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
    def _reject(reason: str) -> StateRejected:
        logger.warning("request_state.invalid reason=%s", reason)
        return StateRejected(reason)
