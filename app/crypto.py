"""Random tokens, keyed digests and authenticated encryption. The only importer of `cryptography`.

Keys come from `[keys]` as "<key-id>:<base64url 32 bytes>"; the first key of each list is the
active one, the others still open or verify what they produced (rotation without downtime).

- `digest()` is HMAC-SHA256 under a subkey derived (HKDF) from the active signing key with a
  purpose label; used for values we only compare (session ids, OAuth `state`, service secrets).
- `seal()` is AES-256-GCM. A sealed value reads "v1.<key id>.<nonce>.<ciphertext>" (base64url
  parts). The caller's `purpose` is the associated data, so a value sealed for one purpose or owner
  (e.g. "cred:v1|<iss>|<sub>|<provider>") cannot be opened as another: a ciphertext copied to
  another user's row fails with InvalidSeal.
"""

from __future__ import annotations

import base64
import binascii
import functools
import hashlib
import hmac
import os
import secrets
from dataclasses import dataclass

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF


class InvalidSeal(Exception):
    """A sealed value was malformed, tampered with, sealed for another purpose or by a lost key."""


def b64encode(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode("ascii")


def b64decode(text: str) -> bytes:
    """Unpadded base64url, decoded as `base64.urlsafe_b64decode` decodes it (characters outside
    the alphabet are skipped; a non-ASCII text raises a ValueError), with fewer steps: a sealed
    credential is opened on every credential fetch."""
    data = text.encode("ascii").translate(_FROM_URLSAFE)
    return binascii.a2b_base64(data + b"=" * (-len(data) % 4))


_FROM_URLSAFE = bytes.maketrans(b"-_", b"+/")


def random_token() -> str:
    """256 random bits, URL-safe (43 characters): flow ids, OAuth state, CSRF and session ids."""
    return secrets.token_urlsafe(32)


def generate_key(key_id: str) -> str:
    return f"{key_id}:{b64encode(os.urandom(32))}"


def parse_key(text: str) -> tuple[str, bytes]:
    key_id, _, material = text.partition(":")
    raw = b64decode(material)
    if len(raw) != 32:
        raise ValueError("a key is 32 bytes")
    return key_id, raw


@dataclass(frozen=True)
class Keyring:
    """Ordered keys by id; the first one is used for new values."""

    keys: tuple[tuple[str, bytes], ...]

    @classmethod
    def parse(cls, texts: tuple[str, ...]) -> Keyring:
        if not texts:
            raise ValueError("a keyring needs at least one key")
        return cls(tuple(parse_key(text) for text in texts))

    def current(self) -> tuple[str, bytes]:
        return self.keys[0]

    def get(self, key_id: str) -> bytes:
        for candidate, key in self.keys:
            if candidate == key_id:
                return key
        raise KeyError(key_id)

    def derive(self, purpose: str) -> list[bytes]:
        """Per-purpose subkeys of every key, active first (for HMAC and itsdangerous)."""
        return list(_derived(self.keys, purpose))


@dataclass(frozen=True)
class Keys:
    """The broker's two keyrings: `signing` (HMAC digests, cookies, requestState) and `sealing`
    (credentials and other values stored encrypted)."""

    signing: Keyring
    sealing: Keyring

    @classmethod
    def parse(cls, signing: tuple[str, ...], sealing: tuple[str, ...]) -> Keys:
        return cls(Keyring.parse(signing), Keyring.parse(sealing))


@functools.lru_cache(maxsize=64)
def _derived(keys: tuple[tuple[str, bytes], ...], purpose: str) -> tuple[bytes, ...]:
    """HKDF is the costliest step of a per-request digest; the subkeys never change."""
    return tuple(_hkdf(key, purpose) for _, key in keys)


def _hkdf(key: bytes, purpose: str) -> bytes:
    return HKDF(algorithm=hashes.SHA256(), length=32, salt=None, info=purpose.encode()).derive(key)


def hmac_sha256(key: bytes, message: bytes) -> bytes:
    """HMAC-SHA256. The keyed state is made once per key and copied for each message
    (`HMAC.copy`): keying OpenSSL again costs more than the digest of a short message."""
    mac = _keyed_sha256(key).copy()
    mac.update(message)
    return mac.digest()


@functools.lru_cache(maxsize=64)
def _keyed_sha256(key: bytes) -> hmac.HMAC:
    return hmac.new(key, digestmod="sha256")


def hmac_digest(key: bytes, value: str) -> str:
    """HMAC-SHA256 in hex."""
    return hmac_sha256(key, value.encode()).hex()


class Digester:
    """Keyed digests for one purpose, so a database dump reveals no usable value."""

    def __init__(self, keyring: Keyring, purpose: str) -> None:
        self._key = keyring.derive(f"digest:{purpose}")[0]

    def __call__(self, value: str) -> str:
        return hmac_digest(self._key, value)


def seal(plaintext: bytes, *, purpose: str, keys: Keyring) -> str:
    """Encrypt and authenticate `plaintext`, binding `purpose` as associated data."""
    key_id, key = keys.current()
    nonce = os.urandom(12)
    box = _cipher(key).encrypt(nonce, plaintext, f"{purpose}|{key_id}".encode())
    return ".".join(("v1", key_id, b64encode(nonce), b64encode(box)))


def unseal(sealed: str, *, purpose: str, keys: Keyring) -> bytes:
    """Open a value made by `seal` with the same purpose.

    Raises:
        InvalidSeal: for any malformed, foreign or tampered value.
    """
    try:
        version, key_id, nonce, box = sealed.split(".")
        if version != "v1":
            raise InvalidSeal()
        key = keys.get(key_id)
        return _cipher(key).decrypt(
            b64decode(nonce), b64decode(box), f"{purpose}|{key_id}".encode()
        )
    except (ValueError, KeyError, InvalidTag):
        raise InvalidSeal() from None


@functools.lru_cache(maxsize=64)
def _cipher(key: bytes) -> AESGCM:
    """One AES-GCM context per key (each call then needs only its nonce): opening a credential
    is on the credential-fetch hot path."""
    return AESGCM(key)


def sealed_key_id(sealed: str) -> str:
    """The key id a sealed value was made with (for rotation); not secret."""
    return sealed.split(".")[1]


def pkce_challenge(verifier: str) -> str:
    return b64encode(hashlib.sha256(verifier.encode("ascii")).digest())


def constant_time_equal(a: str, b: str) -> bool:
    return hmac.compare_digest(a.encode(), b.encode())
