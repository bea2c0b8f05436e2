"""The tests' HTTP clients, all on one TLS context.

The suite speaks plain HTTP to 127.0.0.1, yet httpx2 builds a new TLS context, loading the
system's CA bundle into it, for every client it creates (`httpx2.get` creates one per call):
about 25 ms of CPU each, and the suite creates thousands. Every test client shares this one
context instead, and none reads proxy settings from the environment.
"""

from __future__ import annotations

import ssl
from typing import Any

import httpx2

TLS = ssl.create_default_context()


def local_client(**options: Any) -> httpx2.AsyncClient:
    """`httpx2.AsyncClient(**options)` on the shared context, ignoring proxy settings."""
    return httpx2.AsyncClient(trust_env=False, verify=TLS, **options)


def local_get(url: str, **options: Any) -> httpx2.Response:
    """`httpx2.get(url, **options)` on the shared context, ignoring proxy settings."""
    return httpx2.get(url, trust_env=False, verify=TLS, **options)
