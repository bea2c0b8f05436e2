"""The requestState codec against itsdangerous: the broker signs and checks its tokens itself, in
exactly the layout of an itsdangerous `TimestampSigner` token, so each side must accept what the
other signs and both must refuse the same damaged tokens (C1-C3 at the codec level)."""

from __future__ import annotations

import hashlib
import json
import time
from typing import Any

import pytest
import time_machine
from itsdangerous import BadSignature, SignatureExpired, TimestampSigner
from itsdangerous.encoding import base64_decode, base64_encode

from app.auth.principal import McpCaller, Principal
from app.connect.request_state import SALT, RequestStateCodec, StateRejected, arguments_digest
from app.crypto import Keyring, generate_key

MAX_AGE = 600
CALLER = McpCaller(Principal("https://idp.example", "alice"), "client-1", frozenset())
BINDING: dict[str, Any] = {
    "method": "tools/call",
    "name": "connect_account",
    "arguments_digest": arguments_digest({"provider": "demo"}),
}


@pytest.fixture
def keys() -> Keyring:
    return Keyring.parse((generate_key("s1"),))


def reference_signer(keys: Keyring) -> TimestampSigner:
    """itsdangerous itself, with its own key derivation from our request-state subkey."""
    return TimestampSigner(keys.derive("request-state")[0], salt=SALT, digest_method=hashlib.sha256)


def refusal_by_both(keys: Keyring, codec: RequestStateCodec, state: str, theirs: type) -> str:
    """The codec's reason for refusing `state`, once itsdangerous has refused it with `theirs`
    (`/mcp` sends it as -32602 `data.reason`: tests/mcp/test_retry.py)."""
    with pytest.raises(theirs):
        reference_signer(keys).unsign(state, max_age=MAX_AGE)
    with pytest.raises(StateRejected) as refused:
        codec.verify(state, CALLER, **BINDING)
    return refused.value.reason


def test_itsdangerous_accepts_what_the_codec_signs(keys: Keyring) -> None:
    codec = RequestStateCodec(keys, max_age=MAX_AGE)
    state = codec.issue(CALLER, **BINDING, flow_id="f" * 43, input_key="connect_demo")

    signed, issued = reference_signer(keys).unsign(state, max_age=MAX_AGE, return_timestamp=True)

    payload = json.loads(base64_decode(signed))
    assert payload["f"] == "f" * 43
    assert payload["k"] == "connect_demo"
    assert payload["n"] == "connect_account"
    assert abs(issued.timestamp() - time.time()) < 5


def test_the_codec_accepts_what_itsdangerous_signs(keys: Keyring) -> None:
    codec = RequestStateCodec(keys, max_age=MAX_AGE)
    genuine = json.loads(base64_decode(codec.issue(CALLER, **BINDING).split(".")[0]))
    genuine["f"], genuine["k"] = "flow-1", "connect_demo"
    state = reference_signer(keys).sign(base64_encode(json.dumps(genuine))).decode()

    verified = codec.verify(state, CALLER, **BINDING)

    assert (verified.flow_id, verified.input_key) == ("flow-1", "connect_demo")


def damaged(state: str) -> dict[str, str]:
    payload, stamp, signature = state.split(".")
    flipped = "B" if signature[0] != "B" else "C"
    return {
        "signature": f"{payload}.{stamp}.{flipped}{signature[1:]}",
        "payload": f"{payload[:-2]}{'x' if payload[-2] != 'x' else 'y'}{payload[-1]}"
        f".{stamp}.{signature}",
        "stamp": f"{payload}.{stamp[:-1]}{'A' if stamp[-1] != 'A' else 'B'}.{signature}",
        "appended": f"{state}x",
        "truncated": state[:-1],
        "no-separators": state.replace(".", ""),
        "non-ascii": f"{state[:-1]}é",
        "empty-signature": f"{payload}.{stamp}.",
    }


@pytest.mark.parametrize(
    "damage",
    [
        "signature",
        "payload",
        "stamp",
        "appended",
        "truncated",
        "no-separators",
        "non-ascii",
        "empty-signature",
    ],
)
def test_c1_a_damaged_token_is_invalid_for_both(keys: Keyring, damage: str) -> None:
    codec = RequestStateCodec(keys, max_age=MAX_AGE)
    token = damaged(codec.issue(CALLER, **BINDING))[damage]

    assert refusal_by_both(keys, codec, token, BadSignature) == "invalid"


def test_c2_a_token_of_another_key_is_invalid(keys: Keyring) -> None:
    other = RequestStateCodec(Keyring.parse((generate_key("s1"),)), max_age=MAX_AGE)
    state = other.issue(CALLER, **BINDING)

    codec = RequestStateCodec(keys, max_age=MAX_AGE)
    assert refusal_by_both(keys, codec, state, BadSignature) == "invalid"


@pytest.mark.parametrize(("shift", "outcome"), [(-MAX_AGE - 1, "expired"), (-MAX_AGE + 1, "ok")])
def test_c3_age_is_checked_to_the_second(keys: Keyring, shift: int, outcome: str) -> None:
    codec = RequestStateCodec(keys, max_age=MAX_AGE)
    with time_machine.travel(time.time() + shift, tick=False):
        state = codec.issue(CALLER, **BINDING)

    if outcome == "ok":
        codec.verify(state, CALLER, **BINDING)
        reference_signer(keys).unsign(state, max_age=MAX_AGE)
        return
    assert refusal_by_both(keys, codec, state, SignatureExpired) == "expired"


def test_c3_a_token_from_the_future_is_refused(keys: Keyring) -> None:
    """A clock far ahead on the issuing side must not stretch a state's lifetime."""
    codec = RequestStateCodec(keys, max_age=MAX_AGE)
    with time_machine.travel(time.time() + 3600, tick=False):
        state = codec.issue(CALLER, **BINDING)

    assert refusal_by_both(keys, codec, state, SignatureExpired) == "expired"
