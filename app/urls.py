"""The rule for a URL the broker puts in front of users or calls with secrets: its own public URL,
the IdP's issuer and, once discovered, the endpoints of the IdP's and providers' metadata.

Below every layer (app/config.py and app/auth/ both use it), so it imports nothing of the app.
"""

from __future__ import annotations

import ipaddress
from urllib.parse import urlsplit

LOOPBACK_HOSTS = {"localhost", "127.0.0.1", "::1"}


def validate_public_url(value: str) -> str:
    """Accept only an absolute http(s) origin-plus-path we can safely put in elicitation URLs."""
    if not value.isascii():
        raise ValueError("must be ASCII (a look-alike host is refused; use the punycode form?)")
    parts = urlsplit(value)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError("must be an absolute http(s) URL")
    if parts.username or parts.password:
        raise ValueError("must not contain user info")
    if parts.query or parts.fragment or value.endswith(("?", "#")):
        raise ValueError("must not contain a query or fragment")
    if any(label.startswith("xn--") for label in parts.hostname.split(".")):
        raise ValueError("punycode (xn--) hosts are refused: they can imitate another name")
    if parts.scheme == "http" and not is_loopback_host(parts.hostname):
        raise ValueError("must use https (http is allowed only for loopback hosts)")
    return value.rstrip("/")


def is_loopback_host(host: str) -> bool:
    if host in LOOPBACK_HOSTS:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
