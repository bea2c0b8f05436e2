"""Checks for a submitted API key: shape, the provider's pattern, an optional validation probe.

The probe's URL is server configuration, never request input (no SSRF through the form). It runs
under a total deadline, follows no redirects and reads no body. The key is never logged.
"""

from __future__ import annotations

import asyncio
import logging
import re

import httpx2

from app.providers.settings import ApiKeyProviderSettings

logger = logging.getLogger("broker.providers")

MAX_KEY_LENGTH = 4096


class KeyRejected(Exception):
    """The key cannot be accepted; `message` tells the user why (without echoing the key)."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class ProbeUnavailable(Exception):
    """The provider could not be asked in time; the user may try again."""


def check_shape(provider: ApiKeyProviderSettings, key: str) -> str:
    """The key, stripped of surrounding spaces, if it may be stored.

    A key goes out in an HTTP header (the probe's, and every later use of it), and headers are
    ASCII: a printable non-ASCII key ("sk_é…", a look-alike letter pasted in) could never be
    sent, so it is refused here, with a message, rather than failing wherever it is used.

    Raises:
        KeyRejected: empty, too long, control or non-ASCII characters, or not matching the
            pattern.
    """
    key = key.strip()
    if not key:
        raise KeyRejected(f"Enter your {provider.label}.")
    if len(key) > MAX_KEY_LENGTH:
        raise KeyRejected(f"That {provider.label} is too long.")
    if any(not ch.isprintable() for ch in key):
        raise KeyRejected(f"That {provider.label} contains control characters.")
    if not key.isascii():
        raise KeyRejected(
            f"That {provider.label} contains characters other than plain ASCII letters, digits "
            f"and punctuation. Copy it again from {provider.display_name}."
        )
    if not re.fullmatch(provider.pattern, key):
        raise KeyRejected(f"That does not look like a {provider.display_name} {provider.label}.")
    return key


async def probe(provider: ApiKeyProviderSettings, key: str, *, http: httpx2.AsyncClient) -> None:
    """Ask the provider whether the key works, when a validation request is configured.

    Only the status is read: the response is streamed and closed unread, so an answer of any
    size costs no memory (a buffered read would hold all of it before the status is looked at).

    Raises:
        KeyRejected: the provider answered, and not with 2xx.
        ProbeUnavailable: no answer within the deadline, or a network error.
    """
    validation = provider.validation
    if validation is None:
        return
    name, _, template = validation.header.partition(":")
    headers = {name.strip(): template.strip().replace("{api_key}", key)}
    request = http.build_request(validation.method, validation.url, headers=headers)
    try:
        async with asyncio.timeout(validation.timeout_seconds):
            response = await http.send(request, stream=True, follow_redirects=False)
            await response.aclose()
    except (TimeoutError, httpx2.HTTPError) as exc:
        logger.warning(
            "api_key.probe_unavailable provider=%s error=%s",
            provider.display_name,
            type(exc).__name__,
        )
        raise ProbeUnavailable() from None
    if not 200 <= response.status_code < 300:
        logger.info("api_key.rejected_by_provider status=%d", response.status_code)
        raise KeyRejected(f"{provider.display_name} did not accept this {provider.label}.")
